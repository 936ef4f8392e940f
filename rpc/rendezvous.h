#pragma once

// How an agent finds its group at start() (internal; docs/rpc.md,
// "Starting and stopping"): the checks of start()'s arguments, the
// rendezvous store (RpcOptions::store, or the store on MASTER_ADDR /
// MASTER_PORT: store/worker_store.h), and the exchange of WorkerInfo.

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <trellis/rpc/agent.h>

namespace trellis::store {
class TCPStoreServer;
}

namespace trellis::rpc::detail {

// Keys of the rendezvous and of graceful shutdown (quiescence.h) live
// under this prefix of the store.
inline constexpr std::string_view kStoreKeyPrefix = "trellis/rpc/";
// Context and RRef ids keep the worker in 16 bits.
inline constexpr int32_t kMaxWorldSize = 65535;

// Throws InvalidArgumentError naming the bad argument.
void checkStartArguments(const std::string& name, int32_t rank,
                         int32_t worldSize, const RpcOptions& options);

// "worker 'w1' (rank 1)", as errors name workers.
std::string describeWorker(const WorkerInfo& worker);

// The group as the rendezvous found it. Filled by rendezvous() and fixed
// after start() returns: read without a lock.
struct Group {
  std::vector<WorkerInfo> workers;  // by rank
  std::unordered_map<std::string, int32_t> byName;
  std::shared_ptr<store::Store> store;
  // Rank 0 of an agent that made its own store serves it (not with the
  // launcher's store, TORCHELASTIC_USE_AGENT_STORE=True).
  std::shared_ptr<store::TCPStoreServer> storeServer;
  // The store was made here from MASTER_ADDR/PORT (ours to re-time).
  bool ownStore = false;
  // ... and it is the launcher's (a PrefixStore over a client).
  bool launcherStore = false;
  std::string storeDescription = "the rendezvous store";

  Group();
  ~Group();
};

// Publishes `me` (its address already known) and waits, up to
// options.initTimeout, for every rank of the group. Throws
// InvalidArgumentError (no store and no MASTER_ADDR/PORT), TimeoutError
// (lists the ranks that never came), AlreadyExistsError (two ranks with
// one name, naming both), ProtocolError (a malformed entry). What it made
// before throwing (the store server) is left in `group` for the caller to
// stop.
void rendezvous(const WorkerInfo& me, int32_t worldSize,
                const RpcOptions& options, Group& group);

}  // namespace trellis::rpc::detail
