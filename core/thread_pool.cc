#include <pthread.h>

#include <trellis/core/check.h>
#include <trellis/core/logging.h>
#include <trellis/core/thread_pool.h>

namespace trellis {

namespace {
// The pool whose worker this thread is (thread ids are reused once a thread
// has exited, so they cannot tell a pool's workers apart from later
// threads).
thread_local const ThreadPool* tWorkerOf = nullptr;
}  // namespace

ThreadPool::ThreadPool(size_t numThreads, std::string name)
    : name_(std::move(name)) {
  if (numThreads == 0) {
    throw InvalidArgumentError(Error::invalidArgument(
        "ThreadPool '" + name_ + "' needs at least one thread"));
  }
  threads_.reserve(numThreads);
  for (size_t i = 0; i < numThreads; ++i) {
    threads_.emplace_back([this, i] { workerLoop(i); });
  }
}

ThreadPool::~ThreadPool() {
  shutdown(ShutdownMode::kDrain);
  join();
}

void ThreadPool::post(Task task) {
  {
    MutexLock lock(mu_);
    if (!stopping_) {
      queue_.push_back(std::move(task));
      cv_.notifyOne();
      return;
    }
  }
  task(Error::cancelled("thread pool '" + name_ + "' is shut down"));
}

void ThreadPool::shutdown(ShutdownMode mode) {
  std::deque<Task> cancelled;
  {
    MutexLock lock(mu_);
    stopping_ = true;
    if (mode == ShutdownMode::kCancel) {
      cancelled.swap(queue_);
    }
  }
  cv_.notifyAll();
  if (!cancelled.empty()) {
    const Error error = Error::cancelled("thread pool '" + name_ +
                                         "' was cancelled before the task ran");
    for (auto& task : cancelled) {
      task(error);
    }
  }
}

void ThreadPool::join() {
  TRELLIS_CHECK(!inPool(),
                "ThreadPool::join() called from one of its own workers");
  MutexLock lock(joinMu_);
  for (auto& t : threads_) {
    if (t.joinable()) {
      t.join();
    }
  }
}

bool ThreadPool::inPool() const { return tWorkerOf == this; }

size_t ThreadPool::queued() const {
  MutexLock lock(mu_);
  return queue_.size();
}

void ThreadPool::workerLoop(size_t index) {
  // Linux limits thread names to 15 characters.
  const std::string threadName =
      (name_ + "/" + std::to_string(index)).substr(0, 15);
  pthread_setname_np(pthread_self(), threadName.c_str());
  tWorkerOf = this;
  for (;;) {
    Task task;
    {
      MutexLock lock(mu_);
      while (!stopping_ && queue_.empty()) {
        cv_.wait(mu_);
      }
      if (queue_.empty()) {
        return;  // stopping and drained
      }
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      task(Error());
    } catch (...) {
      TRELLIS_LOG_ERROR("thread pool '{}': task threw: {}", name_,
                        errorFromCurrentException().what());
    }
  }
}

}  // namespace trellis
