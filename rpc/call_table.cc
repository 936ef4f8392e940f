#include "call_table.h"

#include <functional>

#include "rendezvous.h"
#include <trellis/core/thread_name.h>
#include <trellis/rpc/profiler.h>

namespace trellis::rpc::detail {

namespace {

// The call table whose timer thread this is.
thread_local const CallTable* tTimerOf = nullptr;

}  // namespace

CallTable::CallTable(Agent* agent, ThreadPool& completions,
                     const std::vector<WorkerInfo>& workers)
    : agent_(agent), completions_(completions), workers_(workers) {}

CallTable::~CallTable() { join(); }

void CallTable::start() {
  timerThread_ = std::thread([this] {
    setThreadName("rpc-timer");
    timerLoop();
  });
}

bool CallTable::add(uint64_t id, Call call) {
  bool wakeTimer = false;
  {
    MutexLock lock(mu_);
    if (stopping_) {
      return false;
    }
    if (call.timeout > Duration::zero()) {
      const auto at = Clock::now() + call.timeout;
      call.deadline_ = at;
      call.timer_ = timers_.emplace(at, id);
      call.hasTimer_ = true;
      if (at < timerWakeAt_) {
        timerWakeAt_ = at;
        wakeTimer = true;
      }
    }
    pending_.emplace(id, std::move(call));
    if (wakeTimer) {
      timerCv_.notifyOne();
    }
  }
  return true;
}

std::optional<CallTable::Call> CallTable::take(uint64_t id,
                                               const PipeState* pipe) {
  MutexLock lock(mu_);
  auto it = pending_.find(id);
  if (it == pending_.end() || (pipe != nullptr && it->second.pipe != pipe)) {
    return std::nullopt;
  }
  if (it->second.hasTimer_) {
    timers_.erase(it->second.timer_);
  }
  std::optional<Call> call(std::move(it->second));
  pending_.erase(it);
  if (quiescing_.load(std::memory_order_acquire)) {
    idleCv_.notifyAll();  // under mu_
  }
  return call;
}

void CallTable::fail(uint64_t id, const Error& error) {
  auto call = take(id, nullptr);
  if (!call) {
    return;
  }
  Error e(error.code(), "rpc of '" + call->function + "' to " +
                            describeWorker(workers_[call->to]) + ": " +
                            error.message());
  failLater(std::move(*call), std::move(e));
}

std::vector<uint64_t> CallTable::callsOn(const PipeState* pipe) const {
  std::vector<uint64_t> ids;
  MutexLock lock(mu_);
  for (const auto& [id, call] : pending_) {
    if (call.pipe == pipe) {
      ids.push_back(id);
    }
  }
  return ids;
}

Error CallTable::timedOut(const Call& call) const {
  return Error::timeout("rpc of '" + call.function + "' to " +
                        describeWorker(workers_[call.to]) +
                        " timed out after " + formatDuration(call.timeout));
}

void CallTable::failLater(Call&& call, Error error) {
  completions_.post([agent = agent_, promise = std::move(call.promise),
                     e = std::move(error)](const Error&) mutable {
    CurrentAgentScope scope(agent);
    promise.setError(std::move(e));
  });
}

void CallTable::complete(Call&& call, const wire::Envelope& env, Reply body,
                         const std::string& selfName) const {
  if (call.profiled) {
    const int64_t now = profilerNowUs();
    auto record = [&call](ProfileEvent e) {
      if (call.nested != nullptr) {
        call.nested->add(std::move(e));
      } else {
        Profiler::record(std::move(e));
      }
    };
    record(ProfileEvent{"rpc#" + call.function + " " + selfName + " -> " +
                            workers_[call.to].name,
                        selfName, call.startUs, now - call.startUs,
                        call.thread});
    for (const auto& ev : env.events()) {
      record(ProfileEvent{ev.name(), ev.worker(), ev.start_us(),
                          ev.duration_us(), ev.thread()});
    }
  }
  if (env.has_error()) {
    const auto& info = env.error();
    RemoteOrigin origin{info.worker(), info.function(), info.exception_type()};
    std::string msg = info.message();
    // The code the callee raised with; one this build does not know (a
    // newer or a hostile peer) reads as UNKNOWN.
    const uint32_t raw = info.code();
    const Code code =
        raw >= 1 && raw <= static_cast<uint32_t>(Code::kUnauthenticated)
            ? static_cast<Code>(raw)
            : Code::kUnknown;
    if (code == Code::kDeadlineExceeded && Clock::now() >= call.deadline_) {
      // The callee gave up on the request because this call's own timeout
      // passed (it measures the timeout from the request's arrival: a
      // request held behind an optimizer step, dist_autograd/); only this
      // side's timer was late. The caller gets the TimeoutError its timer
      // would have raised, not a RemoteError that depends on which side
      // noticed first.
      call.promise.setError(timedOut(call));
      return;
    }
    call.promise.setError(
        Error::remote(std::move(origin), std::move(msg), code));
    return;
  }
  body.autogradContextId = env.autograd_context_id();
  body.autogradMessageId = env.autograd_message_id();
  call.promise.setValue(std::move(body));
}

size_t CallTable::size() const {
  MutexLock lock(mu_);
  return pending_.size();
}

std::vector<uint64_t> CallTable::stop() {
  std::vector<uint64_t> ids;
  MutexLock lock(mu_);
  stopping_ = true;
  for (const auto& [id, call] : pending_) {
    ids.push_back(id);
  }
  return ids;
}

bool CallTable::stopped() const {
  MutexLock lock(mu_);
  return stopping_;
}

void CallTable::join() {
  {
    MutexLock lock(mu_);
    closed_ = true;
  }
  timerCv_.notifyAll();
  if (timerThread_.joinable()) {
    timerThread_.join();
  }
}

bool CallTable::onTimerThread() const { return tTimerOf == this; }

void CallTable::timerLoop() {
  tTimerOf = this;
  for (;;) {
    std::vector<Call> expired;
    {
      MutexLock lock(mu_);
      if (closed_) {
        return;
      }
      if (timers_.empty()) {
        timerWakeAt_ = Clock::time_point::max();
        timerCv_.wait(mu_);
        continue;
      }
      const auto next = timers_.begin()->first;
      if (Clock::now() < next) {
        timerWakeAt_ = next;
        timerCv_.waitUntil(mu_, next);
        continue;
      }
      const auto now = Clock::now();
      while (!timers_.empty() && timers_.begin()->first <= now) {
        const uint64_t id = timers_.begin()->second;
        timers_.erase(timers_.begin());
        auto it = pending_.find(id);
        if (it != pending_.end()) {
          it->second.hasTimer_ = false;
          expired.push_back(std::move(it->second));
          pending_.erase(it);
        }
      }
      if (!expired.empty() && quiescing_.load(std::memory_order_acquire)) {
        idleCv_.notifyAll();  // under mu_
      }
    }
    for (auto& call : expired) {
      Error e = timedOut(call);
      failLater(std::move(call), std::move(e));
    }
  }
}

void CallTable::setQuiescing(bool on) {
  quiescing_.store(on, std::memory_order_release);
}

void CallTable::notifyIdle() {
  if (quiescing_.load(std::memory_order_acquire)) {
    // Taken and released so that a waiter between its check and its wait
    // cannot miss this notification.
    { MutexLock lock(mu_); }
    idleCv_.notifyAll();
  }
}

void CallTable::waitIdle(Deadline deadline,
                         const std::function<bool()>& othersIdle) {
  MutexLock lock(mu_);
  while (!(pending_.empty() && othersIdle())) {
    if (deadline.isNever()) {
      idleCv_.wait(mu_);
    } else if (!idleCv_.waitUntil(mu_, deadline.timePoint()) &&
               !(pending_.empty() && othersIdle())) {
      return;
    }
  }
}

}  // namespace trellis::rpc::detail
