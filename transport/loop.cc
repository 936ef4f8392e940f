#include <sched.h>

#include <trellis/core/check.h>
#include <trellis/core/logging.h>
#include <trellis/core/spin.h>
#include <trellis/core/thread_pool.h>
#include <trellis/transport/loop.h>

namespace trellis::transport {

namespace {

// Leaked on purpose: tasks may be deferred during static destruction.
ThreadPool& fallbackPool() {
  static ThreadPool* pool = new ThreadPool(1, "trellis-late");
  return *pool;
}

}  // namespace

Loop::Loop(std::string id) : id_(std::move(id)) {
  TRELLIS_CHECK(uv_loop_init(&loop_) == 0, "uv_loop_init failed");
  TRELLIS_CHECK(uv_async_init(&loop_, &async_, &Loop::onAsync) == 0,
                "uv_async_init failed");
  async_.data = this;
  TRELLIS_CHECK(uv_idle_init(&loop_, &idle_) == 0, "uv_idle_init failed");
  idle_.data = this;
  TRELLIS_CHECK(uv_idle_init(&loop_, &spin_) == 0, "uv_idle_init failed");
  spin_.data = this;
  spinNs_ =
      static_cast<uint64_t>(std::chrono::nanoseconds(spinBudget()).count());
}

std::shared_ptr<Loop> Loop::create(std::string id) {
  std::shared_ptr<Loop> loop(new Loop(std::move(id)));
  // Nobody else can reach the loop yet; the lock is for the analysis.
  MutexLock lock(loop->joinMu_);
  loop->thread_ = std::thread([loop]() mutable {
    setThreadName("trellis-loop");
    loop->threadMain();
    loop.reset();
  });
  return loop;
}

Loop::~Loop() {
  if (thread_.joinable()) {
    if (std::this_thread::get_id() == thread_.get_id()) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
}

void Loop::threadMain() {
  threadId_.store(std::this_thread::get_id(), std::memory_order_release);
  uv_run(&loop_, UV_RUN_DEFAULT);
  std::vector<Task> rest;
  {
    MutexLock lock(mu_);
    exited_ = true;
    rest.swap(remote_);
  }
  rest.insert(rest.end(), std::make_move_iterator(local_.begin()),
              std::make_move_iterator(local_.end()));
  local_.clear();
  for (auto& t : rest) {
    t();
  }
  uv_run(&loop_, UV_RUN_NOWAIT);  // close callbacks of what those tasks closed
  const int rc = uv_loop_close(&loop_);
  if (rc != 0) {
    TRELLIS_LOG_ERROR("{}: uv_loop_close: {}", id_, uv_strerror(rc));
  }
  // This thread's id may be given to another thread once it has exited:
  // from here on inLoop() is false everywhere.
  threadId_.store(std::thread::id(), std::memory_order_release);
  {
    MutexLock lock(joinMu_);
    finished_ = true;
  }
  joinCv_.notifyAll();
}

bool Loop::mayTouchState() const {
  if (inLoop()) {
    return true;
  }
  MutexLock lock(mu_);
  return exited_;
}

void Loop::defer(Task task) {
  if (inLoop() && !stopped_) {
    local_.push_back(std::move(task));
    if (!idleActive_ && scopeDepth_ == 0) {
      idleActive_ = true;
      uv_idle_start(&idle_, &Loop::onIdle);
    }
    return;
  }
  {
    MutexLock lock(mu_);
    if (!exited_) {
      remote_.push_back(std::move(task));
      // Under the lock, so the handle cannot be closed meanwhile; tasks
      // queued after it is closed run when the thread exits.
      if (!asyncClosed_ && !polling_) {
        uv_async_send(&async_);
      }
      return;
    }
  }
  fallbackPool().post([t = std::move(task)](const Error&) { t(); });
}

void Loop::onAsync(uv_async_t* h) { static_cast<Loop*>(h->data)->runRemote(); }

void Loop::runRemote() {
  Scope scope(*this);
  std::vector<Task> tasks;
  {
    MutexLock lock(mu_);
    tasks.swap(remote_);
  }
  for (auto& t : tasks) {
    t();
  }
}

void Loop::beginExpectedWork() {
  expecting_.fetch_add(1, std::memory_order_relaxed);
  if (inLoop()) {
    markHot();
  }
}

void Loop::endExpectedWork() {
  expecting_.fetch_sub(1, std::memory_order_relaxed);
}

// Only while work is expected: polling after every piece of work would keep
// a core busy with nothing coming, and on a machine with as many busy
// threads as cores a poller delays the very thread it waits for (measured:
// polling after all activity made no-op RPC round trips bimodal, 40 or
// 150 µs).
void Loop::markHot() {
  if (spinNs_ == 0 || stopped_ ||
      expecting_.load(std::memory_order_relaxed) <= 0) {
    return;
  }
  hotUntilNs_ = uv_hrtime() + spinNs_;
  if (!pollingOnLoop()) {  // only this thread writes it: no lock to read
    {
      MutexLock lock(mu_);
      polling_ = true;
    }
    uv_idle_start(&spin_, &Loop::onSpin);
  }
}

void Loop::onSpin(uv_idle_t* h) {
  auto* self = static_cast<Loop*>(h->data);
  bool work;
  {
    MutexLock lock(self->mu_);
    work = !self->remote_.empty();
    if (!work && (uv_hrtime() >= self->hotUntilNs_ ||
                  self->expecting_.load(std::memory_order_relaxed) <= 0)) {
      // Cold (the budget is spent, or the work expected came or was
      // called off: a request answered inline, an RPC reply written):
      // sleep in epoll again; from now on defer() wakes us.
      self->polling_ = false;
      uv_idle_stop(&self->spin_);
      return;
    }
  }
  if (work) {
    self->runRemote();
    return;
  }
  // Nothing to do yet: let a runnable thread on this core (often the one we
  // wait for) have it for a moment.
  sched_yield();
}

void Loop::onIdle(uv_idle_t* h) { static_cast<Loop*>(h->data)->runLocal(); }

void Loop::drainLocal() {
  ++scopeDepth_;
  while (!local_.empty()) {
    std::vector<Task> tasks;
    tasks.swap(local_);
    for (auto& t : tasks) {
      t();
    }
  }
  --scopeDepth_;
  if (idleActive_) {
    idleActive_ = false;
    uv_idle_stop(&idle_);
  }
}

void Loop::runLocal() {
  std::vector<Task> tasks;
  tasks.swap(local_);
  for (auto& t : tasks) {
    t();
  }
  if (local_.empty() && idleActive_) {
    idleActive_ = false;
    uv_idle_stop(&idle_);
  }
}

void Loop::stopFromLoop() {
  TRELLIS_DCHECK(inLoop(), "stopFromLoop off the loop thread");
  if (stopped_) {
    return;
  }
  stopped_ = true;
  // Drain what is queued; later tasks go to remote_ and run at exit.
  runLocal();
  uv_idle_stop(&idle_);
  idleActive_ = false;
  uv_close(reinterpret_cast<uv_handle_t*>(&idle_), nullptr);
  uv_idle_stop(&spin_);
  uv_close(reinterpret_cast<uv_handle_t*>(&spin_), nullptr);
  {
    MutexLock lock(mu_);
    polling_ = false;
    asyncClosed_ = true;
    uv_close(reinterpret_cast<uv_handle_t*>(&async_), nullptr);
  }
}

bool Loop::join(Deadline deadline) {
  if (inLoop()) {
    return false;
  }
  MutexLock lock(joinMu_);
  while (!finished_) {
    if (deadline.isNever()) {
      joinCv_.wait(joinMu_);
    } else if (!joinCv_.waitUntil(joinMu_, deadline.timePoint()) &&
               !finished_) {
      return false;
    }
  }
  // The thread has set finished_ and takes no lock of ours again, so
  // joining it under joinMu_ is bounded; joinMu_ serialises concurrent
  // joiners.
  if (thread_.joinable()) {
    thread_.join();
  }
  return true;
}

LoopTimer* LoopTimer::start(Loop& loop, Duration after,
                            std::function<void()> fn) {
  auto* t = new LoopTimer();
  t->loop_ = &loop;
  t->fn_ = std::move(fn);
  uv_timer_init(loop.uv(), &t->timer_);
  t->timer_.data = t;
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(after).count();
  uv_timer_start(&t->timer_, &LoopTimer::onTimer,
                 static_cast<uint64_t>(ms < 1 ? 1 : ms), 0);
  return t;
}

void LoopTimer::onTimer(uv_timer_t* h) {
  auto* t = static_cast<LoopTimer*>(h->data);
  Loop::Scope scope(*t->loop_);
  auto fn = std::move(t->fn_);
  t->cancel();
  if (fn) {
    fn();
  }
}

void LoopTimer::cancel() {
  fn_ = nullptr;
  uv_timer_stop(&timer_);
  uv_close(reinterpret_cast<uv_handle_t*>(&timer_),
           [](uv_handle_t* h) { delete static_cast<LoopTimer*>(h->data); });
}

}  // namespace trellis::transport
