#include "rendezvous.h"

#include <limits>
#include <string_view>

#include "envelope.h"
#include <trellis/core/deadline.h>
#include <trellis/core/logging.h>
#include <trellis/core/net.h>
#include <trellis/core/worker_env.h>
#include <trellis/rpc/registry.h>
#include <trellis/store/store.h>
#include <trellis/store/tcp_store.h>
#include <trellis/store/worker_store.h>

namespace trellis::rpc::detail {

namespace {

std::string workerKey(int32_t rank) {
  return std::string(kStoreKeyPrefix) + "worker/" + std::to_string(rank);
}

// The store from MASTER_ADDR / MASTER_PORT, like torch's env://: rank 0
// serves it, or the launcher does (TORCHELASTIC_USE_AGENT_STORE=True).
void makeStore(int32_t rank, const RpcOptions& options, Group& group) {
  const MasterEndpoint master = masterFromEnvironment();
  if (!master.complete()) {
    throwError(Error::invalidArgument(
        "rpc::init needs a rendezvous store: set RpcOptions::store, or "
        "MASTER_ADDR and MASTER_PORT"));
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
      options.initTimeout);
  store::WorkerStoreOptions so;
  so.jobToken = options.token;
  so.timeout = ms;
  so.connectTimeout = ms;
  store::WorkerStore ws = store::connectWorkerStore(master, rank, so);
  group.storeServer = std::move(ws.server);
  group.store = std::move(ws.store);
  group.ownStore = true;
  group.launcherStore = master.agentStore;
  group.storeDescription = std::move(ws.description);
}

}  // namespace

Group::Group() = default;
Group::~Group() = default;

void checkStartArguments(const std::string& name, int32_t rank,
                         int32_t worldSize, const RpcOptions& options) {
  if (!validWorkerName(name)) {
    throwError(Error::invalidArgument(
        "worker name '" + name +
        "' must be 1-128 characters of [A-Za-z0-9_.:-]"));
  }
  if (worldSize < 1 || worldSize > kMaxWorldSize) {
    throwError(Error::invalidArgument(
        "world size " + std::to_string(worldSize) + " must be in [1, 65535]"));
  }
  if (rank < 0 || rank >= worldSize) {
    throwError(Error::invalidArgument("rank " + std::to_string(rank) +
                                      " must be in [0, " +
                                      std::to_string(worldSize) + ")"));
  }
  if (options.numWorkerThreads < 1 || options.numCompletionThreads < 1) {
    throwError(Error::invalidArgument(
        "RpcOptions: numWorkerThreads and numCompletionThreads must be >= 1"));
  }
  if (options.maxMessageBytes < 1 ||
      options.maxMessageBytes >
          static_cast<size_t>(std::numeric_limits<int64_t>::max())) {
    throwError(Error::invalidArgument(
        "RpcOptions: maxMessageBytes must be in [1, 2^63), got " +
        std::to_string(options.maxMessageBytes)));
  }
  throwIfError(Registry::global().status());
}

std::string describeWorker(const WorkerInfo& w) {
  return "worker '" + w.name + "' (rank " + std::to_string(w.rank) + ")";
}

void rendezvous(const WorkerInfo& me, int32_t worldSize,
                const RpcOptions& options, Group& group) {
  if (group.store == nullptr) {
    group.store = options.store;
  }
  const Deadline deadline = Deadline::fromTimeout(options.initTimeout);
  if (group.store == nullptr) {
    makeStore(me.rank, options, group);
  }
  store::Store& store = *group.store;
  store.set(workerKey(me.rank),
            encodeWorkerEntry({me.name, me.address, me.maxMessageBytes}));
  std::vector<std::string> keys;
  for (int32_t r = 0; r < worldSize; ++r) {
    keys.push_back(workerKey(r));
  }
  try {
    store.wait(keys, std::chrono::duration_cast<std::chrono::milliseconds>(
                         deadline.isNever() ? Duration::zero()
                                            : deadline.remaining()));
  } catch (const TimeoutError&) {
    std::string missing;
    for (int32_t r = 0; r < worldSize && missing.size() < 200; ++r) {
      if (!store.check({keys[r]})) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    throwError(Error::timeout("rpc::init of '" + me.name + "': ranks [" +
                              missing + "] did not join within " +
                              formatDuration(options.initTimeout)));
  }
  const auto values = store.multiGet(keys);
  group.workers.resize(worldSize);
  for (int32_t r = 0; r < worldSize; ++r) {
    const std::string_view v(reinterpret_cast<const char*>(values[r].data()),
                             values[r].size());
    WorkerEntry entry;
    if (Error e = parseWorkerEntry(v, &entry); !e.ok()) {
      throwError(
          Error::protocol("rpc::init: malformed rendezvous entry for "
                          "rank " +
                          std::to_string(r) + ": " + e.message()));
    }
    WorkerInfo w;
    w.rank = r;
    w.name = std::move(entry.name);
    w.address = std::move(entry.address);
    w.maxMessageBytes = entry.maxMessageBytes;
    if (auto [it, fresh] = group.byName.emplace(w.name, r); !fresh) {
      throwError(Error(Code::kAlreadyExists,
                       "rpc::init: ranks " + std::to_string(it->second) +
                           " and " + std::to_string(r) +
                           " both use the worker name '" + w.name + "'"));
    }
    group.workers[r] = std::move(w);
  }
  if (group.ownStore && !group.launcherStore) {
    group.storeDescription +=
        " (served by " + describeWorker(group.workers[0]) + ")";
  }
  TRELLIS_LOG_DEBUG("rpc agent {} (rank {}/{}) listening on {}", me.name,
                    me.rank, worldSize, me.address);
}

}  // namespace trellis::rpc::detail
