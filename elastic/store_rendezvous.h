#pragma once

// The rendezvous over a store that the c10d and etcd backends share
// (store_rendezvous.cc): one RoundJoin state machine, one exit barrier, one
// way of watching a running round. A backend contributes the store, how a
// node shows it is alive, and (c10d) the server it hosts. Internal to
// elastic/; not installed.

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <trellis/core/deadline.h>
#include <trellis/elastic/rendezvous.h>
#include <trellis/store/tcp_store.h>

namespace trellis::elastic {

// Where the workers reach the store that the agents use.
struct WorkerStoreEndpoint {
  std::string addr;
  uint16_t port = 0;
};

struct RoundStore {
  // Where the round record lives; every node's own handle.
  std::unique_ptr<store::Store> store;
  // One heartbeat of node `id`: called once (`first`) before the node
  // appears in the record, then every keep-alive interval from the
  // heartbeat thread. Throws when the store is gone (the thread then
  // stops beating and says so). Must be callable from that thread while
  // the agent's thread uses `store`.
  std::function<void(const std::string& id, bool first)> beat;
  // Waits up to a short bound of its own for `key`'s value to stop being
  // `seen` (empty: absent), returning at once when it already has; the
  // rendezvous calls it between moves. Unset: the rendezvous sleeps 50 ms.
  // etcd: a Watch; c10d: the change ticks of a ChangeStore
  // (change_store.h). Either way a move wakes the others at once.
  std::function<void(const std::string& key, const std::string& seen)>
      awaitChange;
  // How the others tell that a node died.
  LivenessMode liveness = LivenessMode::kCounter;
  // c10d: the store this node hosts; kept until the nodes of the last
  // round have passed the exit barrier.
  std::unique_ptr<store::TCPStoreServer> server;
  // c10d, unless the workers cannot use it (agentStoreForWorkers): the
  // workers get this as MASTER_ADDR:MASTER_PORT with
  // TORCHELASTIC_USE_AGENT_STORE=True instead of a port group rank 0
  // picks. Unset: group rank 0's rank 0 serves the workers' store.
  std::optional<WorkerStoreEndpoint> workerStore;
  // static: this node's group rank is fixed (--node-rank), not its place in
  // the join order; the node claims it in the store first, so two nodes
  // with one --node-rank are refused by name.
  std::optional<int32_t> fixedGroupRank;
};

std::unique_ptr<Rendezvous> makeStoreRendezvous(const ElasticOptions& options,
                                                std::string runLogDir,
                                                auth::JobToken token, LogFn log,
                                                RoundStore parts);

// How often an agent that waits (up to join_timeout) to connect to the
// rendezvous store looks for a signal.
inline constexpr std::chrono::milliseconds kConnectSlice{1000};

// Calls `connect(window)`, a connect that throws ConnectionError when
// nobody answered within `window`, with windows of at most kConnectSlice,
// until one returns or `deadline` passes (the last ConnectionError then
// propagates). Before each call it throws Interrupted when `interrupted()`
// says the agent got a signal: a connect of up to join_timeout (600 s by
// default) must not outlast a SIGTERM by more than about a second.
void connectInSlices(
    const std::function<void(std::chrono::milliseconds window)>& connect,
    const Deadline& deadline, const Interruption& interrupted);

}  // namespace trellis::elastic
