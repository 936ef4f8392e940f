#pragma once
// FlightRecorder: the last N ops of one process group, kept in memory so
// the watchdog can write them out when the group fails (docs/collectives.md,
// "Flight recorder"). Not installed; no libtorch.
//
// Contract
//  - The front end calls scheduled() when an op is issued, started() when
//    the backend starts it and finished() once, when it completed or
//    failed. Collectives carry their sequence number; point-to-point ops
//    have seq 0 and a peer and tag.
//  - The ring keeps the last `capacity` entries (0: none, but in-flight
//    ops are still tracked for timeouts); ops still in flight are tracked
//    apart from the ring, so a timeout is seen however many ops followed.
//  - progress() is what this rank tells the others through the store: the
//    last collective it started and the last it completed.
//  - Thread safety: every method may be called from any thread; each takes
//    one short lock and allocates nothing once the ring is full, except
//    for the error text of a failed op.
#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <trellis/collectives/cpu/message.h>
#include <trellis/core/error.h>
#include <trellis/core/mutex.h>

namespace trellis::collectives::detail {

using SteadyTime = std::chrono::steady_clock::time_point;

enum class OpState : uint8_t { kScheduled, kStarted, kCompleted, kFailed };
std::string_view toString(OpState s);

constexpr size_t kMaxRecordedDims = 8;

struct FlightEntry {
  uint64_t id = 0;  // per recorder, from 1, in issue order
  Fingerprint fp;   // seq 0 for point-to-point ops
  int peer = -1;    // point-to-point: the other rank (-1: any source)
  int64_t tag = 0;
  // The first tensor's shape (up to kMaxRecordedDims dims; ndim says how
  // many it had).
  std::array<int64_t, kMaxRecordedDims> shape{};
  uint8_t ndim = 0;
  OpState state = OpState::kScheduled;
  SteadyTime enqueued{}, started{}, ended{};
  std::string error;  // failed ops
  // "seq 42 allreduce(float32[1048576], sum)" or "send(float32[4], to rank
  // 1, tag 7)".
  std::string describe() const;
};

struct Progress {
  uint64_t startedSeq = 0;    // last collective started (0: none yet)
  uint64_t completedSeq = 0;  // last collective that completed
  Fingerprint started;        // the one at startedSeq
  bool failed = false;        // some op of the group failed
};

class FlightRecorder {
 public:
  static constexpr size_t kDefaultCapacity = 2000;
  explicit FlightRecorder(size_t capacity = kDefaultCapacity);

  // Returns the entry's id.
  uint64_t scheduled(const Fingerprint& fp, int peer, int64_t tag,
                     std::span<const int64_t> shape);
  void started(uint64_t id);
  void finished(uint64_t id, const Error& error);

  // The ring, oldest first.
  std::vector<FlightEntry> entries() const;
  // The op that started longest ago and is still running, if it started
  // before `cutoff`.
  std::optional<FlightEntry> startedBefore(SteadyTime cutoff) const;
  Progress progress() const;
  size_t capacity() const { return capacity_; }

 private:
  FlightEntry* inRing(uint64_t id) TRELLIS_REQUIRES(mu_);
  FlightEntry* inPending(uint64_t id) TRELLIS_REQUIRES(mu_);

  const size_t capacity_;
  mutable Mutex mu_;
  std::vector<FlightEntry> ring_ TRELLIS_GUARDED_BY(mu_);
  uint64_t nextId_ TRELLIS_GUARDED_BY(mu_) = 1;
  // Not finished, in issue order: usually a handful, finishing in order.
  std::deque<FlightEntry> pending_ TRELLIS_GUARDED_BY(mu_);
  Progress progress_ TRELLIS_GUARDED_BY(mu_);
};

// Who a dump belongs to.
struct GroupInfo {
  std::string name;     // "default"
  std::string groupId;  // "default#1": the name and its generation
  std::string backend;  // "cpu"
  int rank = 0;
  int size = 0;
  std::chrono::milliseconds timeout{0};
};

// The dump as JSON (docs/collectives.md, "Flight recorder"): version,
// group, rank, pid, host, reason, dump time, and the entries with wall
// clock times in microseconds since the Unix epoch.
std::string toJson(const GroupInfo& group, const std::vector<FlightEntry>& e,
                   const std::string& reason);

// Writes toJson(...) to `dir`/<group id>-rank<r>.json (made safe for a file
// name), creating `dir` if needed, atomically (a temporary file renamed).
// Returns the path, or an error naming the path and errno.
Error writeDump(const std::string& dir, const GroupInfo& group,
                const std::vector<FlightEntry>& entries,
                const std::string& reason, std::string* path);

}  // namespace trellis::collectives::detail
