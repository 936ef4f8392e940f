#pragma once

// The environment elastic-run gives each worker: torchrun's variables, with
// torchrun's names and values, plus TRELLIS_JOB_TOKEN (docs/elastic.md,
// "Worker environment"). Trellis's own layers read it back through
// WorkerEnv::fromEnvironment() (core/worker_env.h).
//
// Pure functions: the agent passes what it knows (the options, the outcome
// of the rendezvous round, its own environment) and gets a map back.
// Thread safety: none needed.

#include <cstdint>
#include <optional>
#include <string>

#include <trellis/core/auth.h>
#include <trellis/elastic/options.h>

namespace trellis::elastic {

// What a rendezvous round decided for this node.
struct RendezvousOutcome {
  int32_t groupRank = 0;       // this node's rank among the nodes
  int32_t groupWorldSize = 1;  // the number of nodes in the round
  int32_t rankOffset = 0;      // the global rank of this node's local rank 0
  int32_t worldSize = 1;       // workers in the whole job
  std::string masterAddr;      // where the workers' store is served
  uint16_t masterPort = 0;
  int32_t restartCount = 0;  // group restarts so far (0 on the first run)
  std::string runId;         // --rdzv-id (or the standalone one)
  // Whether the workers use the store the agents host (torchrun's
  // TORCHELASTIC_USE_AGENT_STORE) instead of rank 0 hosting one.
  bool useAgentStore = false;
  // The rendezvous round (c10d, etcd), -1 for none; with useAgentStore it
  // becomes TRELLIS_RDZV_ROUND, part of the workers' key prefix.
  int64_t round = -1;
  // This run's log folder; a worker's error file is
  // <runLogDir>/attempt_<restartCount>/<localRank>/error.json, as torchrun.
  std::string runLogDir;
  // The job's shared secret: the agent's TRELLIS_JOB_TOKEN, else a fresh
  // one per run (jobTokenForRun). Required.
  std::optional<auth::JobToken> jobToken;
};

// The agent's TRELLIS_JOB_TOKEN when set (checked; a bad one throws
// InvalidArgumentError naming the variable), else a fresh random token.
auth::JobToken jobTokenForRun(const Environment& agentEnv);

// The full environment of local rank `localRank`: the agent's environment
// with these set on top of it:
//
//   RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE
//   ROLE_RANK ROLE_WORLD_SIZE ROLE_NAME MASTER_ADDR MASTER_PORT
//   TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS TORCHELASTIC_RUN_ID
//   TORCHELASTIC_USE_AGENT_STORE ("True"/"False") TORCHELASTIC_ERROR_FILE
//   TRELLIS_RDZV_ROUND (the round; only with TORCHELASTIC_USE_AGENT_STORE=True)
//   TORCH_NCCL_ASYNC_ERROR_HANDLING (the agent's, else "1")
//   OMP_NUM_THREADS ("1" when more than one worker per node and the agent
//                    has none; otherwise the agent's, if any)
//   TRELLIS_JOB_TOKEN
//
// Every node runs one role, so ROLE_RANK = RANK and ROLE_WORLD_SIZE =
// WORLD_SIZE. An outcome that cannot be right (a rank outside its world, no
// token, no master) is a caller bug: InvalidArgumentError naming the field.
Environment workerEnvironment(const ElasticOptions& options,
                              const RendezvousOutcome& outcome,
                              int32_t localRank, const Environment& agentEnv);

// Whether the workers use the store the agents already host
// (TORCHELASTIC_USE_AGENT_STORE=True), as torchrun's c10d backend does:
// only with --rdzv-backend c10d (not --standalone, static or etcd, whose
// agents host no store), unless the agent's TORCH_DISABLE_SHARE_RDZV_TCP_STORE
// is "1" (torchrun's opt-out) or the workers run Python (CMD is run by an
// interpreter whose name starts with "python", or ends in ".py"): PyTorch's
// TCPStore client cannot talk to a Trellis store, so there rank 0 serves
// one. `note`, when given, gets why not where that is worth a line.
bool agentStoreForWorkers(const ElasticOptions& options,
                          const Environment& agentEnv,
                          std::string* note = nullptr);

// The note to print once per run when workerEnvironment() sets
// OMP_NUM_THREADS=1 on its own; nullopt when it does not.
std::optional<std::string> ompNumThreadsWarning(const ElasticOptions& options,
                                                const Environment& agentEnv);

}  // namespace trellis::elastic
