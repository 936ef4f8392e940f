#pragma once

// Who this worker is in its job, read from the variables a launcher sets
// (docs/examples.md, "Worker environment"). elastic-run and torchrun set
//
//   RANK, WORLD_SIZE               this worker's rank in the job, job size
//   LOCAL_RANK, LOCAL_WORLD_SIZE   the same among the workers of this host
//   MASTER_ADDR, MASTER_PORT       where the rendezvous store is served:
//                                  by rank 0, or by the launcher when
//   TORCHELASTIC_USE_AGENT_STORE   is "True" (then every rank is a client
//                                  and keys go under a prefix, below)
//   TRELLIS_JOB_TOKEN              the job's shared secret (Trellis only)
//
// Every layer and example reads them here, once, so a value is checked the
// same way everywhere and a bad one is named in the error.
//
//   auto env = trellis::WorkerEnv::fromEnvironment();
//   trellis::rpc::init("worker" + std::to_string(env.rank), env.rank,
//                      env.worldSize);
//
// Workers started by srun or Open MPI's mpirun, without elastic-run, work
// too. The first launcher whose rank or size variable is set wins:
//   1. torchrun / elastic-run: RANK, WORLD_SIZE, LOCAL_RANK,
//      LOCAL_WORLD_SIZE (also when elastic-run itself runs under srun);
//   2. Open MPI: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//      (before Slurm: mpirun's processes inherit the batch step's
//      SLURM_PROCID, 0 for every one of them);
//   3. Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and the tasks on
//      this node from SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE,
//      "2(x3),1" form) at SLURM_NODEID.
// MASTER_ADDR and MASTER_PORT always win when set. Unset, under Slurm (a
// SLURM_STEP_NODELIST or SLURM_JOB_NODELIST in the environment, also for
// mpirun inside an allocation) the address is the first host of that list
// (rank 0 runs there under Slurm's default distributions), and the port is
// 15000 + SLURM_JOB_ID mod 10000, the same for every task of the job.
// mpirun outside Slurm sets neither: pass them with -x.
//
// Rules. The rank and size are required. The local ones are optional:
// unset, the job is taken to run on one host (localRank = rank,
// localWorldSize = worldSize). MASTER_ADDR and MASTER_PORT are optional here
// (a program may rendezvous through a store it made itself); the layer that
// needs them says so. Numbers are decimal integers with nothing around them;
// 0 <= rank < size, 0 <= local rank < local size <= size, 1 <= MASTER_PORT
// <= 65535. A variable set to the empty string counts as unset. Anything
// else throws InvalidArgumentError naming the variable and its value (the
// token's value is never shown).
//
// The launcher's store (torchrun's TORCHELASTIC_USE_AGENT_STORE, Python's
// spelling "True"/"False"; unset or empty is False, anything else an
// error): with "True" the store at MASTER_ADDR:MASTER_PORT is the agent's,
// it outlives the workers, so no rank serves one and every worker keeps
// its keys under "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>" (torch's
// prefix; the count is then required, 0..2^30), and under
// "/round_<TRELLIS_RDZV_ROUND>" below it when elastic-run sets that (a
// scale-up round does not count as a restart, and must not meet the
// previous group's keys). store/worker_store.h connects accordingly.

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
  // TORCHELASTIC_USE_AGENT_STORE=True: the launcher serves the store; no
  // rank does, and every key goes under keyPrefix (never empty then).
  bool agentStore = false;
  std::string keyPrefix;
  bool complete() const { return !addr.empty() && port != 0; }
};

struct WorkerEnv {
  int32_t rank = 0;
  int32_t worldSize = 1;
  int32_t localRank = 0;
  int32_t localWorldSize = 1;
  MasterEndpoint master;
  std::optional<auth::JobToken> jobToken;
  // Whose variables these were: "torchrun" (also elastic-run), "Open MPI"
  // or "Slurm".
  std::string launcher;

  // Reads the process environment; throws InvalidArgumentError as above.
  static WorkerEnv fromEnvironment();

  // The same over any source of variables (tests; launchers that build a
  // worker's environment). `lookup` returns nullopt for an unset variable.
  using Lookup = std::function<std::optional<std::string>(const char* name)>;
  static WorkerEnv fromVariables(const Lookup& lookup);
};

// MASTER_ADDR / MASTER_PORT only (both optional, checked as above, with
// the Slurm fallbacks).
MasterEndpoint masterFromEnvironment();
MasterEndpoint masterFromVariables(const WorkerEnv::Lookup& lookup);

}  // namespace trellis
