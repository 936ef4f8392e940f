#pragma once

// Who this worker is in its job, read from the variables a launcher sets
// (docs/examples.md, "Worker environment"). trellis-launch and torchrun set
//
//   RANK, WORLD_SIZE               this worker's rank in the job, job size
//   LOCAL_RANK, LOCAL_WORLD_SIZE   the same among the workers of this host
//   MASTER_ADDR, MASTER_PORT       where rank 0 serves the rendezvous store
//   TRELLIS_JOB_TOKEN              the job's shared secret (Trellis only)
//
// Every layer and example reads them here, once, so a value is checked the
// same way everywhere and a bad one is named in the error.
//
//   auto env = trellis::WorkerEnv::fromEnvironment();
//   trellis::rpc::init("worker" + std::to_string(env.rank), env.rank,
//                      env.worldSize);
//
// Rules. RANK and WORLD_SIZE are required. LOCAL_RANK and LOCAL_WORLD_SIZE
// are optional: unset, the job is taken to run on one host (localRank =
// rank, localWorldSize = worldSize). MASTER_ADDR and MASTER_PORT are
// optional here (a program may rendezvous through a store it made itself);
// the layer that needs them says so. Numbers are decimal integers with
// nothing around them; 0 <= RANK < WORLD_SIZE, 0 <= LOCAL_RANK <
// LOCAL_WORLD_SIZE <= WORLD_SIZE, 1 <= MASTER_PORT <= 65535. A variable set
// to the empty string counts as unset. Anything else throws
// InvalidArgumentError naming the variable and its value (the token's
// value is never shown).

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include <trellis/core/auth.h>

namespace trellis {

// MASTER_ADDR and MASTER_PORT alone, for code that is given its rank some
// other way (an explicit argument) but still finds the store through them.
struct MasterEndpoint {
  std::string addr;   // empty: MASTER_ADDR unset
  uint16_t port = 0;  // 0: MASTER_PORT unset
  bool complete() const { return !addr.empty() && port != 0; }
};

struct WorkerEnv {
  int32_t rank = 0;
  int32_t worldSize = 1;
  int32_t localRank = 0;
  int32_t localWorldSize = 1;
  MasterEndpoint master;
  std::optional<auth::JobToken> jobToken;

  // Reads the process environment; throws InvalidArgumentError as above.
  static WorkerEnv fromEnvironment();

  // The same over any source of variables (tests; launchers that build a
  // worker's environment). `lookup` returns nullopt for an unset variable.
  using Lookup = std::function<std::optional<std::string>(const char* name)>;
  static WorkerEnv fromVariables(const Lookup& lookup);
};

// MASTER_ADDR / MASTER_PORT only (both optional, checked as above).
MasterEndpoint masterFromEnvironment();
MasterEndpoint masterFromVariables(const WorkerEnv::Lookup& lookup);

}  // namespace trellis
