#pragma once

// The calls this agent has sent and not yet seen answered (internal;
// docs/rpc.md, "Timeouts"): request ids, deadlines and the timer thread
// that enforces them, the reply that completes a call (or arrives late and
// is dropped), and the failing of calls whose pipe died or whose agent
// closed. Graceful shutdown waits on it for the calls in flight to end.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "envelope.h"
#include <trellis/core/deadline.h>
#include <trellis/core/future.h>
#include <trellis/core/mutex.h>
#include <trellis/core/thread_pool.h>
#include <trellis/rpc/agent.h>
#include <trellis/rpc/profiler.h>

namespace trellis::rpc::detail {

struct PipeState;  // agent.cc

class CallTable {
 public:
  struct Call {
    Promise<Reply> promise;
    int32_t to = -1;
    std::string function;
    // The pipe it was written to: its reply must come back on it, and the
    // pipe's death fails it.
    const PipeState* pipe = nullptr;
    Duration timeout{0};  // zero: none
    bool profiled = false;
    int64_t startUs = 0;
    uint64_t thread = 0;  // profilerThreadId() of the caller
    // Set when the caller is a profiled request's function: the events go
    // to its reply instead of this process's profilers.
    std::shared_ptr<NestedEvents> nested;
    bool completeOnLoop = false;

   private:
    friend class CallTable;
    std::multimap<Clock::time_point, uint64_t>::iterator timer_;
    bool hasTimer_ = false;
    Clock::time_point deadline_ = Clock::time_point::max();
  };

  // `agent` is the agent made current on the completion threads; `workers`
  // names callees in errors (filled by the rendezvous before any call).
  CallTable(Agent* agent, ThreadPool& completions,
            const std::vector<WorkerInfo>& workers);
  ~CallTable();
  CallTable(const CallTable&) = delete;
  CallTable& operator=(const CallTable&) = delete;

  // Starts the timer thread.
  void start();
  uint64_t nextRequestId() { return nextId_.fetch_add(1); }

  // Registers `call` under `id` with its deadline. False (and nothing
  // registered) once stop() was called.
  bool add(uint64_t id, Call call);
  // Removes the call `id` with its timer; empty when it is gone (timed out,
  // failed) or when `pipe` is set and the call went out on another pipe.
  std::optional<Call> take(uint64_t id, const PipeState* pipe);
  // Fails the call `id`, if still pending, with `error` prefixed by the
  // function and callee, on a completion thread.
  void fail(uint64_t id, const Error& error);
  // The ids of the calls written to `pipe` (a pipe that died).
  std::vector<uint64_t> callsOn(const PipeState* pipe) const;

  // Completes `call` with the reply `env` + `body`: the remote error it
  // carries, or the encoded result; records its profile events.
  void complete(Call&& call, const wire::Envelope& env, Reply body,
                const std::string& selfName) const;
  void countLateReply() {
    lateReplies_.fetch_add(1, std::memory_order_relaxed);
  }
  uint64_t lateReplies() const { return lateReplies_.load(); }
  size_t size() const;

  // Closing: stop() refuses new calls and returns the pending ones' ids
  // (for the caller to fail); join() ends the timer thread (after the
  // completion threads are joined).
  std::vector<uint64_t> stop();
  bool stopped() const;
  void join();
  bool onTimerThread() const;

  // Graceful shutdown (quiescence.h): while quiescing, the end of a call
  // or of a request (notifyIdle) wakes waitIdle(), which returns once no
  // call is pending and `othersIdle` holds, or at `deadline`.
  void setQuiescing(bool on);
  void notifyIdle();
  void waitIdle(Deadline deadline, const std::function<bool()>& othersIdle);

 private:
  void timerLoop();
  // The error of a call whose timeout passed.
  Error timedOut(const Call& call) const;
  void failLater(Call&& call, Error error);

  Agent* agent_;
  ThreadPool& completions_;
  const std::vector<WorkerInfo>& workers_;

  // Guards every field below up to the thread: the pending calls, their
  // timers, the timer's wake-up time and the table's state. Held only for
  // bookkeeping, never while a promise completes.
  mutable Mutex mu_;
  CondVar timerCv_;
  CondVar idleCv_;
  std::unordered_map<uint64_t, Call> pending_ TRELLIS_GUARDED_BY(mu_);
  std::multimap<Clock::time_point, uint64_t> timers_ TRELLIS_GUARDED_BY(mu_);
  // When the timer thread wakes next (max while it waits for work). A call
  // wakes it only to move that earlier: sequential calls with the same
  // timeout never do, since each deadline is later than the one it sleeps
  // until.
  Clock::time_point timerWakeAt_ TRELLIS_GUARDED_BY(mu_) =
      Clock::time_point::max();
  bool stopping_ TRELLIS_GUARDED_BY(mu_) = false;  // no new calls
  bool closed_ TRELLIS_GUARDED_BY(mu_) = false;    // the timer thread ends
  std::thread timerThread_;

  std::atomic<uint64_t> nextId_{1};
  std::atomic<uint64_t> lateReplies_{0};
  std::atomic<bool> quiescing_{false};
};

}  // namespace trellis::rpc::detail
