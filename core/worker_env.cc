#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <limits>

#include <trellis/core/error.h>
#include <trellis/core/text.h>
#include <trellis/core/worker_env.h>

namespace trellis {
namespace {

// Far above any real job; keeps every rank an int32_t with room to spare.
constexpr long long kMaxWorldSize = 1 << 24;
// MASTER_PORT under srun when the job does not export one: 15000 + the job
// id mod 10000, the same on every task, below Linux's ephemeral ports.
constexpr int64_t kSlurmPortBase = 15000;
constexpr int64_t kSlurmPortSpan = 10000;

std::optional<std::string> fromProcess(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) {
    return std::nullopt;
  }
  return std::string(v);
}

std::optional<std::string> read(const WorkerEnv::Lookup& lookup,
                                const char* name) {
  auto v = lookup(name);
  if (v.has_value() && v->empty()) {
    return std::nullopt;
  }
  return v;
}

[[noreturn]] void bad(const char* name, const std::string& value,
                      const std::string& why) {
  throw InvalidArgumentError(
      Error::invalidArgument(std::string(name) + "='" + value + "' " + why));
}

// A decimal integer in [lo, hi], nothing around it.
long long parseInt(const char* name, const std::string& value, long long lo,
                   long long hi, const std::string& range) {
  const std::optional<int64_t> v = parseDecimal(value);
  if (!v) {
    bad(name, value, "is not a decimal integer");
  }
  if (*v < lo || *v > hi) {
    bad(name, value, "is out of range: " + range);
  }
  return *v;
}

// The first host of a Slurm hostlist ("node[01-04,07],gpu5" -> "node01";
// "rack[1-2]-n[3-4]" -> "rack1-n3"). Anything that is not a plain hostlist
// is refused, naming the variable.
std::string firstSlurmHost(const char* name, const std::string& list) {
  std::string host;
  size_t i = 0;
  while (i < list.size() && list[i] != ',') {
    const char c = list[i];
    if (c == '[') {
      const size_t close = list.find(']', i);
      if (close == std::string::npos) {
        bad(name, list, "is not a Slurm host list (a '[' is never closed)");
      }
      const std::string inside = list.substr(i + 1, close - i - 1);
      const std::string first = inside.substr(0, inside.find_first_of(",-"));
      if (first.empty() ||
          first.find_first_not_of("0123456789") != std::string::npos) {
        bad(name, list,
            "is not a Slurm host list (a range must start with a number)");
      }
      host += first;
      i = close + 1;
      continue;
    }
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.' &&
        c != '_') {
      bad(name, list, "is not a Slurm host list");
    }
    host += c;
    ++i;
  }
  if (host.empty()) {
    bad(name, list, "is not a Slurm host list (no first host)");
  }
  if (host.size() > 255) {
    // It becomes MASTER_ADDR, which is held to the same bound.
    bad(name, list.substr(0, 32) + "...",
        "has a first host name longer than a host name can be (255)");
  }
  return host;
}

// The tasks on node `node` from SLURM_TASKS_PER_NODE's compressed form
// ("2(x3),1": three nodes with 2 tasks, then one with 1).
int32_t slurmTasksOnNode(const char* name, const std::string& spec,
                         int64_t node) {
  int64_t seen = 0;
  size_t i = 0;
  while (i <= spec.size()) {
    const size_t comma = std::min(spec.find(',', i), spec.size());
    const std::string item = spec.substr(i, comma - i);
    const size_t paren = item.find('(');
    const std::optional<int64_t> tasks = parseDecimal(item.substr(0, paren));
    std::optional<int64_t> repeat = 1;
    if (paren != std::string::npos) {
      if (item.size() < paren + 4 || item.compare(paren, 2, "(x") != 0 ||
          item.back() != ')') {
        bad(name, spec, "is not a Slurm task count list (like '2(x3),1')");
      }
      repeat = parseDecimal(item.substr(paren + 2, item.size() - paren - 3));
    }
    if (!tasks || *tasks < 1 || *tasks > kMaxWorldSize || !repeat ||
        *repeat < 1 || *repeat > kMaxWorldSize) {
      bad(name, spec, "is not a Slurm task count list (like '2(x3),1')");
    }
    seen += *repeat;
    if (node < seen) {
      return static_cast<int32_t>(*tasks);
    }
    i = comma + 1;
  }
  bad(name, spec,
      "has no entry for this node (SLURM_NODEID " + std::to_string(node) + ")");
}

// Where each launcher puts a worker's place in the job.
struct LauncherNames {
  const char* label;
  const char* rank;
  const char* worldSize;
  const char* localRank;
  const char* localWorldSize;  // null: derived (Slurm)
};

constexpr LauncherNames kTorchrun{"torchrun", "RANK", "WORLD_SIZE",
                                  "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
constexpr LauncherNames kOpenMpi{
    "Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};
constexpr LauncherNames kSlurm{"Slurm", "SLURM_PROCID", "SLURM_NTASKS",
                               "SLURM_LOCALID", nullptr};

}  // namespace

MasterEndpoint masterFromVariables(const WorkerEnv::Lookup& lookup) {
  MasterEndpoint m;
  if (auto addr = read(lookup, "MASTER_ADDR")) {
    // A host name or an address literal; the resolver has the last word,
    // this only keeps obvious garbage out of error messages and logs.
    if (addr->size() > 255) {
      bad("MASTER_ADDR", addr->substr(0, 32) + "...",
          "is longer than a host name can be (255)");
    }
    for (const char c : *addr) {
      if (static_cast<unsigned char>(c) <= 0x20 ||
          static_cast<unsigned char>(c) >= 0x7f) {
        bad("MASTER_ADDR", *addr,
            "is not a host name or address (it has a space or a control "
            "character)");
      }
    }
    m.addr = *addr;
  }
  if (auto port = read(lookup, "MASTER_PORT")) {
    m.port = static_cast<uint16_t>(
        parseInt("MASTER_PORT", *port, 1, 65535, "a port is 1-65535"));
  }
  if (auto use = read(lookup, "TORCHELASTIC_USE_AGENT_STORE")) {
    if (*use != "True" && *use != "False") {
      bad("TORCHELASTIC_USE_AGENT_STORE", *use,
          "is neither 'True' nor 'False' (Python's spelling, as torchrun and "
          "elastic-run write it)");
    }
    m.agentStore = *use == "True";
  }
  if (m.agentStore) {
    const auto count = read(lookup, "TORCHELASTIC_RESTART_COUNT");
    if (!count) {
      throw InvalidArgumentError(Error::invalidArgument(
          "TORCHELASTIC_USE_AGENT_STORE=True but TORCHELASTIC_RESTART_COUNT "
          "is not set: the workers' keys in the launcher's store go under "
          "/worker/attempt_<count>"));
    }
    m.keyPrefix = "/worker/attempt_" +
                  std::to_string(parseInt("TORCHELASTIC_RESTART_COUNT", *count,
                                          0, 1 << 30, "0-2^30"));
    if (auto round = read(lookup, "TRELLIS_RDZV_ROUND")) {
      m.keyPrefix +=
          "/round_" + std::to_string(parseInt("TRELLIS_RDZV_ROUND", *round, 0,
                                              int64_t{1} << 62, "0-2^62"));
    }
  }
  // Under srun nothing sets them: the first host of the step (or job) and
  // a port every task of the job derives alike.
  if (m.addr.empty()) {
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"}) {
      if (auto list = read(lookup, name)) {
        m.addr = firstSlurmHost(name, *list);
        break;
      }
    }
  }
  if (m.port == 0) {
    if (auto job = read(lookup, "SLURM_JOB_ID")) {
      const auto id =
          parseInt("SLURM_JOB_ID", *job, 0, std::numeric_limits<int64_t>::max(),
                   "a job id is a non-negative integer");
      m.port = static_cast<uint16_t>(kSlurmPortBase + id % kSlurmPortSpan);
    }
  }
  return m;
}

MasterEndpoint masterFromEnvironment() {
  return masterFromVariables(&fromProcess);
}

WorkerEnv WorkerEnv::fromVariables(const Lookup& lookup) {
  // The first launcher whose variables are there: elastic-run and torchrun
  // (also when started under srun or mpirun), then mpirun (whose processes
  // inherit the batch step's SLURM_PROCID, 0 for all of them), then srun.
  const LauncherNames* names = nullptr;
  for (const LauncherNames* l : {&kTorchrun, &kOpenMpi, &kSlurm}) {
    if (read(lookup, l->rank) || read(lookup, l->worldSize)) {
      names = l;
      break;
    }
  }
  if (names == nullptr) {
    throw InvalidArgumentError(Error::invalidArgument(
        "RANK is not set: start the workers with a launcher (elastic-run, "
        "torchrun, srun, mpirun), or set RANK and WORLD_SIZE"));
  }
  auto required = [&](const char* name) {
    auto v = read(lookup, name);
    if (!v.has_value()) {
      throw InvalidArgumentError(Error::invalidArgument(
          std::string(name) + " is not set (the worker's other " +
          names->label + " variables are): start the workers with " +
          (names == &kTorchrun ? std::string("a launcher that sets RANK and "
                                             "WORLD_SIZE (elastic-run, "
                                             "torchrun), or set them")
                               : std::string("the launcher that sets it"))));
    }
    return *v;
  };
  WorkerEnv env;
  env.launcher = names->label;
  const std::string world = required(names->worldSize);
  env.worldSize =
      static_cast<int32_t>(parseInt(names->worldSize, world, 1, kMaxWorldSize,
                                    "1-" + std::to_string(kMaxWorldSize)));
  const std::string rank = required(names->rank);
  env.rank =
      static_cast<int32_t>(parseInt(names->rank, rank, 0, env.worldSize - 1,
                                    std::string("0 <= ") + names->rank + " < " +
                                        names->worldSize + " (" + world + ")"));
  env.localWorldSize = env.worldSize;
  if (names->localWorldSize != nullptr) {
    if (auto v = read(lookup, names->localWorldSize)) {
      env.localWorldSize = static_cast<int32_t>(
          parseInt(names->localWorldSize, *v, 1, env.worldSize,
                   std::string("1 <= ") + names->localWorldSize +
                       " <= " + names->worldSize + " (" + world + ")"));
    }
  } else {
    // srun: the tasks on this node, from the step's (else the job's)
    // per-node counts; unset, the job is taken to run on one host.
    const char* which = read(lookup, "SLURM_STEP_TASKS_PER_NODE")
                            ? "SLURM_STEP_TASKS_PER_NODE"
                            : "SLURM_TASKS_PER_NODE";
    if (auto spec = read(lookup, which)) {
      const auto node = parseInt("SLURM_NODEID", required("SLURM_NODEID"), 0,
                                 kMaxWorldSize - 1, "0 <= SLURM_NODEID");
      env.localWorldSize =
          std::min(slurmTasksOnNode(which, *spec, node), env.worldSize);
    }
  }
  env.localRank = env.rank;
  if (auto v = read(lookup, names->localRank)) {
    env.localRank = static_cast<int32_t>(
        parseInt(names->localRank, *v, 0, env.localWorldSize - 1,
                 std::string("0 <= ") + names->localRank + " < " +
                     (names->localWorldSize != nullptr
                          ? std::string(names->localWorldSize)
                          : std::string("the tasks on this node")) +
                     " (" + std::to_string(env.localWorldSize) + ")"));
  } else if (env.localRank >= env.localWorldSize) {
    throw InvalidArgumentError(Error::invalidArgument(
        std::string(names->localRank) + " is not set and " + names->rank +
        " (" + rank + ") is not below the workers on this host (" +
        std::to_string(env.localWorldSize) + "): set " + names->localRank +
        " for a job on several hosts"));
  }
  env.master = masterFromVariables(lookup);
  if (auto token = read(lookup, auth::kTokenEnvVar)) {
    try {
      env.jobToken = auth::JobToken::fromString(*token);
    } catch (const InvalidArgumentError& e) {
      throw InvalidArgumentError(e.error().withContext(auth::kTokenEnvVar));
    }
  }
  return env;
}

WorkerEnv WorkerEnv::fromEnvironment() { return fromVariables(&fromProcess); }

}  // namespace trellis
