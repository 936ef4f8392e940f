#include <algorithm>
#include <cstdio>
#include <exception>
#include <map>
#include <set>
#include <string>
#include <utility>

#include <trellis/core/error.h>
#include <trellis/core/text.h>
#include <trellis/elastic/errors.h>
#include <trellis/job/job.h>
#include <trellis/rpc/rpc.h>
#include <trellis/store/prefix_store.h>
#include <trellis/store/tcp_store.h>
#include <trellis/store/worker_store.h>

namespace trellis {

namespace {

using Ms = std::chrono::milliseconds;

// Store keys of start-up and the exit barrier, beside the layers' own
// prefixes ("rpc/", "group/", "user/").
constexpr const char* kPlanKey = "trellis/init/";
constexpr const char* kExitKey = "trellis/exit/";

Ms toMs(Duration d) { return std::max(Ms(1), std::chrono::ceil<Ms>(d)); }

std::string rankList(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    s += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  }
  return s + "]";
}

// One key per rank: prefix + rank.
std::vector<std::string> rankKeys(const char* prefix, int32_t worldSize) {
  std::vector<std::string> keys;
  for (int32_t r = 0; r < worldSize; ++r) {
    keys.push_back(prefix + std::to_string(r));
  }
  return keys;
}

// The ranks whose key is not in the store yet.
std::vector<int> missingRanks(store::Store& store,
                              const std::vector<std::string>& keys) {
  std::vector<int> missing;
  for (size_t r = 0; r < keys.size(); ++r) {
    if (!store.check({keys[r]})) {
      missing.push_back(static_cast<int>(r));
    }
  }
  return missing;
}

[[noreturn]] void invalid(const std::string& what) {
  throw InvalidArgumentError(Error::invalidArgument("trellis::init: " + what));
}

// The ranks of the default group, checked against the job's size.
std::vector<int> groupMembers(const InitOptions& o, int32_t worldSize) {
  if (!o.processGroup) {
    if (!o.groupRanks.empty()) {
      invalid("InitOptions::groupRanks is set but processGroup is false");
    }
    return {};
  }
  if (o.groupRanks.empty()) {
    std::vector<int> all(static_cast<size_t>(worldSize));
    for (int32_t r = 0; r < worldSize; ++r) {
      all[static_cast<size_t>(r)] = r;
    }
    return all;
  }
  std::set<int> seen;
  for (int r : o.groupRanks) {
    if (r < 0 || r >= worldSize) {
      invalid("InitOptions::groupRanks holds rank " + std::to_string(r) +
              ", outside the job's ranks 0.." + std::to_string(worldSize - 1) +
              " (WORLD_SIZE " + std::to_string(worldSize) + ")");
    }
    if (!seen.insert(r).second) {
      invalid("InitOptions::groupRanks holds rank " + std::to_string(r) +
              " twice");
    }
  }
  return o.groupRanks;
}

// What a rank announces of its start-up, so that ranks that disagree are
// named before anyone waits on them.
struct Plan {
  std::string rpcName;  // empty: no RPC
  std::string group;    // "none" or "<backend> over [ranks]"

  std::string encode() const { return rpcName + '\n' + group; }
  static Plan decode(const std::string& text) {
    Plan p;
    const auto nl = text.find('\n');
    p.rpcName = text.substr(0, nl);
    p.group = nl == std::string::npos ? "?" : text.substr(nl + 1);
    return p;
  }
  std::string describe() const {
    return (rpcName.empty() ? "no RPC" : "RPC as '" + rpcName + "'") +
           ", process group: " + group;
  }
};

// Publishes this rank's plan, waits for every rank's and checks they fit
// together; throws naming the ranks that did not come or that differ.
void agreeOnPlans(store::Store& store, const WorkerEnv& env, const Plan& mine,
                  Duration bound) {
  store.set(kPlanKey + std::to_string(env.rank), mine.encode());
  const std::vector<std::string> keys = rankKeys(kPlanKey, env.worldSize);
  try {
    store.wait(keys, toMs(bound));
  } catch (const TimeoutError&) {
    const std::vector<int> missing = missingRanks(store, keys);
    throw TimeoutError(Error::timeout(
        "trellis::init: rank" + std::string(missing.size() == 1 ? " " : "s ") +
        rankList(missing) + " of " + std::to_string(env.worldSize) +
        " did not reach init within " + formatDuration(bound) +
        " (InitOptions::initTimeout): they are slow to start, stuck before "
        "init, or were not started (WORLD_SIZE " +
        std::to_string(env.worldSize) + " counts them)"));
  }
  std::vector<Plan> plans;
  for (const auto& value : store.multiGet(keys)) {
    plans.push_back(Plan::decode(std::string(value.begin(), value.end())));
  }
  std::map<std::string, int> names;
  for (int32_t r = 0; r < env.worldSize; ++r) {
    const Plan& p = plans[static_cast<size_t>(r)];
    const Plan& first = plans[0];
    if (p.rpcName.empty() != first.rpcName.empty() || p.group != first.group) {
      throw FailedPreconditionError(Error(
          Code::kFailedPrecondition,
          "trellis::init: the ranks start differently: rank 0 starts " +
              first.describe() + "; rank " + std::to_string(r) + " starts " +
              p.describe() +
              ". Every rank must pass InitOptions::rpcName (set on all or "
              "on none), groupRanks and backend alike"));
    }
    if (!p.rpcName.empty()) {
      const auto [it, fresh] = names.emplace(p.rpcName, r);
      if (!fresh) {
        throw FailedPreconditionError(Error(
            Code::kFailedPrecondition,
            "trellis::init: ranks " + std::to_string(it->second) + " and " +
                std::to_string(r) + " both take the RPC name '" + p.rpcName +
                "' (InitOptions::rpcName must differ between ranks)"));
      }
    }
  }
}

}  // namespace

Job init(InitOptions o) {
  elastic::installErrorFileHandler();
  Job job;
  job.env_ = WorkerEnv::fromEnvironment();
  const WorkerEnv& env = job.env_;
  if (o.worldSize && *o.worldSize != env.worldSize) {
    invalid("the program expects " + std::to_string(*o.worldSize) +
            " processes (InitOptions::worldSize) but the launcher started " +
            std::to_string(env.worldSize) + " (" + env.launcher +
            "'s world size); start as many as it expects (elastic-run "
            "--nproc-per-node, --nnodes) or leave worldSize unset");
  }
  if (!env.master.complete()) {
    invalid(
        "MASTER_ADDR and MASTER_PORT are not both set: start the program "
        "with elastic-run (or torchrun, srun, mpirun -x), which set them");
  }
  for (const auto* d : {&o.timeout, &o.initTimeout, &o.exitTimeout}) {
    if (d->has_value() && **d <= Duration::zero()) {
      invalid("InitOptions timeouts must be positive (got " +
              formatDuration(**d) + ")");
    }
  }
  const Duration initTimeout = o.initTimeout.value_or(kDefaultInitTimeout);
  job.exitTimeout_ = o.exitTimeout.value_or(kDefaultExitTimeout);
  const std::vector<int> members = groupMembers(o, env.worldSize);

  store::WorkerStoreOptions so;
  so.jobToken = env.jobToken;
  so.timeout = toMs(initTimeout);
  so.connectTimeout = so.timeout;
  store::WorkerStore ws = store::connectWorkerStore(env.master, env.rank, so);
  job.server_ = ws.server;
  job.store_ = ws.store;
  job.userStore_ = std::make_shared<store::PrefixStore>("user/", job.store_);

  Plan plan;
  plan.rpcName = o.rpcName;
  plan.group = members.empty() ? "none"
                               : o.backend + " over " +
                                     (o.groupRanks.empty() ? "every rank"
                                                           : rankList(members));
  agreeOnPlans(*job.store_, env, plan, initTimeout);

  if (!o.rpcName.empty()) {
    rpc::RpcOptions r = o.rpc;
    r.store = std::make_shared<store::PrefixStore>("rpc/", job.store_);
    r.initTimeout = initTimeout;
    if (o.timeout) {
      r.defaultTimeout = *o.timeout;
      r.shutdownDrainTimeout = *o.timeout;
    }
    if (!r.token) {
      r.token = env.jobToken;
    }
    rpc::init(o.rpcName, env.rank, env.worldSize, r);
    job.rpcStarted_ = true;
  }

  const auto me = std::find(members.begin(), members.end(), env.rank);
  if (me != members.end()) {
    collectives::ProcessGroupOptions g = o.group;
    if (!g.timeout) {
      g.timeout = o.timeout;
    }
    if (!g.initTimeout) {
      g.initTimeout = initTimeout;
    }
    if (!g.token) {
      g.token = env.jobToken;
    }
    if (g.name.empty()) {
      g.name = "default";
    }
    job.group_ = collectives::ProcessGroup::create(
        o.backend, std::make_shared<store::PrefixStore>("group/", job.store_),
        static_cast<int>(me - members.begin()),
        static_cast<int>(members.size()), g);
  }
  job.groupRanks_ = members;
  return job;
}

Job::Job(Job&& other) noexcept
    : env_(std::move(other.env_)),
      exitTimeout_(other.exitTimeout_),
      server_(std::move(other.server_)),
      store_(std::move(other.store_)),
      userStore_(std::move(other.userStore_)),
      group_(std::move(other.group_)),
      groupRanks_(std::move(other.groupRanks_)),
      rpcStarted_(other.rpcStarted_),
      moved_(other.moved_),
      result_(other.result_) {
  other.moved_ = true;
}

Job::~Job() {
  if (moved_ || result_) {
    return;
  }
  const bool unwinding = std::uncaught_exceptions() > 0;
  try {
    stop(unwinding ? 1 : 0, !unwinding);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trellis::Job: rank %d: %s\n", env_.rank, e.what());
  }
}

const std::shared_ptr<collectives::ProcessGroup>& Job::group() const {
  if (group_ == nullptr) {
    throw FailedPreconditionError(Error(
        Code::kFailedPrecondition,
        "trellis::Job::group(): rank " + std::to_string(env_.rank) +
            (groupRanks_.empty()
                 ? " has no process group (InitOptions::processGroup is false)"
                 : " is not in the default group (InitOptions::groupRanks " +
                       rankList(groupRanks_) + ")")));
  }
  return group_;
}

int Job::shutdown(int exitCode) {
  if (result_) {
    return *result_;
  }
  stop(exitCode, true);
  return *result_;
}

void Job::stop(int exitCode, bool graceful) {
  // Set first: whatever fails below, a second call does not start over.
  result_ = exitCode;
  std::exception_ptr failure;
  if (rpcStarted_) {
    rpcStarted_ = false;
    try {
      rpc::ShutdownOptions so;
      so.graceful = graceful;
      rpc::shutdown(so);
    } catch (...) {
      failure = std::current_exception();
      exitCode = exitCode == 0 ? 1 : exitCode;
    }
  }
  group_.reset();
  userStore_.reset();
  if (store_ != nullptr) {
    try {
      // After a failed RPC shutdown (a peer gone) rank 0 does not wait
      // for ranks that may never come.
      exitCode = exitBarrier(exitCode, graceful && failure == nullptr);
    } catch (...) {
      if (failure == nullptr) {
        failure = std::current_exception();
      }
    }
  }
  result_ = exitCode;
  store_.reset();
  server_.reset();
  if (failure != nullptr) {
    std::rethrow_exception(failure);
  }
}

int Job::exitBarrier(int exitCode, bool wait) {
  store_->set(kExitKey + std::to_string(env_.rank), std::to_string(exitCode));
  if (env_.rank != 0 || !wait) {
    return exitCode;
  }
  const std::vector<std::string> keys = rankKeys(kExitKey, env_.worldSize);
  try {
    store_->wait(keys, toMs(exitTimeout_));
  } catch (const TimeoutError&) {
    throw TimeoutError(
        Error::timeout("trellis::Job::shutdown: rank 0 waited " +
                       formatDuration(exitTimeout_) +
                       " (InitOptions::exitTimeout) for ranks " +
                       rankList(missingRanks(*store_, keys)) +
                       " to finish; it stops serving the job's store now"));
  }
  for (const auto& v : store_->multiGet(keys)) {
    const std::string code(v.begin(), v.end());
    if (code != "0" && exitCode == 0) {
      const auto n = parseDecimal(code);
      exitCode = n && *n > 0 && *n < 256 ? static_cast<int>(*n) : 1;
    }
  }
  return exitCode;
}

}  // namespace trellis
