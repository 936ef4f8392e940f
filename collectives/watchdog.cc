#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include <trellis/collectives/progress.h>
#include <trellis/collectives/watchdog.h>
#include <trellis/core/ids.h>
#include <trellis/core/logging.h>
#include <trellis/core/text.h>
#include <trellis/core/thread_name.h>
#include <trellis/store/store.h>

namespace trellis::collectives::detail {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

[[noreturn]] void badEnv(const char* name, const std::string& value,
                         const std::string& why) {
  throwError(
      Error::invalidArgument(std::string(name) + "='" + value + "' " + why));
}

// An integer variable in [lo, hi]; `fallback` when unset or empty.
long long envInt(const char* name, long long fallback, long long lo,
                 long long hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    return fallback;
  }
  const std::optional<int64_t> x = parseDecimal(v);
  if (!x || *x < lo || *x > hi) {
    badEnv(name, v,
           "is not a whole number in [" + std::to_string(lo) + ", " +
               std::to_string(hi) + "]");
  }
  return *x;
}

int64_t wallMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string progressKey(int rank) { return "progress/" + std::to_string(rank); }

// Set (once, first writer wins) by the rank that failed the group: "<code>
// rank <r> gave up on the group: <why>". Every other rank's watchdog reads
// it, so a rank that is in no op, or whose peer closed before its abort
// message arrived, learns of the failure too.
constexpr char kAbortKey[] = "abort";

// The abort key's value back as an Error; the store is shared, so the
// value is bounded and its code checked.
Error abortFromStore(const std::string& group, std::string value) {
  if (value.size() > kMaxProgressBytes * 16) {
    value.resize(kMaxProgressBytes * 16);
  }
  Code code = Code::kAborted;
  const size_t space = value.find(' ');
  if (space != std::string::npos && space > 0 && space <= 2) {
    int c = 0;
    for (size_t i = 0; i < space; ++i) {
      c = std::isdigit(static_cast<unsigned char>(value[i]))
              ? c * 10 + (value[i] - '0')
              : -1;
      if (c < 0) {
        break;
      }
    }
    if (c > 0 && c <= static_cast<int>(Code::kUnauthenticated)) {
      code = static_cast<Code>(c);
      value = value.substr(space + 1);
    }
  }
  return Error(code, group + ": " + value);
}

}  // namespace

WatchdogConfig WatchdogConfig::fromEnvironment() {
  WatchdogConfig c;
  c.interval =
      milliseconds(envInt("TRELLIS_WATCHDOG_INTERVAL_MS", 1000, 10, 3'600'000));
  c.heartbeatTimeout = milliseconds(envInt(
      "TRELLIS_WATCHDOG_HEARTBEAT_TIMEOUT_MS", 120'000, 100, 86'400'000));
  return c;
}

WatchdogMode watchdogModeFromEnvironment() {
  const char* v = std::getenv("TRELLIS_WATCHDOG_MODE");
  if (v == nullptr || *v == '\0' || std::string(v) == "exit") {
    return WatchdogMode::kExit;
  }
  if (std::string(v) == "fail") {
    return WatchdogMode::kFail;
  }
  badEnv("TRELLIS_WATCHDOG_MODE", v, "is neither 'exit' nor 'fail'");
}

bool blockingWaitFromEnvironment() {
  return envInt("TRELLIS_NCCL_BLOCKING_WAIT", 0, 0, 1) == 1;
}

size_t flightRecorderEntriesFromEnvironment() {
  return static_cast<size_t>(envInt("TRELLIS_FLIGHT_RECORDER_ENTRIES",
                                    FlightRecorder::kDefaultCapacity, 0,
                                    1'000'000));
}

std::string flightRecorderDirFromEnvironment() {
  const char* v = std::getenv("TRELLIS_FLIGHT_RECORDER_DIR");
  return v == nullptr ? "" : v;
}

// One watched group. `g` never changes after watch(); the rest belongs to
// the watchdog thread, which holds `mu` while it works on the group.
struct Watchdog::Handle::Entry {
  explicit Entry(WatchedGroup group) : g(std::move(group)) {}
  const WatchedGroup g;
  Mutex mu;
  bool removed TRELLIS_GUARDED_BY(mu) = false;
  bool failed TRELLIS_GUARDED_BY(mu) = false;
  bool dumped TRELLIS_GUARDED_BY(mu) = false;
  std::string dumpPath TRELLIS_GUARDED_BY(mu);
  uint64_t beat TRELLIS_GUARDED_BY(mu) = 0;
  // The watchdog's own handle on the store (Store::clone), or null to use
  // g.store (stores without connections). After a store failure it is
  // dropped and re-made no sooner than `retryAt`.
  std::unique_ptr<store::Store> own TRELLIS_GUARDED_BY(mu);
  bool cloned TRELLIS_GUARDED_BY(mu) = false;
  Clock::time_point retryAt TRELLIS_GUARDED_BY(mu);

  std::string name() const { return "group '" + g.info.name + "'"; }

  // The store to use now, or null while it is unusable.
  store::Store* store(Duration timeout) TRELLIS_REQUIRES(mu) {
    if (!cloned) {
      if (Clock::now() < retryAt) {
        return nullptr;
      }
      try {
        own = g.store->clone(std::chrono::duration_cast<milliseconds>(timeout));
        cloned = true;
      } catch (const std::exception& ex) {
        storeFailed(ex.what());
        return nullptr;
      }
    }
    return own ? own.get() : g.store.get();
  }

  void storeFailed(const std::string& what) TRELLIS_REQUIRES(mu) {
    TRELLIS_LOG_WARN("collectives watchdog: {} on rank {}: store: {}", name(),
                     g.info.rank, what);
    own.reset();
    cloned = false;
    retryAt = Clock::now() + std::chrono::seconds(10);
  }
};

Watchdog::Handle::Handle(Watchdog* w, std::shared_ptr<Entry> e)
    : watchdog_(w), entry_(std::move(e)) {}

Watchdog::Handle::~Handle() { watchdog_->unwatch(entry_); }

Watchdog::Watchdog(WatchdogConfig config, Hooks hooks)
    : config_(config), hooks_(std::move(hooks)) {
  if (!hooks_.exit) {
    hooks_.exit = [](int code) {
      std::fflush(stderr);
      std::_Exit(code);
    };
  }
  tickNs_.store(Duration(config_.interval).count());
  {
    MutexLock lock(mu_);
    phaseSince_ = Clock::now();
  }
  thread_ = std::thread([this] {
    setThreadName("pg-watchdog");
    run();
  });
  monitor_ = std::thread([this] {
    setThreadName("pg-monitor");
    monitor();
  });
}

Watchdog::~Watchdog() { stop(); }

void Watchdog::stop() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  cv_.notifyAll();
  std::lock_guard<std::mutex> lock(joinMu_);
  if (thread_.joinable()) {
    thread_.join();
  }
  if (monitor_.joinable()) {
    monitor_.join();
  }
  releaseStores(/*all=*/true);
}

void Watchdog::releaseStores(bool all) {
  std::vector<HeldStore> drop;
  {
    MutexLock lock(mu_);
    if (all) {
      for (const HeldStore& h : heldStores_) {
        while (Clock::now() < h.until) {
          cv_.waitUntil(mu_, h.until);
        }
      }
      drop.swap(heldStores_);
    } else {
      const auto now = Clock::now();
      for (auto it = heldStores_.begin(); it != heldStores_.end();) {
        if (it->until <= now) {
          drop.push_back(std::move(*it));
          it = heldStores_.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  // Destroyed unlocked: the last reference may take a store server down.
  drop.clear();
}

namespace {

Watchdog* processWatchdog = nullptr;

// Stopped, never deleted: a group destroyed later (a global, a leaked
// pointer) still unregisters from it.
void stopProcessWatchdog() { processWatchdog->stop(); }

}  // namespace

Watchdog& Watchdog::process() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Statics made after the exit handler is registered are destroyed
    // before it runs, while the watchdog and the transport's threads may
    // still log or name objects: make those first.
    (void)log::logger();
    (void)rootIds();
    processWatchdog = new Watchdog(WatchdogConfig::fromEnvironment());
    std::atexit(&stopProcessWatchdog);
  });
  return *processWatchdog;
}

std::unique_ptr<Watchdog::Handle> Watchdog::watch(WatchedGroup group) {
  auto e = std::make_shared<Entry>(std::move(group));
  // The first report, synchronously, so a rank that never reaches the
  // first tick still has one and a reader's multiGet never waits.
  e->g.store->set(progressKey(e->g.info.rank),
                  encodeProgress(e->g.recorder->progress(), 0, wallMicros()));
  {
    MutexLock lock(mu_);
    entries_.push_back(e);
    anyExitMode_ = anyExitMode_ || e->g.mode == WatchdogMode::kExit;
    changed_ = true;
  }
  cv_.notifyAll();  // the tick may have to shrink
  return std::unique_ptr<Handle>(new Handle(this, std::move(e)));
}

void Watchdog::unwatch(const std::shared_ptr<Entry>& e) {
  {
    MutexLock lock(mu_);
    std::erase(entries_, e);
  }
  MutexLock lock(e->mu);  // waits out a check in progress
  e->removed = true;
  // A group destroyed right after it failed (the caller's error unwinding
  // it) may never have met a tick: its record is kept all the same.
  if (!e->dumped && e->g.recorder->progress().failed) {
    dump(*e, "an op of the group failed");
  }
}

std::string Watchdog::stuckReport() const {
  MutexLock lock(mu_);
  return stuckReport_;
}

Duration Watchdog::tick() const {
  Duration t = config_.interval;
  for (const auto& e : entries_) {
    t = std::min(t, Duration(e->g.info.timeout) / 10);
  }
  return std::max<Duration>(t, milliseconds(10));
}

Duration Watchdog::currentTick() const {
  return Duration(tickNs_.load(std::memory_order_relaxed));
}

void Watchdog::setPhase(const char* phase, const std::string& group) {
  MutexLock lock(mu_);
  phase_ = phase;
  phaseGroup_ = group;
  phaseSince_ = Clock::now();
}

void Watchdog::run() {
  for (;;) {
    std::vector<std::shared_ptr<Entry>> list;
    {
      MutexLock lock(mu_);
      if (stopping_) {
        return;
      }
      list = entries_;
    }
    for (const auto& e : list) {
      MutexLock lock(e->mu);
      if (!e->removed) {
        check(*e, Clock::now());
      }
    }
    setPhase("idle", "");
    // A group let go of meanwhile is destroyed here, before any exit; its
    // store stays while it is held.
    list.clear();
    releaseStores(/*all=*/false);
    exitIfRequested();
    MutexLock lock(mu_);
    const Duration t = tick();
    tickNs_.store(t.count(), std::memory_order_relaxed);
    const auto until = Clock::now() + t;
    while (!stopping_ && !changed_ && Clock::now() < until) {
      cv_.waitUntil(mu_, until);
    }
    changed_ = false;
  }
}

void Watchdog::check(Entry& e, Clock::time_point now) {
  e.mu.assertHeld();  // run() holds it
  if (e.failed) {
    return;
  }
  setPhase("backend poll", e.name());
  const auto backend = e.g.backend.lock();
  if (!backend) {
    return;
  }
  if (Error err = backend->poll(); !err.ok()) {
    setPhase("store update", e.name());
    publishAbort(e, err);
    fail(e, err, err.what(), e.g.mode == WatchdogMode::kExit);
    return;
  }
  if (auto late = e.g.recorder->startedBefore(now - e.g.info.timeout)) {
    timedOut(e, *late);
    return;
  }
  const Progress p = e.g.recorder->progress();
  if (p.failed && !e.dumped) {
    dump(e, "an op of the group failed");
  }
  setPhase("store update", e.name());
  store::Store* s = e.store(config_.storeTimeout);
  if (s == nullptr) {
    return;
  }
  try {
    s->set(progressKey(e.g.info.rank),
           encodeProgress(p, ++e.beat, wallMicros()));
    if (s->check({kAbortKey})) {
      const Error why = abortFromStore(e.name(), s->getString(kAbortKey));
      fail(e, why, why.message(), e.g.mode == WatchdogMode::kExit);
    }
  } catch (const std::exception& ex) {
    e.storeFailed(ex.what());
  }
}

void Watchdog::publishAbort(Entry& e, const Error& why) {
  e.mu.assertHeld();
  store::Store* s = e.store(config_.storeTimeout);
  if (s == nullptr) {
    return;
  }
  try {
    (void)s->compareSet(kAbortKey, "",
                        std::to_string(static_cast<int>(why.code())) +
                            " rank " + std::to_string(e.g.info.rank) +
                            " gave up on the group: " + why.message());
  } catch (const std::exception& ex) {
    e.storeFailed(ex.what());
  }
}

void Watchdog::timedOut(Entry& e, const FlightEntry& op) {
  e.mu.assertHeld();
  const auto ran =
      std::chrono::duration_cast<milliseconds>(Clock::now() - op.started);
  const std::string what = op.describe() + " on " + e.name();
  std::string message = what + " timed out on rank " +
                        std::to_string(e.g.info.rank) + " after " +
                        std::to_string(ran.count()) + " ms (timeout " +
                        std::to_string(e.g.info.timeout.count()) + " ms)";
  setPhase("culprit analysis", e.name());
  store::Store* s = e.store(config_.storeTimeout);
  if (op.fp.seq == 0) {
    message += "; rank " +
               (op.peer < 0 ? std::string("none") : std::to_string(op.peer)) +
               " never matched it";
  } else if (s == nullptr) {
    message +=
        "; the other ranks' progress is unknown (the store cannot be "
        "reached)";
  } else {
    const int n = e.g.info.size;
    std::vector<std::string> keys;
    for (int r = 0; r < n; ++r) {
      keys.push_back(progressKey(r));
    }
    const milliseconds staleAfter = std::max<milliseconds>(
        std::chrono::duration_cast<milliseconds>(4 * currentTick()),
        milliseconds(1000));
    try {
      Analysis a;
      for (int look = 0; look < 2; ++look) {
        if (look == 1) {
          if (a.behindButAlive.empty()) {
            break;
          }
          // Their reports may predate their entering the op: look again
          // once they have published at least once more.
          const auto until = Clock::now() + 3 * currentTick() / 2;
          MutexLock lock(mu_);
          while (!stopping_ && Clock::now() < until) {
            cv_.waitUntil(mu_, until);
          }
        }
        // This rank's own report is taken fresh: its last one may predate
        // the op.
        s->set(
            progressKey(e.g.info.rank),
            encodeProgress(e.g.recorder->progress(), ++e.beat, wallMicros()));
        const auto values = s->multiGet(keys);
        std::vector<RankReport> reports(values.size());
        for (size_t r = 0; r < values.size(); ++r) {
          reports[r] = decodeProgress(
              std::string_view(reinterpret_cast<const char*>(values[r].data()),
                               values[r].size()));
        }
        a = analyse(op.fp.seq, op.describe(), e.g.info.rank, reports,
                    wallMicros(), staleAfter);
      }
      message += "; " + a.summary;
    } catch (const std::exception& ex) {
      e.storeFailed(ex.what());
      message += "; the other ranks' progress is unknown (store: " +
                 std::string(ex.what()) + ")";
    }
  }
  // Every rank learns of it through the store too, and keeps its flight
  // recorder.
  const Error error = Error::timeout(message);
  publishAbort(e, error);
  fail(e, error, message, e.g.mode == WatchdogMode::kExit);
}

void Watchdog::dump(Entry& e, const std::string& reason) {
  e.mu.assertHeld();
  e.dumped = true;
  if (e.g.dumpDir.empty()) {
    return;
  }
  setPhase("flight recorder dump", e.name());
  std::string path;
  if (Error err = writeDump(e.g.dumpDir, e.g.info, e.g.recorder->entries(),
                            reason, &path);
      !err.ok()) {
    TRELLIS_LOG_ERROR("collectives watchdog: {}", err.what());
    return;
  }
  e.dumpPath = path;
  TRELLIS_LOG_INFO("collectives watchdog: {} on rank {}: flight recorder in {}",
                   e.name(), e.g.info.rank, path);
}

void Watchdog::fail(Entry& e, const Error& error, const std::string& reason,
                    bool exitProcess) {
  e.mu.assertHeld();
  e.failed = true;
  if (!e.dumped) {
    dump(e, reason);
  }
  Error full = error;
  if (!e.dumpPath.empty()) {
    full = Error(error.code(),
                 error.message() + " [flight recorder: " + e.dumpPath + "]");
  } else if (e.g.dumpDir.empty()) {
    full = Error(error.code(),
                 error.message() +
                     " [set TRELLIS_FLIGHT_RECORDER_DIR to keep a flight "
                     "recorder of the last ops]");
  }
  {
    MutexLock lock(mu_);
    heldStores_.push_back(
        {Clock::now() +
             std::max<Duration>(config_.storeLinger, 3 * currentTick()),
         e.g.store});
  }
  setPhase("backend abort", e.name());
  if (const auto backend = e.g.backend.lock()) {
    backend->abort(full);
  }
  TRELLIS_LOG_ERROR("collectives watchdog: rank {}: {}", e.g.info.rank,
                    full.what());
  if (!exitProcess) {
    return;
  }
  std::fprintf(stderr,
               "trellis collectives watchdog: rank %d: %s\n"
               "trellis collectives watchdog: ending the process with exit "
               "code %d (watchdog mode 'exit'; TRELLIS_WATCHDOG_MODE=fail "
               "only fails the ops)\n",
               e.g.info.rank, full.what().c_str(), kWatchdogExitCode);
  std::fflush(stderr);
  // run() ends the process once it let go of this group, so the caller's
  // wait() can raise the error and its unwinding destroy the group.
  MutexLock lock(mu_);
  exitRequested_ = true;
}

void Watchdog::exitIfRequested() {
  MutexLock lock(mu_);
  if (!exitRequested_) {
    return;
  }
  // A moment for the abort to reach the peers (the abort message, and the
  // store, held since fail() and maybe hosted here, for their next tick and
  // their culprit analysis) and for the
  // caller's wait() to raise the same error. Not cut short by stop(): a
  // caller that returns from main() at once would otherwise end the
  // process before the abort left it.
  const auto until =
      Clock::now() + std::max<Duration>(milliseconds(1000), 3 * currentTick());
  while (Clock::now() < until) {
    cv_.waitUntil(mu_, until);
  }
  exitRequested_ = false;
  hooks_.exit(kWatchdogExitCode);
}

void Watchdog::monitor() {
  Clock::time_point reported{};
  MutexLock lock(mu_);
  while (!stopping_) {
    const auto step =
        std::max<Duration>(config_.heartbeatTimeout / 4, milliseconds(10));
    cv_.waitUntil(mu_, Clock::now() + step);
    if (stopping_ || phase_ == "idle" || phaseSince_ == reported) {
      continue;
    }
    const auto stuck = Clock::now() - phaseSince_;
    // A step may wait on purpose for a tick and a half (the culprit
    // analysis's second look): never call that stuck.
    if (stuck <
        std::max<Duration>(config_.heartbeatTimeout, 4 * currentTick())) {
      continue;
    }
    reported = phaseSince_;
    stuckReport_ =
        "collectives watchdog stuck for " +
        std::to_string(
            std::chrono::duration_cast<milliseconds>(stuck).count()) +
        " ms in " + phase_ + " of " + phaseGroup_ +
        ": the watchdog itself is blocked, not (necessarily) a collective; "
        "no group is being checked meanwhile";
    TRELLIS_LOG_ERROR("{}", stuckReport_);
    if (!anyExitMode_) {
      continue;
    }
    // The recorders need no store and no lock the stuck thread holds.
    for (const auto& e : entries_) {
      if (e->g.dumpDir.empty()) {
        continue;
      }
      std::string path;
      (void)writeDump(e->g.dumpDir, e->g.info, e->g.recorder->entries(),
                      stuckReport_, &path);  // best effort, on the way out
    }
    std::fprintf(stderr, "trellis: %s; ending the process with exit code %d\n",
                 stuckReport_.c_str(), kWatchdogStuckExitCode);
    std::fflush(stderr);
    hooks_.exit(kWatchdogStuckExitCode);
  }
}

}  // namespace trellis::collectives::detail
