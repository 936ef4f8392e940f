#pragma once

// A pool of up to N worker threads.
//
// It starts one thread and adds one (up to N) whenever a task is posted
// while every thread it has is busy or already claimed by a queued task,
// so a task never waits for a thread while fewer than N exist, and an idle
// process does not keep N sleeping threads (docs/threads.md). Threads stay
// once started.
//
// A posted task wakes the worker that went idle last (each worker sleeps on
// a condition variable of its own). One condition variable shared by all
// would wake the one that has waited longest, so sequential calls would
// rotate through every thread the pool ever started, each woken cold and
// often on the other core: after a burst had grown the RPC worker pool to
// four threads, small calls ran 1.5-2x slower for as long as the process
// lived (docs/benchmarks.md, RPC).
//
// Contract
//  - post(task): `task(Error)` runs exactly once: on a worker with an OK
//    error, or with CANCELLED when the pool is cancelled before the task ran.
//    A task posted after shutdown() runs at once on the posting thread with
//    CANCELLED (no lock held). Nothing is silently dropped.
//  - submit(fn) wraps post(): the returned future carries fn's result, its
//    exception as an Error, or CANCELLED.
//  - shutdown(kDrain) stops accepting work and lets the workers run
//    everything already queued; shutdown(kCancel) fails the queued tasks with
//    CANCELLED on the calling thread. Both return at once and are idempotent;
//    join() waits for the workers to exit. The destructor drains and joins.
//  - join() and the destructor must not be called from a worker thread of
//    the same pool (a checked error: it would wait for itself).
//  - Thread-safe: any thread may post, submit and shut down.

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <trellis/core/error.h>
#include <trellis/core/future.h>
#include <trellis/core/mutex.h>
#include <trellis/core/thread_annotations.h>
#include <trellis/core/thread_name.h>

namespace trellis {

class ThreadPool {
 public:
  using Task = std::function<void(const Error&)>;
  enum class ShutdownMode { kDrain, kCancel };

  // `numThreads` >= 1: the most threads it starts; `name` prefixes the
  // threads' names ("name/3").
  explicit ThreadPool(size_t numThreads, std::string name = "pool");
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void post(Task task) TRELLIS_EXCLUDES(mu_);

  template <typename F>
  auto submit(F&& fn) {
    using R = typename detail::Unwrap<std::invoke_result_t<F&>>::type;
    Promise<R> promise;
    auto future = promise.getFuture();
    post([promise, fn = std::forward<F>(fn)](const Error& error) mutable {
      if (!error.ok()) {
        promise.setError(error);
        return;
      }
      detail::fulfil(promise, fn);
    });
    return future;
  }

  void shutdown(ShutdownMode mode = ShutdownMode::kDrain) TRELLIS_EXCLUDES(mu_);
  void join() TRELLIS_EXCLUDES(joinMu_);

  // True on one of this pool's worker threads.
  bool inPool() const;
  // The most threads it starts / how many it has started.
  size_t numThreads() const { return maxThreads_; }
  size_t startedThreads() const TRELLIS_EXCLUDES(mu_);
  // Workers waiting for a task, none of them woken for one yet.
  size_t idleThreads() const TRELLIS_EXCLUDES(mu_);
  size_t queued() const TRELLIS_EXCLUDES(mu_);
  const std::string& name() const { return name_; }

 private:
  struct Worker {
    CondVar cv;
    bool woken = false;  // guarded by mu_: a post chose this worker
  };

  void workerLoop(size_t index) TRELLIS_EXCLUDES(mu_);
  // Chooses the most recently idle worker and returns it, to be notified
  // once mu_ is released (a worker notified under it wakes only to sleep
  // on mu_ again); or starts one more when none is idle and the queued
  // tasks outnumber the workers already woken for them (null).
  std::shared_ptr<Worker> wakeOrGrowLocked() TRELLIS_REQUIRES(mu_);
  // Starts one more worker; false if its thread could not start.
  bool startLocked() TRELLIS_REQUIRES(mu_);

  const std::string name_;
  const size_t maxThreads_;
  mutable Mutex mu_;
  std::deque<Task> queue_ TRELLIS_GUARDED_BY(mu_);
  bool stopping_ TRELLIS_GUARDED_BY(mu_) = false;
  // One per started thread, by index (its size is the threads started);
  // never shrinks while the pool lives.
  // Shared: post() notifies the worker it chose after releasing mu_, and
  // that worker must outlive the notify even if the pool does not.
  std::vector<std::shared_ptr<Worker>> workers_ TRELLIS_GUARDED_BY(mu_);
  // Indices of the workers waiting for a task, the most recently idle last.
  std::vector<size_t> idle_ TRELLIS_GUARDED_BY(mu_);
  // Workers woken by a post that have not yet taken the lock again.
  size_t waking_ TRELLIS_GUARDED_BY(mu_) = 0;
  // Grows under mu_ until stopping_; join() takes them out.
  std::vector<std::thread> threads_ TRELLIS_GUARDED_BY(mu_);
  // Serialises concurrent join() calls, so that a second one returns only
  // once the workers have exited.
  Mutex joinMu_;
};

}  // namespace trellis
