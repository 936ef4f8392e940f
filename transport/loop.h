#pragma once

// Internal: the event loop thread of a Context (docs/transport.md, "Thread
// model"). Not installed.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <uv.h>

#include <trellis/core/deadline.h>
#include <trellis/core/mutex.h>
#include <trellis/core/thread_annotations.h>

namespace trellis::transport {

class Loop final {
 public:
  using Task = std::function<void()>;

  // The thread keeps the Loop alive until it exits, so dropping the last
  // reference on the loop thread itself is safe.
  static std::shared_ptr<Loop> create(std::string id);
  ~Loop();  // joins the thread unless called on it
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;

  uv_loop_t* uv() { return &loop_; }
  const std::string& id() const { return id_; }
  bool inLoop() const {
    return std::this_thread::get_id() ==
           threadId_.load(std::memory_order_acquire);
  }

  // Where loop-owned state (pipes, listeners, connections) may be touched:
  // on the loop thread, or, once that thread has exited, on the fallback
  // thread that runs the tasks deferred after that (defer()). Every
  // ...FromLoop function DCHECKs it first (docs/threads.md).
  bool mayTouchState() const TRELLIS_EXCLUDES(mu_);

  // Runs `task` on the loop thread later, never inline. Tasks deferred after
  // the loop has exited run on a process-wide fallback thread, so none is
  // ever dropped.
  void defer(Task task) TRELLIS_EXCLUDES(mu_);

  // A public entry point: on the loop thread `task` runs now, inside a
  // "public call" scope (so callbacks it completes are deferred); elsewhere
  // it is deferred. Templates, so that a task run now is never wrapped in
  // a Task (an allocation for any capture over two pointers; each message
  // a pipe receives went through four).
  template <typename F>
  void run(F&& task) {
    if (inLoop() && !stopped_) {
      ++publicDepth_;
      task();
      --publicDepth_;
      return;
    }
    defer(Task(std::forward<F>(task)));
  }

  // Invokes a user callback: deferred when inside a public call on this
  // thread, otherwise run now. Loop thread only.
  template <typename F>
  void deliver(F&& task) {
    if (publicDepth_ > 0) {
      defer(Task(std::forward<F>(task)));
    } else {
      task();
    }
  }

  // Wraps every entry from libuv into Trellis code (read/write/connect/
  // accept/timer callbacks). Callbacks deferred inside it run when the
  // outermost scope ends, in the same loop iteration, instead of costing
  // another trip through the loop.
  class Scope {
   public:
    explicit Scope(Loop& loop) : loop_(loop) { ++loop_.scopeDepth_; }
    ~Scope() {
      if (--loop_.scopeDepth_ == 0) {
        if (!loop_.local_.empty()) {
          loop_.drainLocal();
        }
        loop_.markHot();
      }
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Loop& loop_;
  };

  // Work is expected to reach this loop from another thread within
  // microseconds (say, a reply from the worker thread a request was handed
  // to). Until the matching endExpectedWork(), the loop polls for up to
  // spinBudget() (TRELLIS_SPIN_US) after each piece of work instead of
  // sleeping in epoll, so a task deferred to it (or I/O) is picked up
  // without a wake-up. Balanced calls; any thread.
  void beginExpectedWork();
  void endExpectedWork();

  // Loop thread only: closes the loop's own handles; uv_run then returns
  // once every other handle has been closed by its owner.
  void stopFromLoop() TRELLIS_EXCLUDES(mu_);

  // Waits for the loop thread to finish, until `deadline`.
  [[nodiscard]] bool join(Deadline deadline) TRELLIS_EXCLUDES(joinMu_);

 private:
  explicit Loop(std::string id);
  static void onAsync(uv_async_t* h);
  static void onIdle(uv_idle_t* h);
  static void onSpin(uv_idle_t* h);
  // While work is expected (expecting_ > 0), each piece of work the loop
  // does keeps it polling for spinBudget() before it sleeps again.
  void markHot() TRELLIS_EXCLUDES(mu_);
  void runRemote() TRELLIS_EXCLUDES(mu_);
  void threadMain() TRELLIS_EXCLUDES(mu_, joinMu_);
  // polling_ read on the loop thread, its only writer, without the lock.
  bool pollingOnLoop() const TRELLIS_NO_THREAD_SAFETY_ANALYSIS {
    return polling_;
  }
  void runLocal();
  void drainLocal();

  const std::string id_;
  uv_loop_t loop_;
  uv_async_t async_;
  uv_idle_t idle_;
  std::atomic<std::thread::id> threadId_;

  mutable Mutex mu_;
  std::vector<Task> remote_ TRELLIS_GUARDED_BY(mu_);
  bool exited_ TRELLIS_GUARDED_BY(mu_) = false;
  bool asyncClosed_ TRELLIS_GUARDED_BY(mu_) = false;
  // The loop polls remote_ (its spin_ handle is active), so defer() need
  // not wake it. Written by the loop thread under mu_; read under mu_
  // elsewhere, without it on the loop thread (pollingOnLoop()).
  bool polling_ TRELLIS_GUARDED_BY(mu_) = false;
  std::atomic<int> expecting_{0};  // any thread: begin/endExpectedWork
  Mutex joinMu_;
  // Set by create(); joined once, by the first join() that sees finished_
  // (concurrent joiners are serialised by joinMu_).
  std::thread thread_ TRELLIS_GUARDED_BY(joinMu_);
  bool finished_ TRELLIS_GUARDED_BY(joinMu_) = false;
  CondVar joinCv_;

  // Loop thread only.
  std::vector<Task> local_;
  bool idleActive_ = false;
  uv_idle_t spin_;
  uint64_t hotUntilNs_ = 0;
  uint64_t spinNs_ = 0;
  bool stopped_ = false;
  int publicDepth_ = 0;
  int scopeDepth_ = 0;
};

// A one-shot timer on a loop. Loop thread only. `fn` runs once unless
// cancel() is called first; the object frees itself.
class LoopTimer final {
 public:
  static LoopTimer* start(Loop& loop, Duration after, std::function<void()> fn);
  void cancel();

 private:
  LoopTimer() = default;
  static void onTimer(uv_timer_t* t);
  uv_timer_t timer_;
  Loop* loop_ = nullptr;
  std::function<void()> fn_;
};

}  // namespace trellis::transport
