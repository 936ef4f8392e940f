// The agent facade (docs/rpc.md, "Design notes"): it starts and closes the
// pieces, and routes messages between them. Each piece owns its state and
// its lock: rendezvous.h (the group), connections.h (the pipes),
// call_table.h (the calls this worker sent), dispatch.h (the requests it
// serves), quiescence.h (graceful shutdown's group protocol), extension.h
// (what rref/ and dist_autograd/ add). The free functions of rpc.h and the
// calling thread's agent are in rpc.cc.

#include <mutex>

#include "call_table.h"
#include "connections.h"
#include "dispatch.h"
#include "envelope.h"
#include "quiescence.h"
#include "rendezvous.h"
#include <trellis/core/deadline.h>
#include <trellis/core/logging.h>
#include <trellis/core/mutex.h>
#include <trellis/core/pending_count.h>
#include <trellis/core/thread_pool.h>
#include <trellis/rpc/agent.h>
#include <trellis/rpc/extension.h>
#include <trellis/rpc/profiler.h>
#include <trellis/rpc/rpc.h>
#include <trellis/store/prefix_store.h>
#include <trellis/store/store.h>
#include <trellis/store/tcp_store.h>

namespace trellis::rpc {

namespace pb = trellis::rpc::wire;
using detail::CallSpec;
using detail::Reply;

namespace {

using detail::PipeState;

int64_t toMicros(Duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

// Graceful shutdown's liveness probe (quiescence.h): no arguments, no
// result, answered on the transport loop.
constexpr std::string_view kPingFunction = "trellis.rpc.ping";
uint64_t pingSignature() {
  return signatureFingerprint<std::monostate>(kPingFunction);
}
Future<AnyValue> answerPing(Decoder& args, void*) {
  Error e = args.finish();
  return e.ok() ? makeReadyFuture(AnyValue{}) : makeErrorFuture<AnyValue>(e);
}
[[maybe_unused]] const bool kPingRegistered = [] {
  FunctionEntry e;
  e.name = std::string(kPingFunction);
  e.signature = pingSignature();
  e.invoke = &answerPing;
  e.runOnLoop = true;
  return Registry::global().add(std::move(e));
}();

}  // namespace

// The facade's own state is what start() fixes; the pieces hold the rest.
struct Agent::Impl {
  Agent* self = nullptr;
  WorkerInfo me;
  int32_t worldSize = 0;
  RpcOptions options;
  // Fixed once start() returns: read without a lock.
  detail::Group group;
  detail::Extensions extensions;

  // Made in start(), in this order, and closed in closeAll().
  std::unique_ptr<ThreadPool> completions;  // replies, callers' futures
  std::unique_ptr<detail::CallTable> calls;
  std::unique_ptr<detail::Dispatcher> dispatcher;
  std::unique_ptr<detail::Connections> connections;

  // Serialises shutdown() calls.
  Mutex shutdownMu;

  void onMessage(const std::shared_ptr<PipeState>& ps,
                 std::shared_ptr<pb::Envelope> env, Reply body,
                 Clock::time_point arrived);
  // Completes `call` with the reply `env` + `body`: here on the loop when
  // the call asked for it, else on a completion thread.
  void completeCall(detail::CallTable::Call&& call,
                    std::shared_ptr<pb::Envelope> env, Reply body);
  void onPipeFailed(const std::shared_ptr<PipeState>& ps, const Error& error);
  // True on a thread this agent owns and joins when it closes: its worker
  // and completion pools, its timer thread, its transport loop.
  bool onOwnThread() const;
  class Participant;
  void gracefulQuiesce(Duration arrivalTimeout, Duration quiesceTimeout);
  void closeAll(const Error& reason);
};

// ---- start -----------------------------------------------------------------

std::shared_ptr<Agent> Agent::start(const std::string& name, int32_t rank,
                                    int32_t worldSize, RpcOptions options) {
  detail::checkStartArguments(name, rank, worldSize, options);
  auto impl = std::make_unique<Impl>();
  impl->me.name = name;
  impl->me.rank = rank;
  impl->me.maxMessageBytes = options.maxMessageBytes;
  impl->worldSize = worldSize;
  impl->options = std::move(options);
  if (!impl->options.token) {
    impl->options.token = auth::JobToken::fromEnvironment();
  }
  std::shared_ptr<Agent> agent(new Agent(std::move(impl)), &Agent::destroy);
  Impl& d = *agent->impl_;
  d.self = agent.get();
  d.completions = std::make_unique<ThreadPool>(d.options.numCompletionThreads,
                                               "rpc-done-" + name);
  // Before the transport: a request may arrive as soon as it listens.
  d.extensions = detail::Extensions::create(*agent);
  d.calls = std::make_unique<detail::CallTable>(d.self, *d.completions,
                                                d.group.workers);
  d.dispatcher = std::make_unique<detail::Dispatcher>(
      d.self, d.me, d.extensions, d.options.numWorkerThreads,
      [&d](bool replies) {
        if (replies) {
          d.connections->endExpectedWork();
        }
        d.calls->notifyIdle();
      });
  d.dispatcher->setHoldHooks(
      [&d](bool replies) {
        if (replies) {
          d.connections->endExpectedWork();
        }
      },
      [&d](bool replies) {
        if (replies) {
          d.connections->beginExpectedWork();
        }
      });
  d.dispatcher->setReplyCheck([&d](int32_t peer, const Encoder& body) {
    return d.connections->checkFits(peer, body);
  });
  d.connections = std::make_unique<detail::Connections>(
      d.me, d.worldSize, d.options, d.group.workers,
      [&d](const std::shared_ptr<PipeState>& ps,
           std::shared_ptr<pb::Envelope> env, Reply body,
           Clock::time_point arrived) {
        d.onMessage(ps, std::move(env), std::move(body), arrived);
      },
      [&d](const std::shared_ptr<PipeState>& ps, const Error& error) {
        d.onPipeFailed(ps, error);
      });
  d.calls->start();
  try {
    d.me.address = d.connections->listen();
    detail::rendezvous(d.me, d.worldSize, d.options, d.group);
    // Only now: a request names its caller by rank, looked up in the group.
    d.connections->startServing();
  } catch (...) {
    d.closeAll(Error::cancelled("agent start failed"));
    throw;
  }
  return agent;
}

Agent::Agent(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

bool Agent::Impl::onOwnThread() const {
  return (dispatcher != nullptr && dispatcher->inPool()) ||
         (completions != nullptr && completions->inPool()) ||
         (calls != nullptr && calls->onTimerThread()) ||
         (connections != nullptr && connections->inLoop());
}

namespace {

// Teardowns posted to the teardown thread and not yet finished. Leaked on
// purpose, like the transport's late pool: an agent may be released during
// static destruction.
struct DeferredTeardowns {
  ThreadPool pool{1, "rpc-teardown"};
  PendingCount pending;
};

DeferredTeardowns& deferredTeardowns() {
  static auto* teardowns = new DeferredTeardowns();
  return *teardowns;
}

}  // namespace

// The last reference to an agent may drop on any thread, also in a user
// function or a future callback that runs on one of the agent's own
// threads and held an RRef, a dist_autograd::Context or the result of
// currentShared() while the user let go of the agent elsewhere. Teardown
// joins every one of those threads, and a thread cannot join itself, so
// there the teardown moves to a thread kept for this; the agent (and what
// its threads touch on their way out) lives until it is done.
void Agent::destroy(Agent* agent) {
  if (!agent->impl_->onOwnThread()) {
    delete agent;
    return;
  }
  DeferredTeardowns& teardowns = deferredTeardowns();
  teardowns.pending.add();
  teardowns.pool.post([agent, &teardowns](const Error&) {
    delete agent;
    teardowns.pending.done();
  });
}

bool Agent::awaitDeferredTeardowns(Duration timeout) {
  return deferredTeardowns().pending.await(timeout);
}

Agent::~Agent() {
  try {
    shutdown({.graceful = false});
  } catch (...) {
    TRELLIS_LOG_ERROR("rpc agent {}: shutdown in destructor failed: {}",
                      impl_->me.name, errorFromCurrentException().what());
  }
}

// ---- queries ---------------------------------------------------------------

const WorkerInfo& Agent::self() const { return impl_->me; }
int32_t Agent::worldSize() const { return impl_->worldSize; }
const RpcOptions& Agent::options() const { return impl_->options; }

const WorkerInfo& Agent::workerInfo(const std::string& name) const {
  auto it = impl_->group.byName.find(name);
  if (it == impl_->group.byName.end()) {
    throwError(Error::notFound("no RPC worker named '" + name + "'"));
  }
  return impl_->group.workers[it->second];
}

const WorkerInfo& Agent::workerInfo(int32_t rank) const {
  if (rank < 0 || rank >= impl_->worldSize) {
    throwError(Error::notFound("no RPC worker with rank " +
                               std::to_string(rank) + " (world size " +
                               std::to_string(impl_->worldSize) + ")"));
  }
  return impl_->group.workers[rank];
}

std::vector<WorkerInfo> Agent::workerInfos() const {
  return impl_->group.workers;
}

detail::AgentExtension* Agent::extension(const std::type_info& type) const {
  return impl_->extensions.find(type);
}

std::unique_ptr<GradReceiver> Agent::gradReceiver(const Reply& reply) {
  if (reply.autogradMessageId == 0) {
    return nullptr;
  }
  detail::IncomingMessage in;
  in.peer = reply.from;
  in.autogradContextId = reply.autogradContextId;
  in.autogradMessageId = reply.autogradMessageId;
  if (!impl_->extensions.recordRecv(in)) {
    return nullptr;
  }
  return std::move(in.gradReceiver);
}

std::shared_ptr<CodecContext> Agent::codecContext(int32_t peer) {
  return impl_->extensions.codecContext(peer);
}

Agent::Stats Agent::stats() const {
  Stats s;
  s.messagesSent = impl_->connections->sent();
  s.messagesReceived = impl_->connections->received();
  s.runningHandlers = impl_->dispatcher->running();
  s.lateReplies = impl_->calls->lateReplies();
  s.pendingCalls = impl_->calls->size();
  s.openPipes = impl_->connections->openPipes();
  s.slowInlineRuns = impl_->dispatcher->slowInlineRuns();
  return s;
}

bool Agent::isShutDown() const { return impl_->connections->forgotten(); }

void Agent::runOnWorkerThread(std::function<void(const Error&)> task) {
  impl_->dispatcher->post(std::move(task));
}

bool Agent::onLoopThread() const {
  return impl_->connections != nullptr && impl_->connections->inLoop();
}

// ---- sending ---------------------------------------------------------------

Future<Reply> Agent::call(int32_t to, const CallSpec& spec, Encoder&& args,
                          std::shared_ptr<CodecContext> context) {
  Impl& d = *impl_;
  if (to < 0 || to >= d.worldSize) {
    return makeErrorFuture<Reply>(Error::invalidArgument(
        "rpc to rank " + std::to_string(to) + ": no such worker (world size " +
        std::to_string(d.worldSize) + ")"));
  }
  Duration timeout;
  try {
    timeout = timeoutOr(spec.timeout, d.options.defaultTimeout, "rpc timeout");
  } catch (const Exception& e) {
    return makeErrorFuture<Reply>(e.error());
  }
  // Before anything is recorded or sent: the callee would close the pipe,
  // and every other call on it, over a message it does not accept.
  if (Error e = d.connections->checkFits(to, args); !e.ok()) {
    return makeErrorFuture<Reply>(
        Error(e.code(),
              "rpc of '" + std::string(spec.function) + "' to " +
                  detail::describeWorker(d.group.workers[to]) +
                  ": the arguments do not fit one message: " + e.message()));
  }
  const uint64_t id = d.calls->nextRequestId();
  pb::Envelope env;
  env.set_version(kEnvelopeVersion);
  env.set_kind(pb::Envelope::REQUEST);
  env.set_request_id(id);
  env.set_from_worker(static_cast<uint32_t>(d.me.rank));
  env.set_function(std::string(spec.function));
  env.set_signature(spec.signature);
  env.set_timeout_us(static_cast<uint64_t>(toMicros(timeout)));
  if (spec.extension != detail::kNoExtension) {
    env.set_extension(spec.extension);
    env.set_extension_payload(spec.extensionPayload);
  }
  if (const uint64_t ctx = spec.recordAutograd ? currentAutogradContext() : 0;
      ctx != 0 && spec.oneWay) {
    return makeErrorFuture<Reply>(Error::invalidArgument(
        "one-way call of '" + std::string(spec.function) +
        "' inside a distributed-autograd context (set recordAutograd = "
        "false)"));
  } else if (ctx != 0) {
    detail::OutgoingMessage out;
    out.peer = to;
    out.autogradContextId = ctx;
    out.gradTensors = &args.gradTensors();
    try {
      if (!d.extensions.recordSend(out)) {
        return makeErrorFuture<Reply>(
            Error(Code::kFailedPrecondition,
                  "call of '" + std::string(spec.function) +
                      "' inside a distributed-autograd context, but agent '" +
                      d.me.name + "' has no dist_autograd support linked in"));
      }
    } catch (...) {
      Error e = errorFromCurrentException();
      return makeErrorFuture<Reply>(
          Error(e.code(), "rpc of '" + std::string(spec.function) + "' to " +
                              detail::describeWorker(d.group.workers[to]) +
                              ": " + e.message()));
    }
    env.set_autograd_context_id(ctx);
    env.set_autograd_message_id(out.autogradMessageId);
  }

  auto notSent = [&] {
    return makeErrorFuture<Reply>(Error::cancelled(
        "rpc agent '" + d.me.name + "' is shut down; call of '" +
        std::string(spec.function) + "' not sent"));
  };
  if (d.calls->stopped()) {
    return notSent();
  }
  // A pipe that fails before the call is registered fails the write below,
  // and with it the call.
  auto ps = d.connections->outPipe(to);
  if (spec.oneWay) {
    // Nothing comes back: the write's outcome is the call's.
    env.set_one_way(true);
    Promise<Reply> written;
    auto future = written.getFuture();
    // The error's context is made only on an error: one-way calls are the
    // RRef protocol's deletes and accepts, sent in their thousands.
    d.connections->send(
        ps, env, std::move(args), std::move(context),
        [written, weak = weak_from_this(), to,
         function = std::string(spec.function)](const Error& e) mutable {
          if (e.ok()) {
            written.setValue(Reply{});
            return;
          }
          const auto agent = weak.lock();
          written.setError(e.withContext(
              "one-way call of '" + function + "' to " +
              (agent != nullptr ? detail::describeWorker(agent->workerInfo(to))
                                : "rank " + std::to_string(to))));
        });
    return future;
  }
  detail::CallTable::Call call;
  auto future = call.promise.getFuture();
  call.to = to;
  call.function = std::string(spec.function);
  call.pipe = ps.get();
  call.timeout = timeout;
  const auto& nested = NestedProfileScope::current();
  if (nested != nullptr || Profiler::active()) {
    env.set_profile(true);
    call.profiled = true;
    call.startUs = profilerNowUs();
    call.thread = profilerThreadId();
    call.nested = nested;
  }
  call.completeOnLoop = spec.completeOnLoop;
  if (!d.calls->add(id, std::move(call))) {
    return notSent();
  }
  d.connections->send(ps, env, std::move(args), std::move(context),
                      [&d, id](const Error& e) {
                        if (!e.ok()) {
                          d.calls->fail(id, e);
                        }
                      });
  return future;
}

// ---- receiving -------------------------------------------------------------

void Agent::Impl::onMessage(const std::shared_ptr<PipeState>& ps,
                            std::shared_ptr<pb::Envelope> env, Reply body,
                            Clock::time_point arrived) {
  if (!ps->outgoing) {
    const bool oneWay = env->one_way();
    if (!oneWay) {
      // The reply comes back to this loop from a worker thread within
      // microseconds for most calls: poll for it rather than sleep.
      connections->beginExpectedWork();
    }
    detail::Dispatcher::Request r;
    r.env = std::move(env);
    r.body = std::move(body);
    r.arrived = arrived;
    if (oneWay) {
      // Nobody waits for the outcome: a failure is only worth a line.
      r.respond = [this, from = r.body.from, function = r.env->function()](
                      const pb::Envelope& reply, Encoder&&,
                      std::shared_ptr<CodecContext>) {
        if (reply.has_error()) {
          TRELLIS_LOG_DEBUG(
              "rpc agent {}: one-way call of '{}' from {} failed: {}", me.name,
              function, detail::describeWorker(group.workers[from]),
              reply.error().message());
        }
      };
      dispatcher->dispatch(std::move(r));
      return;
    }
    r.respond = [this, ps](const pb::Envelope& reply, Encoder&& out,
                           std::shared_ptr<CodecContext> context) {
      connections->send(ps, reply, std::move(out), std::move(context),
                        [this, ps](const Error& e) {
                          if (!e.ok()) {
                            connections->fail(ps, e);
                          }
                        });
    };
    dispatcher->dispatch(std::move(r));
    return;
  }
  if (const uint64_t other = env->also_answers(); other != 0) {
    // The callee answered that request of ours with this reply (a
    // remote()'s confirmation, rref/): an OK, empty reply, first, as it
    // would have come. Taken only if it went out on this pipe.
    if (auto call = calls->take(other, ps.get())) {
      Reply empty;
      empty.from = body.from;
      completeCall(std::move(*call), std::make_shared<pb::Envelope>(),
                   std::move(empty));
    } else {
      calls->countLateReply();
    }
  }
  auto call = calls->take(env->request_id(), ps.get());
  if (!call) {
    calls->countLateReply();
    TRELLIS_LOG_DEBUG("rpc agent {}: dropping the late reply {} from {}",
                      me.name, env->request_id(),
                      detail::describeWorker(group.workers[body.from]));
    return;
  }
  completeCall(std::move(*call), std::move(env), std::move(body));
}

void Agent::Impl::completeCall(detail::CallTable::Call&& call,
                               std::shared_ptr<pb::Envelope> env, Reply body) {
  if (call.completeOnLoop) {
    // A blocked rpcSync waits on this future with no callbacks: setting it
    // here wakes the caller directly, one thread hop fewer.
    calls->complete(std::move(call), *env, std::move(body), me.name);
    return;
  }
  completions->post([this, env = std::move(env),
                     body = std::make_shared<Reply>(std::move(body)),
                     call = std::make_shared<detail::CallTable::Call>(
                         std::move(call))](const Error&) {
    CurrentAgentScope scope(self);
    calls->complete(std::move(*call), *env, std::move(*body), me.name);
  });
}

void Agent::Impl::onPipeFailed(const std::shared_ptr<PipeState>& ps,
                               const Error& error) {
  std::vector<uint64_t> ids;
  if (ps->outgoing) {
    ids = calls->callsOn(ps.get());
  }
  const bool quiet = calls->stopped();
  if (error.code() == Code::kDataLoss ||
      error.code() == Code::kUnauthenticated) {
    TRELLIS_LOG_WARN("rpc agent {}: closing pipe to {}: {}", me.name,
                     connections->describePeer(*ps), error.what());
  } else if (!quiet && !ids.empty()) {
    TRELLIS_LOG_INFO("rpc agent {}: pipe to {} failed: {}", me.name,
                     connections->describePeer(*ps), error.what());
  }
  for (uint64_t id : ids) {
    calls->fail(id, error);
  }
}

// ---- shutdown --------------------------------------------------------------

// What the group protocol (quiescence.h) needs from this worker.
class Agent::Impl::Participant : public detail::QuiescenceParticipant {
 public:
  Participant(Impl& d, Duration probeTimeout)
      : d_(d), probeTimeout_(probeTimeout) {}

  detail::QuiescenceCounts counts() override {
    detail::QuiescenceCounts c;
    c.active = d_.calls->size() + d_.dispatcher->running();
    c.sent = d_.connections->sent();
    c.received = d_.connections->received();
    return c;
  }

  void waitIdle(Deadline deadline) override {
    d_.calls->waitIdle(deadline,
                       [this] { return d_.dispatcher->running() == 0; });
  }

  // A ping answered on the peer's transport loop: a worker whose user
  // functions are all busy still answers at once; one that is gone fails
  // it with UNAVAILABLE, one that is stopped or hangs with a timeout.
  Future<void> probe(int32_t rank) override {
    CallSpec spec;
    spec.function = kPingFunction;
    spec.signature = pingSignature();
    spec.timeout = probeTimeout_;
    spec.recordAutograd = false;
    return d_.self->call(rank, spec, Encoder()).then([](const Reply&) {});
  }

  std::string describe(int32_t rank) override {
    return detail::describeWorker(d_.group.workers[rank]);
  }

 private:
  Impl& d_;
  const Duration probeTimeout_;
};

void Agent::Impl::gracefulQuiesce(Duration arrivalTimeout,
                                  Duration quiesceTimeout) {
  extensions.beforeQuiescence();
  // Every store operation of the protocol gets the shutdown's bound: a
  // store whose server stopped answering (its host is stopped or hangs)
  // must fail the shutdown in time, not after the store's own timeout. Only
  // for the store this agent made; a user's store keeps its timeout.
  if (group.ownStore && quiesceTimeout > Duration::zero()) {
    const auto bound =
        std::chrono::duration_cast<std::chrono::milliseconds>(quiesceTimeout);
    group.store->setTimeout(bound);
    // The launcher's store: the prefix's client bounds every request too.
    if (auto* prefixed = dynamic_cast<store::PrefixStore*>(group.store.get())) {
      prefixed->underlying()->setTimeout(bound);
    }
  }
  detail::QuiescenceOptions o;
  o.keyPrefix = std::string(detail::kStoreKeyPrefix) + "shutdown/";
  o.name = me.name;
  o.rank = me.rank;
  o.worldSize = worldSize;
  o.arrivalTimeout = arrivalTimeout;
  o.quiesceTimeout = quiesceTimeout;
  o.hostsStore = group.storeServer != nullptr;
  Participant participant(*this, quiesceTimeout);
  calls->setQuiescing(true);
  try {
    detail::runQuiescence(*group.store, participant, o);
  } catch (const Exception& e) {
    calls->setQuiescing(false);
    const std::string& msg = e.error().message();
    if (msg.rfind("rpc shutdown of", 0) == 0) {
      throw;
    }
    // The store's own error: say which store, and who serves it.
    throwError(Error(e.code(), "rpc shutdown of '" + me.name + "': " +
                                   group.storeDescription + ": " + msg));
  }
  calls->setQuiescing(false);
  extensions.reportLeaks(me.name);
}

void Agent::Impl::closeAll(const Error& reason) {
  for (uint64_t id : calls->stop()) {
    calls->fail(id, reason);
  }
  connections->closeTransport();
  dispatcher->close();
  completions->shutdown(ThreadPool::ShutdownMode::kDrain);
  completions->join();
  connections->forget();
  calls->join();
  if (group.storeServer != nullptr) {
    group.storeServer->stop();
  }
}

void Agent::shutdown(ShutdownOptions options) {
  Impl& d = *impl_;
  if (isShutDown()) {
    return;
  }
  if (d.onOwnThread()) {
    // It would wait for the very thread it runs on.
    throwError(Error(Code::kFailedPrecondition,
                     "rpc shutdown of '" + d.me.name +
                         "' called from one of its own threads (a user "
                         "function or a future callback): call it from "
                         "another thread"));
  }
  MutexLock once(d.shutdownMu);
  if (isShutDown()) {
    return;
  }
  // Checked before anything closes: a bad option changes nothing.
  const Duration drain =
      timeoutOr(options.drainTimeout, d.options.shutdownDrainTimeout,
                "shutdown drainTimeout");
  const Duration arrival =
      timeoutOr(options.arrivalTimeout, d.options.shutdownArrivalTimeout,
                "shutdown arrivalTimeout");
  Error failure;
  if (options.graceful) {
    try {
      d.gracefulQuiesce(arrival, drain);
    } catch (...) {
      failure = errorFromCurrentException();
    }
  }
  d.closeAll(Error::cancelled("rpc agent '" + d.me.name + "' shut down"));
  throwIfError(failure);
}

}  // namespace trellis::rpc
