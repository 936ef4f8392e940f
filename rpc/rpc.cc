// The calling thread's agent, the process agent of rpc::init(), and the
// free functions of rpc.h (docs/rpc.md, "Starting and stopping").

#include <cstdlib>
#include <mutex>

#include <trellis/core/logging.h>
#include <trellis/core/mutex.h>
#include <trellis/rpc/agent.h>
#include <trellis/rpc/rpc.h>

namespace trellis::rpc {

namespace {

thread_local Agent* tCurrentAgent = nullptr;
// Guards gProcessAgent.
Mutex gProcessMu;
std::shared_ptr<Agent> gProcessAgent TRELLIS_GUARDED_BY(gProcessMu);

}  // namespace

// ---- CurrentAgentScope / current -------------------------------------------

CurrentAgentScope::CurrentAgentScope(Agent* agent) : previous_(tCurrentAgent) {
  tCurrentAgent = agent;
}
CurrentAgentScope::~CurrentAgentScope() { tCurrentAgent = previous_; }

Agent& Agent::current() {
  if (tCurrentAgent != nullptr) {
    return *tCurrentAgent;
  }
  return *currentShared();
}

std::shared_ptr<Agent> Agent::currentShared() {
  if (tCurrentAgent != nullptr) {
    auto agent = tCurrentAgent->weak_from_this().lock();
    if (agent == nullptr) {
      // A callback running while the agent is torn down.
      throwError(Error::cancelled("rpc agent '" + tCurrentAgent->self().name +
                                  "' is shutting down"));
    }
    return agent;
  }
  MutexLock lock(gProcessMu);
  if (gProcessAgent == nullptr) {
    throwError(Error(Code::kFailedPrecondition,
                     "no RPC agent: call trellis::rpc::init() first"));
  }
  return gProcessAgent;
}

void Agent::setProcessAgent(std::shared_ptr<Agent> agent) {
  MutexLock lock(gProcessMu);
  gProcessAgent = std::move(agent);
}

// ---- free functions --------------------------------------------------------

int32_t Callee::resolve(const Agent& agent) const {
  if (!name.empty()) {
    return agent.workerInfo(name).rank;
  }
  return agent.workerInfo(rank).rank;
}

namespace {

// A process that ends without rpc::shutdown() (an exception out of main, a
// return) closes its process agent here, at exit, at once.
// Registered after the agent started, so it runs before the exit handlers
// of the libraries the agent initialised (OpenSSL's among them) and before
// static destruction: the agent's threads never run against torn-down
// libraries.
void closeProcessAgentAtExit() {
  std::shared_ptr<Agent> agent;
  {
    MutexLock lock(gProcessMu);
    agent = std::move(gProcessAgent);
  }
  if (agent == nullptr) {
    return;
  }
  try {
    agent->shutdown({.graceful = false});
  } catch (const std::exception& e) {
    // exit() called on one of the agent's threads: the teardown moves to
    // its own thread when the reference goes below.
    TRELLIS_LOG_DEBUG("rpc agent {}: not closed at exit: {}",
                      agent->self().name, e.what());
  }
}

}  // namespace

void init(const std::string& name, int32_t rank, int32_t worldSize,
          RpcOptions options) {
  {
    MutexLock lock(gProcessMu);
    if (gProcessAgent != nullptr) {
      throwError(Error(Code::kFailedPrecondition,
                       "rpc::init: this process already runs agent '" +
                           gProcessAgent->self().name + "'"));
    }
  }
  Agent::setProcessAgent(
      Agent::start(name, rank, worldSize, std::move(options)));
  static std::once_flag atExit;
  std::call_once(atExit, [] { std::atexit(&closeProcessAgentAtExit); });
}

void shutdown(ShutdownOptions options) {
  std::shared_ptr<Agent> agent;
  {
    MutexLock lock(gProcessMu);
    agent = gProcessAgent;
  }
  if (agent == nullptr) {
    return;
  }
  try {
    agent->shutdown(options);
  } catch (...) {
    // A failed graceful shutdown has closed the agent; a refused call (a
    // bad option, the agent's own thread) has changed nothing.
    if (agent->isShutDown()) {
      Agent::setProcessAgent(nullptr);
    }
    throw;
  }
  Agent::setProcessAgent(nullptr);
}

WorkerInfo getWorkerInfo() { return Agent::current().self(); }
WorkerInfo getWorkerInfo(const std::string& name) {
  return Agent::current().workerInfo(name);
}
WorkerInfo getWorkerInfo(int32_t rank) {
  return Agent::current().workerInfo(rank);
}
std::vector<WorkerInfo> getWorkerInfos() {
  return Agent::current().workerInfos();
}

}  // namespace trellis::rpc
