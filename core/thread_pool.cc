#include <pthread.h>
#include <system_error>

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

void setThreadName(const std::string& name) {
  // Linux limits thread names to 15 characters.
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

ThreadPool::ThreadPool(size_t numThreads, std::string name)
    : name_(std::move(name)), maxThreads_(numThreads) {
  if (numThreads == 0) {
    throw InvalidArgumentError(Error::invalidArgument(
        "ThreadPool '" + name_ + "' needs at least one thread"));
  }
  MutexLock lock(mu_);
  threads_.reserve(numThreads);
  threads_.emplace_back([this] { workerLoop(0); });
  started_ = 1;
}

void ThreadPool::growLocked() {
  if (started_ >= maxThreads_ || queue_.size() <= idle_) {
    return;
  }
  const size_t index = started_;
  try {
    threads_.emplace_back([this, index] { workerLoop(index); });
    ++started_;
  } catch (const std::system_error& e) {
    // The queued task runs on a thread the pool has, later.
    TRELLIS_LOG_WARN("thread pool '{}': could not start thread {} of {}: {}",
                     name_, index + 1, maxThreads_, e.what());
  }
}

size_t ThreadPool::startedThreads() const {
  MutexLock lock(mu_);
  return started_;
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
      growLocked();
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
  MutexLock joinLock(joinMu_);
  std::vector<std::thread> threads;
  {
    // Joined without mu_, which the workers need to exit; a pool that is
    // not shut down gains no thread after this (workers only start on
    // post), and its workers never exit, as before.
    MutexLock lock(mu_);
    threads.swap(threads_);
  }
  for (auto& t : threads) {
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
  setThreadName(name_ + "/" + std::to_string(index));
  tWorkerOf = this;
  for (;;) {
    Task task;
    {
      MutexLock lock(mu_);
      while (!stopping_ && queue_.empty()) {
        ++idle_;
        cv_.wait(mu_);
        --idle_;
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
