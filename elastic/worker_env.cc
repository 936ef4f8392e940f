#include <string_view>

#include <trellis/core/error.h>
#include <trellis/elastic/worker_env.h>

namespace trellis::elastic {

namespace {

[[noreturn]] void misuse(std::string_view what) {
  throw InvalidArgumentError(
      Error::invalidArgument("workerEnvironment: " + std::string(what)));
}

bool hasValue(const Environment& env, const char* name) {
  const auto it = env.find(name);
  return it != env.end() && !it->second.empty();
}

}  // namespace

auth::JobToken jobTokenForRun(const Environment& agentEnv) {
  const auto it = agentEnv.find(auth::kTokenEnvVar);
  if (it == agentEnv.end() || it->second.empty()) {
    return auth::JobToken::generate();
  }
  try {
    return auth::JobToken::fromString(it->second);
  } catch (const InvalidArgumentError& e) {
    // fromString never shows the token; name where it came from.
    throw InvalidArgumentError(
        e.error().withContext(std::string(auth::kTokenEnvVar)));
  }
}

std::optional<std::string> ompNumThreadsWarning(const ElasticOptions& options,
                                                const Environment& agentEnv) {
  if (options.nprocPerNode <= 1 || agentEnv.count("OMP_NUM_THREADS") != 0) {
    return std::nullopt;
  }
  return "elastic-run: each worker gets OMP_NUM_THREADS=1 because " +
         std::to_string(options.nprocPerNode) +
         " workers share this node and OMP_NUM_THREADS is not set; set it "
         "yourself to give each worker more threads.";
}

Environment workerEnvironment(const ElasticOptions& options,
                              const RendezvousOutcome& outcome,
                              int32_t localRank, const Environment& agentEnv) {
  const int32_t nproc = options.nprocPerNode;
  if (nproc < 1) {
    misuse("nprocPerNode must be at least 1");
  }
  if (localRank < 0 || localRank >= nproc) {
    misuse("localRank " + std::to_string(localRank) + " is outside [0, " +
           std::to_string(nproc) + ")");
  }
  if (outcome.groupWorldSize < 1 || outcome.groupRank < 0 ||
      outcome.groupRank >= outcome.groupWorldSize) {
    misuse("groupRank " + std::to_string(outcome.groupRank) +
           " is outside [0, groupWorldSize " +
           std::to_string(outcome.groupWorldSize) + ")");
  }
  if (outcome.rankOffset < 0 ||
      int64_t{outcome.rankOffset} + nproc > outcome.worldSize) {
    misuse("rankOffset " + std::to_string(outcome.rankOffset) + " + " +
           std::to_string(nproc) + " workers exceeds worldSize " +
           std::to_string(outcome.worldSize));
  }
  if (outcome.masterAddr.empty() || outcome.masterPort == 0) {
    misuse("masterAddr and masterPort are required");
  }
  if (outcome.restartCount < 0) {
    misuse("restartCount must not be negative");
  }
  if (outcome.runId.empty() || outcome.runLogDir.empty()) {
    misuse("runId and runLogDir are required");
  }
  if (!outcome.jobToken) {
    misuse("jobToken is required");
  }

  Environment env = agentEnv;
  const std::string rank = std::to_string(outcome.rankOffset + localRank);
  const std::string world = std::to_string(outcome.worldSize);
  env["RANK"] = rank;
  env["LOCAL_RANK"] = std::to_string(localRank);
  env["WORLD_SIZE"] = world;
  env["LOCAL_WORLD_SIZE"] = std::to_string(nproc);
  env["GROUP_RANK"] = std::to_string(outcome.groupRank);
  env["GROUP_WORLD_SIZE"] = std::to_string(outcome.groupWorldSize);
  env["ROLE_RANK"] = rank;
  env["ROLE_WORLD_SIZE"] = world;
  env["ROLE_NAME"] = options.role;
  env["MASTER_ADDR"] = outcome.masterAddr;
  env["MASTER_PORT"] = std::to_string(outcome.masterPort);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(outcome.restartCount);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(options.maxRestarts);
  env["TORCHELASTIC_RUN_ID"] = outcome.runId;
  // Python's str(bool), which is what torchrun writes.
  env["TORCHELASTIC_USE_AGENT_STORE"] =
      outcome.useAgentStore ? "True" : "False";
  // The workers' key prefix in the agents' store takes the round too: a
  // scale-up round keeps TORCHELASTIC_RESTART_COUNT (core/worker_env.h).
  if (outcome.useAgentStore && outcome.round >= 0) {
    env["TRELLIS_RDZV_ROUND"] = std::to_string(outcome.round);
  } else {
    env.erase("TRELLIS_RDZV_ROUND");
  }
  env["TORCHELASTIC_ERROR_FILE"] = outcome.runLogDir + "/attempt_" +
                                   std::to_string(outcome.restartCount) + "/" +
                                   std::to_string(localRank) + "/error.json";
  if (!hasValue(agentEnv, "TORCH_NCCL_ASYNC_ERROR_HANDLING")) {
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1";
  }
  if (ompNumThreadsWarning(options, agentEnv)) {
    env["OMP_NUM_THREADS"] = "1";
  }
  env[auth::kTokenEnvVar] = outcome.jobToken->secret();
  return env;
}

bool agentStoreForWorkers(const ElasticOptions& options,
                          const Environment& agentEnv, std::string* note) {
  if (options.rdzvBackend != RdzvBackend::kC10d || options.standalone) {
    return false;
  }
  auto say = [&](std::string why) {
    if (note != nullptr) {
      *note = std::move(why);
    }
    return false;
  };
  if (const auto it = agentEnv.find("TORCH_DISABLE_SHARE_RDZV_TCP_STORE");
      it != agentEnv.end() && it->second == "1") {
    return say(
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the workers' rank 0 serves "
        "their store (TORCHELASTIC_USE_AGENT_STORE=False)");
  }
  auto pythonish = [](const std::string& arg) {
    const std::string base = arg.substr(arg.rfind('/') + 1);
    return base.rfind("python", 0) == 0 ||
           (base.size() > 3 && base.compare(base.size() - 3, 3, ".py") == 0);
  };
  if (!options.workerArgv.empty() && pythonish(options.workerArgv.front())) {
    return say("the workers run Python ('" + options.workerArgv.front() +
               "'), whose TCPStore cannot talk to elastic-run's store: their "
               "rank 0 serves one (TORCHELASTIC_USE_AGENT_STORE=False)");
  }
  return true;
}

}  // namespace trellis::elastic
