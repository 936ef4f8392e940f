#pragma once

// Rendezvous: how the agents of a job agree, round after round, on who is
// in the worker group and with which ranks (docs/elastic.md, "Rendezvous").
//
// The agent talks to a `Rendezvous` (below); `static` (one node), `c10d`
// (a Trellis TCPStore hosted by one of the agents) and `etcd` (an etcd
// server's v3 API, etcd_store.h) implement it. c10d and etcd run the same
// rounds over a store::Store (store_rendezvous.h).
//
// Rounds live in one store key, the ROUND RECORD (kRoundKey), that
// every node changes only with compareSet, so two nodes never both win a
// move. One node's view of a round is an explicit state machine, RoundJoin:
//
//          +-----------------------------------------------+
//          v                                               | the round
//   START --read--> JOINED (in an open round) --closed--> READY
//          |             |  MAX joined: closed at once       |
//          |             |  MIN joined: closed after the     | (new round:
//          |             |  last call, by whoever sees it    |  a failure,
//          |             |  expire first                     |  a death, or
//          |             v                                   |  a scale-up)
//          +--> WAITING (the round was closed: on its        |
//                        waiting list until a new round)     |
//                                                            v
//                                                    JOB_FAILED (budget)
//
// Timers are each node's own steady clock (no wall-clock time is stored),
// so skewed clocks across hosts cannot close a round early or late.
//
// Liveness (c10d): every node adds 1 to its heartbeat key every keep-alive
// interval (a thread with a store connection of its own). Observers
// remember when each counter last moved by their own clock; a node whose
// counter has not moved for interval * max_attempt is dead.
// Liveness (etcd): every node's heartbeat key is attached to an etcd lease
// of TTL interval * max_attempt that the node keeps alive every interval;
// when it stops, etcd deletes the key and observers see the node dead.
// A dead node in an open round is struck from it; a dead node in a closed
// round ends that round: a new one opens, counted as a restart.
//
// The record and its codec are in round_record.h.
//
// Thread safety: RoundRecord and its codec are values; RoundJoin,
// Liveness and the Rendezvous objects belong to the agent's thread.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <trellis/core/error.h>
#include <trellis/elastic/options.h>
#include <trellis/elastic/round_record.h>
#include <trellis/elastic/worker_env.h>

namespace trellis::store {
class Store;
}

namespace trellis::elastic {

using RdzvClock = std::chrono::steady_clock;

// ---- Liveness ---------------------------------------------------------------

std::string heartbeatKey(const std::string& nodeId);

// kCounter: a heartbeat counter that must keep moving (c10d).
// kLease: a key that exists while its owner's lease lives (etcd).
enum class LivenessMode : uint8_t { kCounter, kLease };

// What one node has seen of the others' heartbeats.
class Liveness {
 public:
  explicit Liveness(RdzvClock::duration bound,
                    LivenessMode mode = LivenessMode::kCounter)
      : bound_(bound), mode_(mode) {}
  // Reads the heartbeat keys of `ids` and remembers when each counter last
  // moved (kCounter: absent ones count as not moving; kLease: whether each
  // key exists, absent meaning dead at once: etcd waited the TTL).
  void observe(store::Store& store, const std::vector<std::string>& ids,
               RdzvClock::time_point now);
  // Records a counter value directly (observe() calls it; tests too).
  void note(const std::string& id, int64_t counter, RdzvClock::time_point now);
  // kCounter: not moved for longer than the bound since first seen or
  // last moved. kLease: its key was absent when last observed.
  bool dead(const std::string& id, RdzvClock::time_point now) const;
  RdzvClock::duration bound() const { return bound_; }
  LivenessMode mode() const { return mode_; }

 private:
  struct Seen {
    int64_t counter = -1;
    RdzvClock::time_point since{};
  };
  RdzvClock::duration bound_;
  LivenessMode mode_;
  std::map<std::string, Seen> seen_;
};

// ---- One node's way into a closed round -------------------------------------

struct RoundParams {
  std::string runId;
  int32_t nproc = 1;
  int32_t minNodes = 1;
  int32_t maxNodes = 1;
  RdzvClock::duration lastCall = kDefaultLastCallTimeout;
  int32_t maxRestarts = 0;
};

// Opens round `from.round + 1` after `from`: counted (a failure or a death:
// restarts + 1, or kFailed when that passes the budget) or not (scale-up).
RoundRecord nextRound(const RoundRecord& from, const RoundParams& params,
                      bool counted, std::string note);

class RoundJoin {
 public:
  enum class State : uint8_t { kStart, kJoined, kWaiting, kReady, kJobFailed };

  // `isDead` answers for a participant id (Liveness::dead at `now`).
  RoundJoin(store::Store& store, RoundParams params, RoundNode self,
            std::function<bool(const std::string&)> isDead);

  // One move: reads the record and, where there is something to do,
  // compareSets it. Throws InvalidArgumentError for a record of another run
  // or another --nproc-per-node, ProtocolError for a record that does not
  // decode (both name the key); what the store throws otherwise.
  State step(RdzvClock::time_point now);

  State state() const { return state_; }
  // The record as last read (the closed round when kReady).
  const RoundRecord& record() const { return record_; }
  // The record's text as last read; empty when it was absent.
  const std::string& recordText() const { return recordText_; }
  // kReady: this node's place in record().participants.
  int32_t groupRank() const;
  // "2 of 2..3 nodes in round 4 (joining)" for logs and timeouts.
  std::string describe() const;

 private:
  // Reads the record; false when absent.
  bool read();
  // compareSet from the last read text to `next`; true when it won.
  bool swap(const RoundRecord& next);

  store::Store& store_;
  RoundParams params_;
  RoundNode self_;
  std::function<bool(const std::string&)> isDead_;
  State state_ = State::kStart;
  RoundRecord record_;
  std::string recordText_;
  int64_t joinedRound_ = -1;
  std::optional<RdzvClock::time_point> lastCallSince_;
};
const char* roundJoinStateName(RoundJoin::State state);

// Reads and decodes the record: nullopt when absent; throws as
// RoundJoin::step for garbage.
std::optional<RoundRecord> readRoundRecord(store::Store& store);

// ---- The interface the agent uses -------------------------------------------

// What the agent should do with its running (or finished) workers.
enum class GroupEvent : uint8_t {
  kNone,       // carry on
  kRestart,    // a new round opened: stop the workers and rendezvous again
  kJobFailed,  // the restart budget is spent (kFailed): stop and give up
};

// How a node's exit barrier ended.
struct BarrierResult {
  GroupEvent event = GroupEvent::kNone;  // kNone: every node finished
  std::string message;                   // why not, when not
};

class Rendezvous {
 public:
  virtual ~Rendezvous();
  // Blocks until this node is in a closed round (bounded by the join
  // timeout) and returns its workers' outcome (ranks, master, restart
  // count). `interrupted` is asked between moves; true makes it throw
  // Interrupted. Throws TimeoutError naming the round's state at the
  // deadline; kJobFailed surfaces as JobFailed.
  virtual RendezvousOutcome next(const std::function<bool()>& interrupted) = 0;
  // Called every monitor interval while the workers run.
  virtual GroupEvent poll() = 0;
  // This node's workers failed: a new round, counted. kRestart, or
  // kJobFailed when the budget is spent.
  virtual GroupEvent reportFailure(const std::string& why) = 0;
  // This node's workers all exited 0: waits for every node of the round
  // (the exit barrier), or a reason not to.
  virtual BarrierResult finish(const std::function<bool()>& interrupted) = 0;
  // Why the job failed, when a move said kJobFailed.
  virtual std::string failureNote() const = 0;
};

// Thrown by Rendezvous::next, and by the backends' factories while they
// connect, when the agent was signalled meanwhile.
struct Interrupted {};
// Thrown by Rendezvous::next when the round record says the job failed.
struct JobFailed {
  std::string note;
};

// One node, nothing to agree on (--standalone, static with one node): the
// master port, and restarts counted here.
std::unique_ptr<Rendezvous> makeLocalRendezvous(const ElasticOptions& options,
                                                std::string runLogDir,
                                                auth::JobToken token);

// Where a c10d agent's messages go.
using LogFn = std::function<void(const std::string&)>;
// True once the agent got a signal (agent.cc drains its signal pipe). The
// backends below look at it about every second while they wait to connect
// to their store, and throw Interrupted when it is true.
using Interruption = std::function<bool()>;

// The c10d rendezvous: hosts the store (if it binds the endpoint, or
// is_host=true) or connects to it (bounded by join_timeout), starts the
// heartbeat thread, and runs rounds as above. Throws ConnectionError naming
// the endpoint when it cannot be reached, InvalidArgumentError for a bad
// configuration (the message names the flag). `shareWithWorkers`: the
// workers use this store too (TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR
// and MASTER_PORT the endpoint; agentStoreForWorkers says when).
std::unique_ptr<Rendezvous> makeC10dRendezvous(const ElasticOptions& options,
                                               std::string runLogDir,
                                               auth::JobToken token, LogFn log,
                                               const Interruption& interrupted,
                                               bool shareWithWorkers = false);

// The static rendezvous of several nodes (--rdzv-backend static, --nnodes
// N > 1, --node-rank R): the rounds of c10d with MIN = MAX = N, the store
// hosted by node rank 0 at the endpoint (--master-addr:--master-port unless
// --rdzv-endpoint is given; the others connect, bounded by join_timeout or
// else `timeout`), group rank = --node-rank (a rank taken twice is an
// InvalidArgumentError). Workers: TORCHELASTIC_USE_AGENT_STORE=False, their
// rank 0 serves their store on a port node rank 0 picks.
std::unique_ptr<Rendezvous> makeStaticRendezvous(
    const ElasticOptions& options, std::string runLogDir, auth::JobToken token,
    LogFn log, const Interruption& interrupted);

// The etcd rendezvous (--rdzv-backend etcd): the same rounds in etcd under
// /trellis/rdzv/<run id>/ (etcd_store.h), liveness by etcd leases. Waits
// up to join_timeout for etcd to answer; throws ConnectionError naming the
// endpoint when it does not, InvalidArgumentError for a bad configuration.
std::unique_ptr<Rendezvous> makeEtcdRendezvous(const ElasticOptions& options,
                                               std::string runLogDir,
                                               auth::JobToken token, LogFn log,
                                               const Interruption& interrupted);

namespace detail {
// Shared by rendezvous.cc and the backends over a store.
// "trellis/rdzv/r<round>/<leaf>".
std::string roundKey(int64_t round, std::string_view leaf);
// "1 node", "3 nodes".
std::string plural(size_t n, const char* what);
}  // namespace detail

}  // namespace trellis::elastic
