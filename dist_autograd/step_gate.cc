#include <algorithm>
#include <chrono>
#include <utility>

#include <trellis/core/error.h>
#include <trellis/core/thread_name.h>
#include <trellis/dist_autograd/messages.h>
#include <trellis/dist_autograd/step_gate.h>

namespace trellis::dist_autograd::detail {

namespace {

// The fast path's answer: one completed future shared by every admission,
// so that admitting a request allocates nothing. Callbacks added to it run
// at once on the adding thread and are not kept.
const Future<void>& admittedNow() {
  static const Future<void> ready = makeReadyFuture();
  return ready;
}

}  // namespace

StepGate::StepGate(std::string worker) : worker_(std::move(worker)) {}

StepGate::~StepGate() {
  std::vector<Held> held;
  std::vector<Writer> waiting;
  {
    MutexLock lock(mu_);
    stopping_ = true;
    held.swap(held_);
    waiting.swap(waiting_);
  }
  timerCv_.notifyAll();
  if (timer_.joinable()) {
    if (timer_.get_id() == std::this_thread::get_id()) {
      timer_.detach();  // the last owner went away in a timer callback
    } else {
      timer_.join();
    }
  }
  const Error cancelled = Error::cancelled(
      "distributed-autograd step gate of worker '" + worker_ + "' destroyed");
  for (auto& h : held) {
    h.promise.setError(cancelled);
  }
  for (auto& w : waiting) {
    w.promise.setError(cancelled);
  }
}

template <typename F>
void StepGate::change(GateSlot& s, F&& f, Completions& done) {
  const bool wasReading = s.reading();
  const bool wasCounted = wasReading && s.writing > 0;
  f(s);
  const bool isReading = s.reading();
  const bool isCounted = isReading && s.writing > 0;
  if (wasReading != isReading) {
    if (isReading) {
      s.prev = nullptr;
      s.next = head_;
      if (head_ != nullptr) {
        head_->prev = &s;
      }
      head_ = &s;
      s.listed = true;
      ++reading_;
    } else {
      (s.prev != nullptr ? s.prev->next : head_) = s.next;
      if (s.next != nullptr) {
        s.next->prev = s.prev;
      }
      s.prev = s.next = nullptr;
      s.listed = false;
      --reading_;
    }
  }
  if (wasCounted != isCounted) {
    isCounted ? ++readingWriting_ : --readingWriting_;
  }
  if (!waiting_.empty() && writersMayGo()) {
    letWritersGo(done);
  }
}

bool StepGate::writersMayGo() const { return reading_ == readingWriting_; }

void StepGate::letWritersGo(Completions& done) {
  for (auto& w : waiting_) {
    done.emplace_back(std::move(w.promise), Error());
  }
  waiting_.clear();
}

void StepGate::admitHeld(Completions& done) {
  std::vector<Held> held;
  held.swap(held_);
  for (auto& h : held) {
    if (h.slot->released) {
      done.emplace_back(
          std::move(h.promise),
          Error(Code::kFailedPrecondition,
                "distributed-autograd " + contextName(h.slot->id) +
                    " was released on worker '" + worker_ +
                    "' while its request waited for an optimizer step"));
      continue;
    }
    change(
        *h.slot, [](GateSlot& s) { ++s.running; }, done);
    done.emplace_back(std::move(h.promise), Error());
  }
}

void StepGate::endWriter(Completions& done) {
  --writers_;
  // Phase change: the requests held behind the writers so far go in now,
  // even if more writers wait (those then wait for these readers).
  admitHeld(done);
}

void StepGate::complete(Completions& done) {
  for (auto& [promise, error] : done) {
    if (error.ok()) {
      promise.setValue();
    } else {
      promise.setError(std::move(error));
    }
  }
}

Future<void> StepGate::admit(const std::shared_ptr<GateSlot>& slot,
                             Deadline deadline) {
  Completions done;
  Future<void> out;
  {
    MutexLock lock(mu_);
    GateSlot& s = *slot;
    if (s.released) {
      out = makeErrorFuture<void>(
          Error(Code::kFailedPrecondition,
                "distributed-autograd " + contextName(s.id) +
                    " was released on worker '" + worker_ + "'"));
    } else if (writers_ == 0 || s.reading()) {
      change(
          s, [](GateSlot& g) { ++g.running; }, done);
      out = admittedNow();
    } else if (deadline.expired()) {
      out = makeErrorFuture<void>(Error::timeout(
          "a request of distributed-autograd " + contextName(s.id) +
          " reached worker '" + worker_ +
          "' after its timeout, while an optimizer step waited"));
    } else {
      Held h{slot, Promise<void>(), deadline};
      out = h.promise.getFuture();
      held_.push_back(std::move(h));
      if (!deadline.isNever()) {
        ensureTimer();
      }
    }
  }
  if (!out.completed()) {
    timerCv_.notifyAll();
  }
  complete(done);  // empty: admitting a reader lets no writer through
  return out;
}

void StepGate::requestDone(GateSlot& slot) {
  Completions done;
  {
    MutexLock lock(mu_);
    change(
        slot,
        [](GateSlot& s) {
          if (s.running > 0) {
            --s.running;
          }
        },
        done);
  }
  complete(done);
}

void StepGate::sendRecorded(GateSlot& slot) {
  Completions done;
  MutexLock lock(mu_);
  change(
      slot, [](GateSlot& s) { ++s.pendingSends; }, done);
  // Recording a send never ends a reader, so `done` stays empty.
}

void StepGate::sendAnswered(GateSlot& slot) { sendsDropped(slot, 1); }

void StepGate::sendsDropped(GateSlot& slot, uint32_t n) {
  Completions done;
  {
    MutexLock lock(mu_);
    change(
        slot,
        [n](GateSlot& s) { s.pendingSends -= std::min(s.pendingSends, n); },
        done);
  }
  complete(done);
}

void StepGate::release(GateSlot& slot) {
  Completions done;
  {
    MutexLock lock(mu_);
    change(
        slot, [](GateSlot& s) { s.released = true; }, done);
  }
  complete(done);
}

Future<void> StepGate::beginWrite(const std::shared_ptr<GateSlot>& slot,
                                  Deadline deadline, std::string what) {
  Completions done;
  Future<void> out;
  bool wake = false;
  {
    MutexLock lock(mu_);
    ++writers_;
    Writer w{slot, Promise<void>(), deadline, Clock::now(), std::move(what)};
    out = w.promise.getFuture();
    waiting_.push_back(std::move(w));
    // Counts this context's own reading as writing; may let it through.
    change(
        *slot, [](GateSlot& s) { ++s.writing; }, done);
    if (!waiting_.empty() && !deadline.isNever()) {
      ensureTimer();
      wake = true;
    }
  }
  if (wake) {
    timerCv_.notifyAll();
  }
  complete(done);
  return out;
}

void StepGate::endWrite(GateSlot& slot) {
  Completions done;
  {
    MutexLock lock(mu_);
    change(
        slot, [](GateSlot& s) { --s.writing; }, done);
    endWriter(done);
  }
  complete(done);
}

std::string StepGate::describeReaders() const {
  std::string out;
  size_t n = 0;
  for (const GateSlot* s = head_; s != nullptr; s = s->next) {
    if (s->writing > 0) {
      continue;  // stepping itself: not what a writer waits for
    }
    if (++n <= 16) {
      out += (out.empty() ? "" : ", ") + contextName(s->id);
    }
  }
  if (n > 16) {
    out += " and " + std::to_string(n - 16) + " more";
  }
  return n == 0 ? std::string("contexts (none left)") : out;
}

StepGate::Counts StepGate::counts() const {
  MutexLock lock(mu_);
  return {reading_, writers_, held_.size()};
}

void StepGate::ensureTimer() {
  if (!timer_.joinable() && !stopping_) {
    timer_ = std::thread([this] {
      setThreadName("dag-step-timer");
      timerLoop();
    });
  }
}

void StepGate::timerLoop() {
  for (;;) {
    Completions done;
    {
      MutexLock lock(mu_);
      if (stopping_) {
        return;
      }
      Deadline next = Deadline::never();
      for (const auto& h : held_) {
        next = earliest(next, h.deadline);
      }
      for (const auto& w : waiting_) {
        next = earliest(next, w.deadline);
      }
      if (next.isNever()) {
        timerCv_.wait(mu_);
        continue;
      }
      if (!next.expired()) {
        timerCv_.waitUntil(mu_, next.timePoint());
        continue;
      }
      for (auto it = held_.begin(); it != held_.end();) {
        if (!it->deadline.expired()) {
          ++it;
          continue;
        }
        done.emplace_back(
            std::move(it->promise),
            Error::timeout("a request of distributed-autograd " +
                           contextName(it->slot->id) + " waited on worker '" +
                           worker_ +
                           "' longer than its timeout for an optimizer step to "
                           "finish, and was not run"));
        it = held_.erase(it);
      }
      std::vector<Writer> expired;
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if (it->deadline.expired()) {
          expired.push_back(std::move(*it));
          it = waiting_.erase(it);
        } else {
          ++it;
        }
      }
      for (auto& w : expired) {
        done.emplace_back(
            std::move(w.promise),
            Error::timeout(w.what + " on worker '" + worker_ + "' waited " +
                           formatDuration(std::chrono::duration_cast<Duration>(
                               Clock::now() - w.since)) +
                           " for distributed-autograd " + describeReaders() +
                           " to finish the backward passes that "
                           "need the current parameter values "
                           "here (or to be released); not "
                           "stepped"));
        change(
            *w.slot, [](GateSlot& g) { --g.writing; }, done);
        endWriter(done);
      }
    }
    complete(done);
  }
}

}  // namespace trellis::dist_autograd::detail
