#pragma once

// The store a worker's layers (rpc::init, ProcessGroup::fromEnvironment)
// meet through when they find it from the launcher's variables
// (core/worker_env.h): MASTER_ADDR, MASTER_PORT and
// TORCHELASTIC_USE_AGENT_STORE (docs/store.md, "The workers' store").
//
//   - False (or unset): rank 0 serves a TCPStore at MASTER_ADDR:MASTER_PORT
//     and every rank, rank 0 too, connects to it, as torch's env://.
//   - True: the launcher (elastic-run's c10d agent, torchrun's agent)
//     already serves one there and it outlives the workers, so no rank
//     serves; every rank connects as a client, and sees the store through a
//     PrefixStore of master.keyPrefix ("/worker/attempt_<N>[/round_<R>]"),
//     so a restarted group never meets the keys of the one before it, and
//     no worker key can collide with the launcher's own (elastic-run's are
//     under "trellis/rdzv/").
//
// Thread safety: a function; the store it returns is any Store's.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <trellis/core/auth.h>
#include <trellis/core/worker_env.h>
#include <trellis/store/store.h>

namespace trellis::store {

class TCPStoreServer;

struct WorkerStoreOptions {
  std::optional<auth::JobToken> jobToken;
  // The store's default timeout (every request's bound) and how long to
  // keep trying to connect (0: `timeout`).
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;
  std::chrono::milliseconds connectTimeout{0};
};

struct WorkerStore {
  // The client: prefixed when the launcher's. Keeps nothing else alive.
  std::shared_ptr<Store> store;
  // The server this rank runs (rank 0 without the launcher's store), else
  // null. The caller decides how long it serves.
  std::shared_ptr<TCPStoreServer> server;
  // "the rendezvous store at H:P" or "the launcher's store at H:P
  // (TORCHELASTIC_USE_AGENT_STORE=True, keys under /worker/attempt_0)",
  // for errors.
  std::string description;
};

// Throws InvalidArgumentError when `master` is incomplete (naming
// MASTER_ADDR/MASTER_PORT), and what TCPStoreServer (rank 0: the port is
// taken) or TCPStore (cannot connect, AuthError, ProtocolError) throws,
// with the same code and the description in front; with the launcher's
// store the message also says that it must be a Trellis store (a Trellis
// worker under torchrun's own store needs
// TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 there).
WorkerStore connectWorkerStore(const MasterEndpoint& master, int32_t rank,
                               const WorkerStoreOptions& options);

}  // namespace trellis::store
