#pragma once

// Lifeline: lets an object hand out callbacks that may run after it is
// gone (docs/threads.md, "Owners of threads"). The owner makes one; every
// callback it hands out holds it by shared_ptr and runs its body through
// run() (guard() wraps a callback so); the owner cuts it before it goes.
// Once cut() has returned, no body runs and none is running: a callback
// that fires later only releases what it captured.
//
// Contract
//  - run(fn) runs `fn` on the calling thread unless the line is cut, and
//    returns whether it ran. Any thread; runs may overlap and nest. No lock
//    is held while `fn` runs.
//  - cut(deadline) makes every later run() return false without running,
//    then waits until the runs in progress have returned, at most until
//    `deadline`; false when some still run then (the owner logs it: what
//    still runs may touch it). Idempotent; any thread.
//  - Bodies are callbacks: short, never blocking, and never cutting their
//    own line (that cut() would wait for itself until its deadline). So
//    cut() waits only for what runs at that moment, and never for
//    callbacks still queued somewhere.

#include <cstddef>
#include <memory>
#include <utility>

#include <trellis/core/deadline.h>
#include <trellis/core/mutex.h>
#include <trellis/core/thread_annotations.h>

namespace trellis {

class Lifeline final {
 public:
  Lifeline() = default;
  Lifeline(const Lifeline&) = delete;
  Lifeline& operator=(const Lifeline&) = delete;

  template <typename Fn>
  bool run(Fn&& fn) TRELLIS_EXCLUDES(mu_) {
    {
      MutexLock lock(mu_);
      if (cut_) {
        return false;
      }
      ++running_;
    }
    Leave leave(*this);
    std::forward<Fn>(fn)();
    return true;
  }

  // `fn` as a callback: calling the result with any arguments calls `fn`
  // with them through run() on `line`. It holds `line` and `fn`, and
  // releases `fn` when it is destroyed, whether it ran or not.
  template <typename Fn>
  static auto guard(std::shared_ptr<Lifeline> line, Fn fn) {
    return
        [line = std::move(line), fn = std::move(fn)](auto&&... args) mutable {
          line->run([&] { fn(std::forward<decltype(args)>(args)...); });
        };
  }

  bool cut(Deadline deadline) TRELLIS_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    cut_ = true;
    while (running_ > 0) {
      if (deadline.isNever()) {
        idle_.wait(mu_);
      } else if (!idle_.waitUntil(mu_, deadline.timePoint()) && running_ > 0) {
        return false;
      }
    }
    return true;
  }

  bool isCut() const TRELLIS_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return cut_;
  }

 private:
  // Ends a run, also when its body throws.
  class Leave {
   public:
    explicit Leave(Lifeline& line) : line_(line) {}
    ~Leave() { line_.leave(); }
    Leave(const Leave&) = delete;
    Leave& operator=(const Leave&) = delete;

   private:
    Lifeline& line_;
  };

  void leave() TRELLIS_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    if (--running_ == 0 && cut_) {
      idle_.notifyAll();
    }
  }

  mutable Mutex mu_;
  CondVar idle_;  // running_ fell to 0 after cut_
  bool cut_ TRELLIS_GUARDED_BY(mu_) = false;
  size_t running_ TRELLIS_GUARDED_BY(mu_) = 0;
};

}  // namespace trellis
