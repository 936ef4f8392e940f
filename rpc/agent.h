#pragma once

// Agent: one worker's end of the RPC layer (docs/rpc.md).
//
// An Agent owns a transport Context with a listener, a thread pool for user
// functions, a small pool for completing callers' futures, and a timer for
// per-call deadlines. Workers find each other through a Store (rendezvous
// at start()); pipes to peers are opened lazily, on the first call.
//
// Contract
//  - start() returns once every worker of the group has published its
//    address (or throws TimeoutError naming the ranks still missing).
//  - Every method is thread-safe. User functions run on the agent's worker
//    threads, never on the transport loop; callers' futures complete on the
//    completion threads (do not block inside then() callbacks).
//  - A call fails locally with TimeoutError naming callee and function once
//    its timeout passes; a late reply is dropped. A dead or unreachable peer
//    fails the calls to it with ConnectionError naming it; calls to other
//    workers go on. Malformed messages are a ProtocolError that closes that
//    pipe only.
//  - shutdown() (graceful) waits, together with every other worker, until
//    no call or RRef message is in flight anywhere, then closes; a clean
//    shutdown logs nothing above info. shutdown({.graceful = false}) closes
//    at once and fails what is pending with CANCELLED. Both are idempotent;
//    the destructor closes at once. Called from one of the agent's own
//    threads (a user function, a future callback) shutdown throws
//    FailedPreconditionError: it would wait for itself. A refused call (that
//    one, or a negative timeout) changes nothing.
//  - Lifetime: futures and pending calls do not keep the agent alive; it
//    lives while a user holds it (rpc::init's process agent, a
//    shared_ptr). The last reference may be dropped on any thread; where
//    that is one of the agent's own, the teardown runs on another thread.
//  - Agent::current() is the agent of the calling thread: the one whose
//    user function or completion it is running, else the process agent set
//    by rpc::init(). Several agents may live in one process (tests).

#include <ATen/core/Tensor.h>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

#include <trellis/core/auth.h>
#include <trellis/core/deadline.h>
#include <trellis/core/error.h>
#include <trellis/core/future.h>
#include <trellis/rpc/autograd_hooks.h>
#include <trellis/rpc/codec.h>
#include <trellis/rpc/detail/call.h>
#include <trellis/rpc/registry.h>

namespace trellis::store {
class Store;
}

namespace trellis::rpc {

struct WorkerInfo {
  std::string name;
  int32_t rank = -1;
  std::string address;  // transport address ("uv://10.0.0.3:41234")
  // The most bytes of one argument or result encoding it accepts (its
  // RpcOptions::maxMessageBytes, published at the rendezvous).
  size_t maxMessageBytes = 0;
};

struct RpcOptions {
  // Threads that run user functions. Async user functions hold none while
  // they wait.
  size_t numWorkerThreads = 4;
  // Threads that complete callers' futures (decode replies, run then()).
  size_t numCompletionThreads = 2;
  // Default per-call timeout; 0 = none.
  Duration defaultTimeout = std::chrono::seconds(60);
  // Rendezvous: how long start() waits for the other workers.
  Duration initTimeout = std::chrono::seconds(120);
  // Graceful shutdown's default bounds (ShutdownOptions says what each
  // bounds; there, unset means these).
  Duration shutdownDrainTimeout = std::chrono::seconds(60);
  Duration shutdownArrivalTimeout = Duration::zero();
  // Rendezvous store. When null, MASTER_ADDR / MASTER_PORT are read (like
  // torch's env://): rank 0 serves a TCPStore there, every rank connects.
  std::shared_ptr<store::Store> store;
  // Address to listen on and advertise (an IP literal). Empty: see
  // core/net.h (TRELLIS_LOCAL_ADDR, TRELLIS_IFNAME, route to MASTER_ADDR).
  std::string localAddress;
  // Restrict transports / channels (names as in transport/context.h).
  std::vector<std::string> transports;
  std::vector<std::string> channels;
  // Job token for pipes and the store; unset = TRELLIS_JOB_TOKEN if set.
  std::optional<auth::JobToken> token;
  // Bytes of one argument or result encoding a peer may make us allocate.
  // Published to the group: a caller fails a call whose arguments encode
  // to more (RESOURCE_EXHAUSTED, nothing sent), and a callee whose result
  // does answers with that error instead; the pipe and every other call
  // on it go on. Tensors travel beside the encoding and do not count.
  size_t maxMessageBytes = size_t{4} << 30;
};

// How Agent::shutdown / rpc::shutdown end a worker's part in the group.
// Timeouts: unset = the RpcOptions default named, zero = no limit.
struct ShutdownOptions {
  // true: wait, together with every other worker, until no call or RRef
  // message is in flight anywhere, then close. false: close at once; what
  // is pending fails with CANCELLED.
  bool graceful = true;
  // Graceful only. How long to wait for the other workers to enter
  // shutdown (RpcOptions::shutdownArrivalTimeout, no limit by default,
  // like torch: a server typically calls shutdown() right after init() and
  // waits there for its trainers). A worker that is gone (refuses the
  // shutdown's liveness probe, or does not answer it within the drain
  // timeout) fails the wait at once, named in the error, whatever this is.
  std::optional<Duration> arrivalTimeout = std::nullopt;
  // Graceful only. Once every worker has entered shutdown, how long the
  // group may take to finish what is in flight and close
  // (RpcOptions::shutdownDrainTimeout, 60 s). Neither bound limits the
  // training before shutdown() is called.
  std::optional<Duration> drainTimeout = std::nullopt;
};

namespace detail {
class AgentExtension;
}

class Agent : public std::enable_shared_from_this<Agent> {
 public:
  // Throws InvalidArgumentError for a bad name/rank/worldSize/option,
  // TimeoutError when the other workers do not appear within initTimeout,
  // AlreadyExistsError when another rank uses the same name.
  static std::shared_ptr<Agent> start(const std::string& name, int32_t rank,
                                      int32_t worldSize,
                                      RpcOptions options = {});
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // The calling thread's agent (see above); throws FailedPreconditionError
  // when there is none.
  static Agent& current();
  static std::shared_ptr<Agent> currentShared();
  // rpc::init() sets the process agent; null to clear.
  static void setProcessAgent(std::shared_ptr<Agent> agent);
  // Waits until every agent whose last reference dropped on one of its own
  // threads (its teardown then runs on another thread, see Lifetime above)
  // has finished tearing down; false when some had not within `timeout`.
  // For a program (or test) about to exit that let go of an agent that way.
  static bool awaitDeferredTeardowns(Duration timeout);

  const WorkerInfo& self() const;
  int32_t worldSize() const;
  // Throws NotFoundError naming the worker.
  const WorkerInfo& workerInfo(const std::string& name) const;
  const WorkerInfo& workerInfo(int32_t rank) const;
  std::vector<WorkerInfo> workerInfos() const;
  const RpcOptions& options() const;

  // Sends one request; the future carries the reply or the call's error.
  // `context` (from codecContext(to), used to encode `args`) lives until
  // the request is written. Internal: the templates of rpc.h and rref.h,
  // and the layers above, call it.
  Future<detail::Reply> call(int32_t to, const detail::CallSpec& spec,
                             Encoder&& args,
                             std::shared_ptr<CodecContext> context = nullptr);
  // Per-peer context for encoding arguments and decoding results (RRef
  // forks need it; one per peer, kept by the extension); null when no
  // extension supplies one.
  std::shared_ptr<CodecContext> codecContext(int32_t peer);
  // The receiver for a reply's tensors that require grad (null when the
  // reply carries no autograd message). Throws when the reply's context
  // was released here.
  std::unique_ptr<GradReceiver> gradReceiver(const detail::Reply& reply);

  // For the layers above (dist_autograd/): runs `task` on one of this
  // agent's worker threads, with an OK error; when the pool is closed it
  // runs it at once with CANCELLED instead, on the calling thread.
  void runOnWorkerThread(std::function<void(const Error&)> task);
  // True on this agent's transport loop thread, where nothing may block
  // or run long.
  bool onLoopThread() const;

  // See ShutdownOptions. Throws what a graceful shutdown failed with
  // (TimeoutError, ConnectionError naming the workers), after closing.
  void shutdown(ShutdownOptions options = {});
  bool isShutDown() const;

  // This agent's instance of the extension T (rpc/extension.h, internal to
  // rref/ and dist_autograd/); null when T's layer is not linked in.
  template <typename T>
  T* extension() const {
    return static_cast<T*>(extension(typeid(T)));
  }
  detail::AgentExtension* extension(const std::type_info& type) const;

  // Counters (tests, monitoring).
  struct Stats {
    uint64_t messagesSent = 0;
    uint64_t messagesReceived = 0;
    uint64_t pendingCalls = 0;
    uint64_t runningHandlers = 0;
    uint64_t lateReplies = 0;
    uint64_t openPipes = 0;
    // Runs of inline functions (TRELLIS_REMOTE_INLINE) that held the
    // transport loop longer than TRELLIS_RPC_INLINE_WARN_US, counted from a
    // function's second such run in a row (docs/rpc.md, "Inline functions").
    uint64_t slowInlineRuns = 0;
  };
  Stats stats() const;

  struct Impl;

 private:
  explicit Agent(std::unique_ptr<Impl> impl);
  // The shared_ptr's deleter (see agent.cc).
  static void destroy(Agent* agent);
  std::unique_ptr<Impl> impl_;
};

// Runs `fn` with `agent` as the calling thread's current agent.
class CurrentAgentScope {
 public:
  explicit CurrentAgentScope(Agent* agent);
  ~CurrentAgentScope();
  CurrentAgentScope(const CurrentAgentScope&) = delete;
  CurrentAgentScope& operator=(const CurrentAgentScope&) = delete;

 private:
  Agent* previous_;
};

}  // namespace trellis::rpc
