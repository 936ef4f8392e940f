#pragma once
// The collectives watchdog: one thread per process that watches every
// process group, whatever its backend (docs/collectives.md, "Watchdog").
// Not installed; no libtorch.
//
// Every tick (TRELLIS_WATCHDOG_INTERVAL_MS, default 1000 ms, and at most a
// tenth of the shortest group timeout) it, for each group:
//  - asks the backend to poll (nccl: completes finished ops, reads the
//    communicator's asynchronous error);
//  - publishes this rank's progress (progress.h) to the group's store
//    through a store handle of its own (Store::clone), so it never queues
//    behind the user's blocking store calls;
//  - fails the group when another rank did (the group's "abort" key), so
//    a rank in no op learns of it too; writes the flight recorder when an
//    op of the group failed;
//  - fails the group when the backend reported an error, or when an op has
//    been running longer than the group's timeout. A timeout first reads
//    every rank's progress and names the likely culprit; then the flight
//    recorder is written (TRELLIS_FLIGHT_RECORDER_DIR), the story goes
//    to the "abort" key (every other rank fails and writes its own), and
//    the backend is aborted with it as a TimeoutError, so every pending op
//    of the group fails with it. In WatchdogMode::kExit the process then ends
//    with kWatchdogExitCode.
// After any failure the group's store is held for max(storeLinger, 3 ticks)
// whether or not the group lives on, so a rank hosting the store (rank 0
// under fromEnvironment()) does not take it away while the others still
// read why; stop() waits out what is left of that.
// A second thread, the heartbeat monitor, checks that the watchdog itself
// moves: one stuck in one step (a driver call, a store call) for
// TRELLIS_WATCHDOG_HEARTBEAT_TIMEOUT_MS (default 120 s) is reported as
// "watchdog stuck in <step> of group <g>", not as a stuck collective; in
// kExit mode the recorders are written and the process ends with
// kWatchdogStuckExitCode.
//
// Thread safety: watch() and the handle's destruction may be called from
// any thread except the watchdog's own callbacks.
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <trellis/collectives/backend.h>
#include <trellis/collectives/flight_recorder.h>
#include <trellis/collectives/types.h>
#include <trellis/core/deadline.h>
#include <trellis/core/mutex.h>

namespace trellis::store {
class Store;
}

namespace trellis::collectives::detail {

struct WatchdogConfig {
  Duration interval = std::chrono::seconds(1);
  Duration heartbeatTimeout = std::chrono::seconds(120);
  // Bound on each store call the watchdog makes.
  Duration storeTimeout = std::chrono::seconds(5);
  // A failed group's store is held at least this long (and 3 ticks) after
  // the failure, even if the program drops the group at once: the other
  // ranks' culprit analyses read it, and this rank may host it.
  Duration storeLinger = std::chrono::seconds(1);
  // TRELLIS_WATCHDOG_INTERVAL_MS, TRELLIS_WATCHDOG_HEARTBEAT_TIMEOUT_MS;
  // a malformed value is an InvalidArgumentError naming it.
  static WatchdogConfig fromEnvironment();
};

// TRELLIS_WATCHDOG_MODE: unset or "exit", or "fail".
WatchdogMode watchdogModeFromEnvironment();
// TRELLIS_FLIGHT_RECORDER_ENTRIES: unset (2000) or 0..1000000.
size_t flightRecorderEntriesFromEnvironment();
// TRELLIS_FLIGHT_RECORDER_DIR: where dumps go; empty: nowhere.
std::string flightRecorderDirFromEnvironment();
// TRELLIS_NCCL_BLOCKING_WAIT: unset or 0 (false), or 1.
bool blockingWaitFromEnvironment();

struct WatchedGroup {
  GroupInfo info;
  WatchdogMode mode = WatchdogMode::kExit;
  std::string dumpDir;                  // empty: no files
  std::shared_ptr<store::Store> store;  // the group's (prefixed) store
  // Weak: the group destroys its backend itself, on its own thread, never
  // the watchdog (whose thread may outlive the program's last use of it).
  std::weak_ptr<Backend> backend;
  std::shared_ptr<FlightRecorder> recorder;
};

class Watchdog {
 public:
  struct Hooks {
    // Ends the process; default std::_Exit. Tests capture it.
    std::function<void(int code)> exit;
  };

  explicit Watchdog(WatchdogConfig config, Hooks hooks = {});
  // Stops both threads; groups still watched are let go.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Stops both threads (idempotent); watch() and handles keep working, but
  // nothing is checked any more.
  void stop();

  // The process's watchdog, started on first use with
  // WatchdogConfig::fromEnvironment(); stopped by an exit handler.
  static Watchdog& process();

  // Watches `group` until the handle is destroyed. The handle's destructor
  // waits for a check of this group in progress (bounded by the store
  // timeout and the backend's poll), so the backend may be destroyed
  // right after it.
  class Handle {
   public:
    ~Handle();
    Handle(const Handle&) = delete;
    Handle& operator=(const Handle&) = delete;

   private:
    friend class Watchdog;
    struct Entry;
    Handle(Watchdog* w, std::shared_ptr<Entry> e);
    Watchdog* watchdog_;
    std::shared_ptr<Entry> entry_;
  };
  std::unique_ptr<Handle> watch(WatchedGroup group);

  // What the heartbeat monitor reported last; empty while all is well.
  std::string stuckReport() const;

 private:
  using Entry = Handle::Entry;
  void run();
  void monitor();
  void check(Entry& e, std::chrono::steady_clock::time_point now);
  void timedOut(Entry& e, const FlightEntry& op);
  void fail(Entry& e, const Error& error, const std::string& reason,
            bool exitProcess);
  void dump(Entry& e, const std::string& reason);
  void publishAbort(Entry& e, const Error& why);
  void exitIfRequested();
  // From the config and the groups' timeouts; run() keeps currentTick().
  Duration tick() const TRELLIS_REQUIRES(mu_);
  Duration currentTick() const;
  void setPhase(const char* phase, const std::string& group);
  void unwatch(const std::shared_ptr<Entry>& e);
  // Drops the held stores whose time is up (all of them with `all`, after
  // waiting for the last).
  void releaseStores(bool all);

  const WatchdogConfig config_;
  Hooks hooks_;

  mutable Mutex mu_;
  CondVar cv_;
  bool stopping_ TRELLIS_GUARDED_BY(mu_) = false;
  bool changed_ TRELLIS_GUARDED_BY(mu_) = false;  // a group was added
  std::vector<std::shared_ptr<Entry>> entries_ TRELLIS_GUARDED_BY(mu_);
  std::string phase_ TRELLIS_GUARDED_BY(mu_) = "idle";
  std::string phaseGroup_ TRELLIS_GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point phaseSince_ TRELLIS_GUARDED_BY(mu_);
  std::string stuckReport_ TRELLIS_GUARDED_BY(mu_);
  bool anyExitMode_ TRELLIS_GUARDED_BY(mu_) = false;
  bool exitRequested_ TRELLIS_GUARDED_BY(mu_) = false;
  struct HeldStore {
    std::chrono::steady_clock::time_point until;
    std::shared_ptr<store::Store> store;
  };
  std::vector<HeldStore> heldStores_ TRELLIS_GUARDED_BY(mu_);
  std::atomic<int64_t> tickNs_{0};

  std::mutex joinMu_;
  std::thread thread_;
  std::thread monitor_;
};

}  // namespace trellis::collectives::detail
