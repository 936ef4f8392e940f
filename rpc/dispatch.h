#pragma once

// The callee's side of a call (internal; docs/rpc.md, "Threads"): checks a
// request against the registry, lets the extension it names (rref/'s, for
// remote() and methods on RRefs) and distributed autograd take part, runs
// the user function on the worker pool (or on the loop for functions
// marked runOnLoop: internal messages that never block and user functions
// registered with TRELLIS_REMOTE_INLINE), and encodes the response with its
// profile event.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "envelope.h"
#include <trellis/core/deadline.h>
#include <trellis/core/lifeline.h>
#include <trellis/core/mutex.h>
#include <trellis/core/thread_pool.h>
#include <trellis/rpc/agent.h>
#include <trellis/rpc/extension.h>
#include <trellis/rpc/profiler.h>

namespace trellis::rpc::detail {

class Dispatcher {
 public:
  // Writes a response to the caller; called exactly once per request, on
  // any thread.
  using Respond = std::function<void(const wire::Envelope& env, Encoder&& body,
                                     std::shared_ptr<CodecContext> context)>;

  struct Request {
    std::shared_ptr<wire::Envelope> env;  // parsed and checked
    Reply body;                           // arguments; from = the caller
    Clock::time_point arrived;
    Respond respond;
  };

  // Whether a request is answered (false for one-way requests): what the
  // hooks below get.
  using RequestHook = std::function<void(bool replies)>;

  // `done` runs after each request's response was handed to `respond` (or
  // the request was dropped by a pool closed at once).
  Dispatcher(Agent* agent, const WorkerInfo& self, const Extensions& extensions,
             size_t threads, RequestHook done);
  ~Dispatcher();
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  // On the transport loop: runs the request there (runOnLoop functions)
  // or on the worker pool.
  void dispatch(Request request);
  // `held` runs when a request is held at admission (its worker thread
  // is given back), `resumed` when it goes on. Call before any request.
  void setHoldHooks(RequestHook held, RequestHook resumed) {
    held_ = std::move(held);
    resumed_ = std::move(resumed);
  }

  // Checks that a result fits one message to the caller (rank `peer`);
  // one that does not is answered with the check's error instead, so the
  // pipe is not closed over it. Call before any request.
  using ReplyCheck = std::function<Error(int32_t peer, const Encoder& body)>;
  void setReplyCheck(ReplyCheck check) { replyCheck_ = std::move(check); }

  // Requests received and not yet answered.
  uint64_t running() const { return running_.load(); }
  // Inline functions that held the loop longer than the threshold.
  uint64_t slowInlineRuns() const {
    return slowInlineRuns_.load(std::memory_order_relaxed);
  }
  bool inPool() const { return pool_.inPool(); }
  // Runs `task` on a worker thread (Agent::runOnWorkerThread).
  void post(ThreadPool::Task task) { pool_.post(std::move(task)); }
  // Closing at once: queued requests are dropped (their callers' calls
  // fail on their side), running ones finish; joins the pool. A result
  // that completes later (an async function's future, a request held at
  // admission) is dropped: nothing of this object or of `respond` is
  // touched after close() has returned, so the agent may be freed.
  void close();

 private:
  // `entry`: the request's function, null when it is not registered here.
  void handle(Request& request, const FunctionEntry* entry);
  // Runs an inline function on the calling (loop) thread and checks how
  // long it held it (docs/rpc.md, "Inline functions").
  void runInline(Request& request, const FunctionEntry* entry);
  void reportSlowInline(const FunctionEntry& entry, Duration took, Duration cpu,
                        long waits);
  // `nested` (profiled requests only) collects the events of the calls the
  // function makes; they ride the response.
  // The second half of handle(), once the request is admitted. `gate`:
  // the extension that admitted it (requestDone goes to it once the
  // result is encoded), null when it was not gated.
  void run(Request& request, const FunctionEntry* entry,
           std::shared_ptr<GradReceiver> receiver, int64_t profileStartUs,
           std::shared_ptr<NestedEvents> nested, AgentExtension* gate);
  // `stepSafe`: the function's entry is (its reply's send function does
  // not hold the step gate).
  void respond(Request& request, const Future<AnyValue>& result,
               int64_t profileStartUs,
               std::shared_ptr<NestedEvents> nested = nullptr,
               AgentExtension* gate = nullptr, bool stepSafe = false);

  Agent* agent_;
  const WorkerInfo& self_;
  const Extensions& extensions_;
  RequestHook done_;
  // Set once before the first request (setHoldHooks).
  RequestHook held_;
  RequestHook resumed_;
  ReplyCheck replyCheck_;
  ThreadPool pool_;
  std::atomic<uint64_t> running_{0};
  std::atomic<uint64_t> slowInlineRuns_{0};
  Mutex slowMu_;
  std::unordered_map<std::string, Clock::time_point> lastSlowWarning_
      TRELLIS_GUARDED_BY(slowMu_);
  // Inline functions whose last run held the loop past the threshold by
  // the wall clock: their next run is also measured by the thread's CPU
  // time and waits (two system calls), which tell a function that
  // computes or blocks from one whose thread was preempted. `suspects_`
  // is their number, so that other runs pay one atomic load.
  std::atomic<size_t> suspects_{0};
  std::unordered_set<const FunctionEntry*> suspect_ TRELLIS_GUARDED_BY(slowMu_);
  // The callbacks on futures (results, admissions) run through it; close()
  // cuts it, since those futures may complete on any thread at any time.
  const std::shared_ptr<Lifeline> lifeline_ = std::make_shared<Lifeline>();
};

}  // namespace trellis::rpc::detail
