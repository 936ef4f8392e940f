#include <trellis/core/error.h>
#include <trellis/core/net.h>
#include <trellis/store/prefix_store.h>
#include <trellis/store/tcp_store.h>
#include <trellis/store/worker_store.h>

namespace trellis::store {

WorkerStore connectWorkerStore(const MasterEndpoint& master, int32_t rank,
                               const WorkerStoreOptions& options) {
  if (!master.complete()) {
    throw InvalidArgumentError(Error::invalidArgument(
        "no store to meet through: MASTER_ADDR and MASTER_PORT must be set"));
  }
  WorkerStore out;
  const std::string where =
      net::bracketIfIpv6(master.addr) + ":" + std::to_string(master.port);
  out.description =
      master.agentStore
          ? "the launcher's store at " + where +
                " (TORCHELASTIC_USE_AGENT_STORE=True, keys under " +
                master.keyPrefix + ")"
          : "the rendezvous store at " + where;
  // Our context on the error, same code (so the same exception type).
  auto fail = [&](const Exception& e, const std::string& hint) {
    throwError(
        Error(e.code(), out.description + ": " + e.error().message() + hint));
  };
  if (!master.agentStore && rank == 0) {
    TCPStoreServerOptions so;
    so.host = master.addr;
    so.port = master.port;
    so.jobToken = options.jobToken;
    try {
      out.server = std::make_shared<TCPStoreServer>(so);
    } catch (const Exception& e) {
      fail(e, " (rank 0 serves it: TORCHELASTIC_USE_AGENT_STORE is not True)");
    }
  }
  TCPStoreOptions co;
  co.host = master.addr;
  co.port = master.port;
  co.jobToken = options.jobToken;
  co.timeout = options.timeout;
  co.connectTimeout = options.connectTimeout;
  std::shared_ptr<Store> client;
  try {
    client = std::make_shared<TCPStore>(co);
  } catch (const Exception& e) {
    fail(e, master.agentStore
                ? std::string(" (every rank connects to the launcher's store, "
                              "which must be a Trellis store: elastic-run's; "
                              "under torchrun set "
                              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so rank 0 "
                              "serves one)")
                : std::string());
  }
  out.store = master.agentStore
                  ? std::make_shared<PrefixStore>(master.keyPrefix, client)
                  : client;
  return out;
}

}  // namespace trellis::store
