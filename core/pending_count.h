#pragma once
// Counts work handed to another thread (a teardown that cannot run on the
// thread that asked for it) so a caller can wait for all of it to end, with
// a deadline. Not installed.
#include <cstddef>

#include <trellis/core/deadline.h>
#include <trellis/core/mutex.h>

namespace trellis {

class PendingCount {
 public:
  void add() {
    MutexLock lock(mu_);
    ++pending_;
  }
  void done() {
    MutexLock lock(mu_);
    --pending_;
    if (pending_ == 0) {
      zero_.notifyAll();
    }
  }
  // True once nothing is pending; false if something still is after
  // `timeout`.
  bool await(Duration timeout) {
    const auto deadline = Clock::now() + timeout;
    MutexLock lock(mu_);
    while (pending_ > 0) {
      if (!zero_.waitUntil(mu_, deadline) && pending_ > 0) {
        return false;
      }
    }
    return true;
  }

 private:
  Mutex mu_;
  CondVar zero_;
  size_t pending_ TRELLIS_GUARDED_BY(mu_) = 0;
};

}  // namespace trellis
