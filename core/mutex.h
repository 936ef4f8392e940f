#pragma once

// Mutex, MutexLock and CondVar: std::mutex and std::condition_variable with
// the thread-safety annotations of core/thread_annotations.h, so that clang
// checks every GUARDED_BY member at compile time.
//
// Contract
//  - Mutex is a std::mutex (same size, same code: every method is an inline
//    forward); not recursive. MutexLock holds one for its scope.
//  - CondVar waits on a Mutex the caller holds. It wraps
//    std::condition_variable, not std::condition_variable_any: the latter
//    takes an internal mutex and a shared_ptr copy on every wait and
//    notify, which is measurable on the paths that use it (future
//    completion, thread-pool hand-off). The wait adopts the held
//    std::mutex into a std::unique_lock for the duration of the call and
//    gives it back, so the lock is held again when it returns, exactly as
//    with std::condition_variable.
//  - Waits have no predicate overloads (the analysis cannot see that a
//    predicate runs under the lock); loop on the condition:
//        MutexLock lock(mu_);
//        while (!ready_) cv_.wait(mu_);
//    Spurious wake-ups happen, as with std::condition_variable.

#include <chrono>
#include <condition_variable>
#include <mutex>

#include <trellis/core/thread_annotations.h>

namespace trellis {

class TRELLIS_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() TRELLIS_ACQUIRE() { mu_.lock(); }
  void unlock() TRELLIS_RELEASE() { mu_.unlock(); }
  [[nodiscard]] bool tryLock() TRELLIS_TRY_ACQUIRE(true) {
    return mu_.try_lock();
  }
  // Documents, and tells the analysis, that the caller holds the lock.
  // Checks nothing at run time.
  void assertHeld() const TRELLIS_ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` from construction to destruction.
class TRELLIS_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) TRELLIS_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() TRELLIS_RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Releases `mu`, sleeps until notified (or spuriously), reacquires `mu`.
  void wait(Mutex& mu) TRELLIS_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }

  // As wait(), but returns false once `deadline` has passed (the caller
  // re-checks its condition either way).
  template <typename Clock, typename Dur>
  bool waitUntil(Mutex& mu, std::chrono::time_point<Clock, Dur> deadline)
      TRELLIS_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    const bool notTimedOut =
        cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return notTimedOut;
  }

  void notifyOne() noexcept { cv_.notify_one(); }
  void notifyAll() noexcept { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace trellis
