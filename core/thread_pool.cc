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
  workers_.reserve(numThreads);
  if (!startLocked()) {
    throw std::system_error(
        std::make_error_code(std::errc::resource_unavailable_try_again),
        "ThreadPool '" + name_ + "': cannot start a thread");
  }
}

bool ThreadPool::startLocked() {
  const size_t index = workers_.size();
  workers_.push_back(std::make_shared<Worker>());
  try {
    threads_.emplace_back([this, index] { workerLoop(index); });
  } catch (const std::system_error& e) {
    workers_.pop_back();
    TRELLIS_LOG_WARN("thread pool '{}': could not start thread {} of {}: {}",
                     name_, index + 1, maxThreads_, e.what());
    return false;
  }
  return true;
}

std::shared_ptr<ThreadPool::Worker> ThreadPool::wakeOrGrowLocked() {
  if (!idle_.empty()) {
    const size_t index = idle_.back();
    idle_.pop_back();
    workers_[index]->woken = true;
    ++waking_;
    return workers_[index];
  }
  if (workers_.size() < maxThreads_ && queue_.size() > waking_) {
    // On failure the queued task runs on a thread the pool has, later.
    startLocked();
  }
  return nullptr;
}

size_t ThreadPool::startedThreads() const {
  MutexLock lock(mu_);
  return workers_.size();
}

size_t ThreadPool::idleThreads() const {
  MutexLock lock(mu_);
  return idle_.size();
}

ThreadPool::~ThreadPool() {
  shutdown(ShutdownMode::kDrain);
  join();
}

void ThreadPool::post(Task task) {
  std::shared_ptr<Worker> wake;
  bool stopping;
  {
    MutexLock lock(mu_);
    stopping = stopping_;
    if (!stopping) {
      queue_.push_back(std::move(task));
      wake = wakeOrGrowLocked();
    }
  }
  if (stopping) {
    task(Error::cancelled("thread pool '" + name_ + "' is shut down"));
    return;
  }
  // Outside mu_: a worker notified under it (often running at once on the
  // other core) found mu_ still held and slept on it a second time, a
  // third of the RPC pool's wake-ups (perf sched_switch of rpc_bench). One
  // that woke meanwhile and went idle again takes this as a spurious
  // wake-up (`woken` is false again).
  if (wake != nullptr) {
    wake->cv.notifyOne();
  }
}

void ThreadPool::shutdown(ShutdownMode mode) {
  std::deque<Task> cancelled;
  {
    MutexLock lock(mu_);
    stopping_ = true;
    if (mode == ShutdownMode::kCancel) {
      cancelled.swap(queue_);
    }
    for (auto& w : workers_) {
      w->cv.notifyOne();
    }
  }
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
      Worker& me = *workers_[index];
      while (!stopping_ && queue_.empty()) {
        me.woken = false;
        idle_.push_back(index);
        while (!me.woken && !stopping_) {
          me.cv.wait(mu_);
        }
        if (me.woken) {
          --waking_;  // wakeOrGrowLocked() took it off idle_
        } else {
          std::erase(idle_, index);  // woken by shutdown()
        }
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
