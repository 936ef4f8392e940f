#include <algorithm>
#include <pthread.h>

#include <trellis/core/check.h>
#include <trellis/core/logging.h>
#include <trellis/core/thread_pool.h>

namespace trellis {

ThreadPool::ThreadPool(size_t numThreads, std::string name)
    : name_(std::move(name)) {
  if (numThreads == 0) {
    throw InvalidArgumentError(Error::invalidArgument(
        "ThreadPool '" + name_ + "' needs at least one thread"));
  }
  threads_.reserve(numThreads);
  threadIds_.resize(numThreads);
  for (size_t i = 0; i < numThreads; ++i) {
    threads_.emplace_back([this, i] { workerLoop(i); });
    threadIds_[i] = threads_.back().get_id();
  }
}

ThreadPool::~ThreadPool() {
  shutdown(ShutdownMode::kDrain);
  join();
}

void ThreadPool::post(Task task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      queue_.push_back(std::move(task));
      cv_.notify_one();
      return;
    }
  }
  task(Error::cancelled("thread pool '" + name_ + "' is shut down"));
}

void ThreadPool::shutdown(ShutdownMode mode) {
  std::deque<Task> cancelled;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    if (mode == ShutdownMode::kCancel) {
      cancelled.swap(queue_);
    }
  }
  cv_.notify_all();
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
  std::lock_guard<std::mutex> lock(joinMu_);
  for (auto& t : threads_) {
    if (t.joinable()) {
      t.join();
    }
  }
}

bool ThreadPool::inPool() const {
  const auto self = std::this_thread::get_id();
  return std::find(threadIds_.begin(), threadIds_.end(), self) !=
         threadIds_.end();
}

size_t ThreadPool::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

void ThreadPool::workerLoop(size_t index) {
  // Linux limits thread names to 15 characters.
  const std::string threadName =
      (name_ + "/" + std::to_string(index)).substr(0, 15);
  pthread_setname_np(pthread_self(), threadName.c_str());
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
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
