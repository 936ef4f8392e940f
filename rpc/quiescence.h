#pragma once

// Graceful shutdown's group protocol (docs/rpc.md, "Shutdown"), internal to
// rpc/: every worker of a group waits until no RPC message is in flight
// anywhere, then all close together. Written against a Store and a
// Participant so that it runs, and is tested, without an agent.
//
// Arrival. Each worker publishes "<prefix>0/<rank>" and waits for every
// other worker's key, one worker at a time in rank order. That wait has no
// limit of its own unless `arrivalTimeout` is set, so a server may enter
// shutdown right after init and wait there for its trainers, as with
// torch.distributed. A worker that is gone does not hold it up: while it
// waits for a worker, the protocol probes it every `probeInterval`; a probe
// that fails (its connection refused or closed, or no answer within the
// probe's own timeout) ends the wait with an error naming that worker.
//
// The worker that finds another gone (or not answering) publishes what it
// found under "<prefix>verdict"; the others, between two waits, fail with
// the same finding ("... (found by worker 'w0')"), and say so under
// "<prefix>seen/<rank>". The worker that hosts the store waits (about two
// probe intervals) for the live workers' "seen" before it returns and its
// store goes down: otherwise they failed with the closed store's error.
//
// Rounds. Then, in round r = 1, 2, ..., each worker waits until it has
// nothing in flight itself (or the deadline), publishes "active sent
// received" under "<prefix><r>/<rank>" and waits for every worker's entry
// of round r. The group is quiet when two consecutive rounds both show
// nothing active and the same totals with sent == received (the
// four-counter method): no message can then be travelling, nor have been
// sent between the two snapshots of any worker. `quiesceTimeout`, counted
// from the last arrival, bounds the rounds. A worker deletes its entry of
// round r - 2 when it publishes round r (every worker has read it by then).
//
// Exit. Each worker counts itself out; the last sets "<prefix>exit/done".
// The worker that hosts the store (`hostsStore`) waits for that key, so it
// does not take the store down under the others.
//
// Errors (thrown): TimeoutError naming the workers that never arrived,
// stopped taking part, or still had calls in flight; ConnectionError or
// TimeoutError naming a worker whose probe failed; the store's own errors
// pass through (the caller adds what it knows about the store).

#include <cstdint>
#include <functional>
#include <string>

#include <trellis/core/deadline.h>
#include <trellis/core/future.h>

namespace trellis::store {
class Store;
}

namespace trellis::rpc::detail {

struct QuiescenceCounts {
  uint64_t active = 0;  // calls sent and not answered + requests running
  uint64_t sent = 0;    // messages sent, running total
  uint64_t received = 0;
};

// What the protocol needs from the worker it runs for. Called on the
// thread that runs the protocol.
class QuiescenceParticipant {
 public:
  virtual ~QuiescenceParticipant() = default;
  virtual QuiescenceCounts counts() = 0;
  // Returns once counts().active is 0, or at `deadline`.
  virtual void waitIdle(Deadline deadline) = 0;
  // Completes when `rank` answered; fails when it is gone or did not answer
  // within the probe's own bound (the error says which).
  virtual Future<void> probe(int32_t rank) = 0;
  // "worker 'w2' (rank 2)"
  virtual std::string describe(int32_t rank) = 0;
};

struct QuiescenceOptions {
  std::string keyPrefix;  // "trellis/rpc/shutdown/"
  std::string name;       // this worker's name, for messages
  int32_t rank = 0;
  int32_t worldSize = 1;
  // Waiting for the others to enter shutdown; zero = no limit while they
  // answer probes.
  Duration arrivalTimeout = Duration::zero();
  // The rounds, from the last arrival; zero = no limit.
  Duration quiesceTimeout = std::chrono::seconds(60);
  Duration probeInterval = std::chrono::milliseconds(500);
  bool hostsStore = false;
};

void runQuiescence(store::Store& store, QuiescenceParticipant& self,
                   const QuiescenceOptions& options);

}  // namespace trellis::rpc::detail
