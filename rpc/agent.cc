#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sys/mman.h>
#include <thread>
#include <unordered_map>

#include "envelope.h"
#include "quiescence.h"
#include <trellis/core/deadline.h>
#include <trellis/core/logging.h>
#include <trellis/core/net.h>
#include <trellis/core/thread_pool.h>
#include <trellis/core/worker_env.h>
#include <trellis/rpc/agent.h>
#include <trellis/rpc/profiler.h>
#include <trellis/rpc/rpc.h>
#include <trellis/store/store.h>
#include <trellis/store/tcp_store.h>
#include <trellis/transport/context.h>
#include <trellis/transport/listener.h>
#include <trellis/transport/pipe.h>

namespace trellis::rpc {

namespace tp = trellis::transport;
namespace pb = trellis::rpc::wire;

namespace {

constexpr size_t kMaxWorkerNameBytes = 128;
constexpr int32_t kMaxWorldSize = 65535;  // ids keep the worker in 16 bits
const std::string kKeyPrefix = "trellis/rpc/";

thread_local Agent* tCurrentAgent = nullptr;
// The agent whose timer thread this is.
thread_local const void* tTimerOf = nullptr;
std::mutex gProcessMu;
std::atomic<Agent::RRefHooksFactory> gHooksFactory{nullptr};
std::atomic<Agent::AutogradHooksFactory> gAutogradFactory{nullptr};
thread_local uint64_t tlsAutogradContext = 0;
std::shared_ptr<Agent> gProcessAgent;

bool validWorkerName(const std::string& name) {
  if (name.empty() || name.size() > kMaxWorkerNameBytes) {
    return false;
  }
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' ||
           c == '-' || c == '.' || c == ':';
  });
}

int64_t toMicros(Duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

std::string describeWorker(const WorkerInfo& w) {
  return "worker '" + w.name + "' (rank " + std::to_string(w.rank) + ")";
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

// Receive buffers for large tensors, kept and reused. Touching fresh pages
// runs at ~0.4 GB/s on these machines against ~20 GB/s for memory already
// mapped (DESIGN.md), and glibc hands back any block above 32 MiB to the
// kernel on free, so without a pool every large tensor received would be
// page-fault bound. Sizes are rounded up to 1/8 of their power of two (at
// most 12.5% waste); a buffer returns to the pool when the last tensor
// viewing it dies, up to kMaxCachedBytes, and goes to the allocator beyond.
class ReceiveBufferPool {
 public:
  static constexpr size_t kMinPooledBytes = size_t{1} << 20;
  static constexpr size_t kMaxCachedBytes = size_t{512} << 20;

  at::Tensor take(size_t length) {
    const auto options = at::TensorOptions().dtype(at::kByte);
    if (length < kMinPooledBytes) {
      return at::empty({static_cast<int64_t>(length)}, options);
    }
    const size_t cls = sizeClass(length);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      auto it = shared_->free.find(cls);
      if (it != shared_->free.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        shared_->cachedBytes -= cls;
      }
    }
    if (p == nullptr) {
      p = allocate(cls);
    }
    auto shared = shared_;
    return at::from_blob(
        p, {static_cast<int64_t>(length)},
        [shared, cls](void* q) { shared->give(q, cls); }, options);
  }

 private:
  // Buffers of 2 MiB and more are aligned to 2 MiB and advised onto
  // transparent huge pages (granted where THP is "always" or "madvise"; the
  // advice is harmless where it is off). A huge page faults in once per
  // 2 MiB instead of 512 times, and the cma channel's process_vm_readv into
  // or out of such a buffer pins a page per 2 MiB: measured here, 64 MiB
  // from huge pages moves at 16 GB/s on one thread against 4.5 GB/s from
  // 4 KiB pages (docs/benchmarks.md).
  static void* allocate(size_t cls) {
    constexpr size_t kHugePage = size_t{2} << 20;
    const bool huge = cls >= kHugePage;
    void* p = nullptr;
    if (::posix_memalign(&p, huge ? kHugePage : 64, cls) != 0) {
      throw std::bad_alloc();
    }
    if (huge) {
      (void)::madvise(p, cls, MADV_HUGEPAGE);  // advice only
    }
    return p;
  }

  static size_t sizeClass(size_t n) {
    size_t top = size_t{1} << (63 - __builtin_clzll(n));
    const size_t step = std::max<size_t>(top / 8, kMinPooledBytes);
    return (n + step - 1) / step * step;
  }
  struct Shared {
    std::mutex mu;
    std::map<size_t, std::vector<void*>> free;
    size_t cachedBytes = 0;
    void give(void* p, size_t cls) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (cachedBytes + cls <= kMaxCachedBytes) {
          free[cls].push_back(p);
          cachedBytes += cls;
          return;
        }
      }
      std::free(p);
    }
    ~Shared() {
      for (auto& [cls, v] : free) {
        for (void* p : v) {
          std::free(p);
        }
      }
    }
  };
  // Shared with the deleters of tensors that may outlive the agent.
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
};

// One pipe and what the agent knows about it. Outgoing pipes carry this
// worker's requests and their replies; incoming ones the peer's requests.
struct PipeState {
  std::shared_ptr<tp::Pipe> pipe;
  bool outgoing = false;
  std::atomic<int32_t> peer{-1};  // incoming: learned from the first message
  std::atomic<bool> failed{false};
};

struct PendingCall {
  Promise<Reply> promise;
  int32_t to = -1;
  std::string function;
  PipeState* pipe = nullptr;
  Duration timeout{0};
  std::multimap<Clock::time_point, uint64_t>::iterator timer;
  bool hasTimer = false;
  bool profiled = false;
  int64_t startUs = 0;
  uint64_t thread = 0;  // profilerThreadId() of the caller
  // Set when the caller is a profiled request's function: the events go
  // to its reply instead of this process's profilers.
  std::shared_ptr<NestedEvents> nested;
  bool completeOnLoop = false;
};

struct Agent::Impl {
  Agent* self = nullptr;
  WorkerInfo me;
  int32_t worldSize = 0;
  RpcOptions options;
  std::vector<WorkerInfo> workers;
  std::unordered_map<std::string, int32_t> byName;

  std::unique_ptr<store::TCPStoreServer> storeServer;
  std::shared_ptr<store::Store> store;
  std::shared_ptr<tp::Context> ctx;
  std::shared_ptr<tp::Listener> listener;
  std::unique_ptr<ThreadPool> handlers;
  std::unique_ptr<ThreadPool> completions;
  std::shared_ptr<RRefHooks> hooks;
  // Set once in start(), before the transport; read without the lock.
  std::shared_ptr<AutogradHooks> autograd;
  ReceiveBufferPool receiveBuffers;

  mutable std::mutex mu;
  std::condition_variable timerCv;
  std::map<int32_t, std::shared_ptr<PipeState>> outPipes;
  std::set<std::shared_ptr<PipeState>> inPipes;
  std::unordered_map<uint64_t, PendingCall> pending;
  std::multimap<Clock::time_point, uint64_t> timers;
  // When the timer thread wakes next (max while it waits for work). A call
  // wakes it only to move that earlier: sequential calls with the same
  // timeout never do, since each deadline is later than the one it sleeps
  // until.
  Clock::time_point timerWakeAt = Clock::time_point::max();
  bool stopping = false;
  bool closed = false;
  std::thread timerThread;

  std::atomic<uint64_t> nextRequestId{1};
  std::atomic<uint64_t> sent{0};
  std::atomic<uint64_t> received{0};
  std::atomic<uint64_t> running{0};
  std::atomic<uint64_t> lateReplies{0};
  std::mutex shutdownMu;
  // Graceful shutdown: set while the protocol runs, so that the end of a
  // call or a request wakes its waitIdle().
  std::atomic<bool> quiescing{false};
  std::condition_variable idleCv;
  // The store was made here from MASTER_ADDR/PORT (ours to re-time).
  bool ownStore = false;
  std::string storeDescription = "the rendezvous store";

  // ---- start -------------------------------------------------------------
  void rendezvous();
  void startTransport();
  // ---- sending -----------------------------------------------------------
  std::shared_ptr<PipeState> outPipe(int32_t to);
  void send(const std::shared_ptr<PipeState>& ps, const pb::Envelope& env,
            Encoder&& body, std::unique_ptr<CodecContext> context,
            std::function<void(const Error&)> done);
  void failCall(uint64_t id, const Error& error);
  // ---- receiving ---------------------------------------------------------
  void accept();
  void armRead(const std::shared_ptr<PipeState>& ps);
  void onDescriptor(const std::shared_ptr<PipeState>& ps, tp::Descriptor desc);
  void onPipeError(const std::shared_ptr<PipeState>& ps, const Error& error);
  void handleRequest(const std::shared_ptr<PipeState>& ps,
                     std::shared_ptr<pb::Envelope> env, Reply body,
                     Clock::time_point arrived);
  void respond(const std::shared_ptr<PipeState>& ps, const pb::Envelope& req,
               const Future<AnyValue>& result, int64_t profileStartUs = 0,
               std::shared_ptr<NestedEvents> nested = nullptr);
  // Removes the pending call `id` (sent on `pipe`) with its timer; empty
  // when it is gone (timed out, failed) or was sent on another pipe.
  std::optional<PendingCall> takePending(uint64_t id, const PipeState* pipe);
  // Completes `pc`'s promise with `error` on a completion thread.
  void failLater(PendingCall&& pc, Error error);
  void handleReply(PendingCall&& pc, const pb::Envelope& env, Reply body);
  // ---- timers / shutdown --------------------------------------------------
  // True on a thread this agent owns and joins when it closes: its worker
  // and completion pools, its timer thread, its transport loop.
  bool onOwnThread() const;
  void timerLoop();
  class Participant;
  void gracefulQuiesce(Duration arrivalTimeout, Duration quiesceTimeout);
  // Wakes a graceful shutdown waiting for this worker to go idle.
  void notifyIdle();
  void closeAll(const Error& reason);

  template <typename F>
  void post(ThreadPool& pool, F&& fn) {
    pool.post([agent = self, fn = std::forward<F>(fn)](const Error& e) mutable {
      CurrentAgentScope scope(agent);
      fn(e);
    });
  }
};

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
  std::lock_guard<std::mutex> lock(gProcessMu);
  if (gProcessAgent == nullptr) {
    throwError(Error(Code::kFailedPrecondition,
                     "no RPC agent: call trellis::rpc::init() first"));
  }
  return gProcessAgent;
}

void Agent::setProcessAgent(std::shared_ptr<Agent> agent) {
  std::lock_guard<std::mutex> lock(gProcessMu);
  gProcessAgent = std::move(agent);
}

// ---- start -----------------------------------------------------------------

std::shared_ptr<Agent> Agent::start(const std::string& name, int32_t rank,
                                    int32_t worldSize, RpcOptions options) {
  if (!validWorkerName(name)) {
    throwError(Error::invalidArgument(
        "worker name '" + name +
        "' must be 1-128 characters of [A-Za-z0-9_.:-]"));
  }
  if (worldSize < 1 || worldSize > kMaxWorldSize) {
    throwError(Error::invalidArgument(
        "world size " + std::to_string(worldSize) + " must be in [1, 65535]"));
  }
  if (rank < 0 || rank >= worldSize) {
    throwError(Error::invalidArgument("rank " + std::to_string(rank) +
                                      " must be in [0, " +
                                      std::to_string(worldSize) + ")"));
  }
  if (options.numWorkerThreads < 1 || options.numCompletionThreads < 1) {
    throwError(Error::invalidArgument(
        "RpcOptions: numWorkerThreads and numCompletionThreads must be >= 1"));
  }
  throwIfError(Registry::global().status());

  auto impl = std::make_unique<Impl>();
  impl->me.name = name;
  impl->me.rank = rank;
  impl->worldSize = worldSize;
  impl->options = std::move(options);
  if (!impl->options.token) {
    impl->options.token = auth::JobToken::fromEnvironment();
  }
  std::shared_ptr<Agent> agent(new Agent(std::move(impl)), &Agent::destroy);
  Impl& d = *agent->impl_;
  d.self = agent.get();
  d.handlers =
      std::make_unique<ThreadPool>(d.options.numWorkerThreads, "rpc-" + name);
  d.completions = std::make_unique<ThreadPool>(d.options.numCompletionThreads,
                                               "rpc-done-" + name);
  if (auto factory = gHooksFactory.load()) {
    d.hooks = factory(*agent);
  }
  if (auto factory = gAutogradFactory.load()) {
    d.autograd = factory(*agent);
  }
  d.timerThread = std::thread([&d] { d.timerLoop(); });
  try {
    d.startTransport();
    d.rendezvous();
  } catch (...) {
    d.closeAll(Error::cancelled("agent start failed"));
    throw;
  }
  return agent;
}

Agent::Agent(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

bool Agent::Impl::onOwnThread() const {
  return (handlers != nullptr && handlers->inPool()) ||
         (completions != nullptr && completions->inPool()) ||
         tTimerOf == this || (ctx != nullptr && ctx->inLoop());
}

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
  // Leaked on purpose, like the transport's late pool: an agent may be
  // released during static destruction.
  static ThreadPool* teardown = new ThreadPool(1, "rpc-teardown");
  teardown->post([agent](const Error&) { delete agent; });
}

Agent::~Agent() {
  try {
    shutdown({.graceful = false});
  } catch (...) {
    TRELLIS_LOG_ERROR("rpc agent {}: shutdown in destructor failed: {}",
                      impl_->me.name, errorFromCurrentException().what());
  }
}

void Agent::Impl::startTransport() {
  const std::string host = net::chooseLocalAddress(
      options.localAddress, masterFromEnvironment().addr);
  tp::ContextOptions co;
  co.name = "rpc." + me.name;
  co.token = options.token;
  co.tokenFromEnvironment = false;
  co.transports = options.transports;
  co.channels = options.channels;
  co.limits.maxPayloadBytes = options.maxMessageBytes;
  ctx = tp::Context::create(co);
  listener = ctx->listen({"uv://" + net::bracketIfIpv6(host) + ":0"});
  me.address = listener->address("uv");
  accept();
}

void Agent::Impl::rendezvous() {
  if (store == nullptr) {
    store = options.store;
  }
  const Deadline deadline = Deadline::fromTimeout(options.initTimeout);
  if (store == nullptr) {
    const MasterEndpoint master = masterFromEnvironment();
    if (!master.complete()) {
      throwError(Error::invalidArgument(
          "rpc::init needs a rendezvous store: set RpcOptions::store, or "
          "MASTER_ADDR and MASTER_PORT"));
    }
    const std::string& addr = master.addr;
    const uint16_t p = master.port;
    if (me.rank == 0) {
      store::TCPStoreServerOptions so;
      so.host = addr;
      so.port = p;
      so.jobToken = options.token;
      storeServer = std::make_unique<store::TCPStoreServer>(so);
    }
    store::TCPStoreOptions co;
    co.host = addr;
    co.port = p;
    co.jobToken = options.token;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
        options.initTimeout);
    co.timeout = ms;
    co.connectTimeout = ms;
    store = std::make_shared<store::TCPStore>(co);
    ownStore = true;
    storeDescription = "the rendezvous store at " + net::bracketIfIpv6(addr) +
                       ":" + std::to_string(p);
  }
  store->set(kKeyPrefix + "worker/" + std::to_string(me.rank),
             me.name + "\n" + me.address);
  std::vector<std::string> keys;
  for (int32_t r = 0; r < worldSize; ++r) {
    keys.push_back(kKeyPrefix + "worker/" + std::to_string(r));
  }
  try {
    store->wait(keys, std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline.isNever() ? Duration::zero()
                                             : deadline.remaining()));
  } catch (const TimeoutError&) {
    std::string missing;
    for (int32_t r = 0; r < worldSize && missing.size() < 200; ++r) {
      if (!store->check({keys[r]})) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    throwError(Error::timeout("rpc::init of '" + me.name + "': ranks [" +
                              missing + "] did not join within " +
                              formatDuration(options.initTimeout)));
  }
  const auto values = store->multiGet(keys);
  workers.resize(worldSize);
  for (int32_t r = 0; r < worldSize; ++r) {
    const std::string v(values[r].begin(), values[r].end());
    const size_t nl = v.find('\n');
    WorkerInfo w;
    w.rank = r;
    if (nl != std::string::npos) {
      w.name = v.substr(0, nl);
      w.address = v.substr(nl + 1);
    }
    if (!validWorkerName(w.name) || w.address.rfind("uv://", 0) != 0 ||
        w.address.size() > 512) {
      throwError(
          Error::protocol("rpc::init: malformed rendezvous entry for "
                          "rank " +
                          std::to_string(r)));
    }
    if (auto [it, fresh] = byName.emplace(w.name, r); !fresh) {
      throwError(Error(Code::kAlreadyExists,
                       "rpc::init: ranks " + std::to_string(it->second) +
                           " and " + std::to_string(r) +
                           " both use the worker name '" + w.name + "'"));
    }
    workers[r] = std::move(w);
  }
  if (ownStore) {
    storeDescription += " (served by " + describeWorker(workers[0]) + ")";
  }
  TRELLIS_LOG_DEBUG("rpc agent {} (rank {}/{}) listening on {}", me.name,
                    me.rank, worldSize, me.address);
}

// ---- queries ---------------------------------------------------------------

const WorkerInfo& Agent::self() const { return impl_->me; }
int32_t Agent::worldSize() const { return impl_->worldSize; }
const RpcOptions& Agent::options() const { return impl_->options; }

const WorkerInfo& Agent::workerInfo(const std::string& name) const {
  auto it = impl_->byName.find(name);
  if (it == impl_->byName.end()) {
    throwError(Error::notFound("no RPC worker named '" + name + "'"));
  }
  return impl_->workers[it->second];
}

const WorkerInfo& Agent::workerInfo(int32_t rank) const {
  if (rank < 0 || rank >= impl_->worldSize) {
    throwError(Error::notFound("no RPC worker with rank " +
                               std::to_string(rank) + " (world size " +
                               std::to_string(impl_->worldSize) + ")"));
  }
  return impl_->workers[rank];
}

std::vector<WorkerInfo> Agent::workerInfos() const { return impl_->workers; }

void Agent::setRRefHooks(std::shared_ptr<RRefHooks> hooks) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->hooks = std::move(hooks);
}

void Agent::setRRefHooksFactory(RRefHooksFactory factory) {
  gHooksFactory.store(factory);
}

void Agent::setAutogradHooksFactory(AutogradHooksFactory factory) {
  gAutogradFactory.store(factory);
}

AutogradHooks* Agent::autogradHooks() const { return impl_->autograd.get(); }

std::unique_ptr<GradReceiver> Agent::gradReceiver(const Reply& reply) {
  if (reply.autogradMessageId == 0 || impl_->autograd == nullptr) {
    return nullptr;
  }
  return impl_->autograd->recordRecv(reply.autogradContextId, reply.from,
                                     reply.autogradMessageId);
}

uint64_t currentAutogradContext() { return tlsAutogradContext; }

AutogradContextScope::AutogradContextScope(uint64_t contextId)
    : previous_(tlsAutogradContext) {
  tlsAutogradContext = contextId;
}

AutogradContextScope::~AutogradContextScope() {
  tlsAutogradContext = previous_;
}

RRefHooks* Agent::rrefHooks() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->hooks.get();
}

std::unique_ptr<CodecContext> Agent::codecContext(int32_t peer) {
  RRefHooks* h = rrefHooks();
  return h == nullptr ? nullptr : h->makeContext(peer);
}

Agent::Stats Agent::stats() const {
  Stats s;
  s.messagesSent = impl_->sent.load();
  s.messagesReceived = impl_->received.load();
  s.runningHandlers = impl_->running.load();
  s.lateReplies = impl_->lateReplies.load();
  std::lock_guard<std::mutex> lock(impl_->mu);
  s.pendingCalls = impl_->pending.size();
  s.openPipes = impl_->outPipes.size() + impl_->inPipes.size();
  return s;
}

bool Agent::isShutDown() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->closed;
}

// ---- sending ---------------------------------------------------------------

std::shared_ptr<PipeState> Agent::Impl::outPipe(int32_t to) {
  // Caller holds mu.
  auto it = outPipes.find(to);
  if (it != outPipes.end()) {
    return it->second;
  }
  auto ps = std::make_shared<PipeState>();
  ps->outgoing = true;
  ps->peer = to;
  ps->pipe = ctx->connect(workers[to].address);
  outPipes.emplace(to, ps);
  armRead(ps);
  return ps;
}

void Agent::Impl::send(const std::shared_ptr<PipeState>& ps,
                       const pb::Envelope& env, Encoder&& body,
                       std::unique_ptr<CodecContext> context,
                       std::function<void(const Error&)> done) {
  struct Held {
    std::vector<uint8_t> bytes;
    std::vector<at::Tensor> tensors;
    std::unique_ptr<CodecContext> context;
  };
  auto held = std::make_shared<Held>();
  held->bytes = body.wire().release();
  held->tensors = body.tensors();
  held->context = std::move(context);
  tp::Message m;
  m.descriptor = env.SerializeAsString();
  m.payloads.push_back({held->bytes.data(), held->bytes.size()});
  for (const auto& t : held->tensors) {
    tp::Message::Tensor mt;
    mt.data = t.data_ptr();
    mt.length = t.nbytes();
    if (t.is_cuda()) {
      mt.device = tp::Device::cuda(t.get_device());
    }
    m.tensors.push_back(mt);
  }
  sent.fetch_add(1, std::memory_order_relaxed);
  ps->pipe->write(std::move(m),
                  [held, done = std::move(done)](const Error& e) mutable {
                    held.reset();  // buffers may go now
                    done(e);
                  });
}

Future<Reply> Agent::call(int32_t to, const CallSpec& spec, Encoder&& args,
                          std::unique_ptr<CodecContext> context) {
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
  const uint64_t id = d.nextRequestId.fetch_add(1);
  pb::Envelope env;
  env.set_version(kEnvelopeVersion);
  env.set_kind(pb::Envelope::REQUEST);
  env.set_request_id(id);
  env.set_from_worker(static_cast<uint32_t>(d.me.rank));
  env.set_function(std::string(spec.function));
  env.set_signature(spec.signature);
  env.set_timeout_us(static_cast<uint64_t>(toMicros(timeout)));
  if (spec.storeResultInRRef) {
    auto* r = env.mutable_rref();
    r->set_rref_worker(spec.rref.worker);
    r->set_rref_local(spec.rref.local);
    r->set_fork_worker(spec.fork.worker);
    r->set_fork_local(spec.fork.local);
    env.set_store_result_in_rref(true);
  }
  if (spec.methodOnRRef) {
    auto* t = env.mutable_target();
    t->set_rref_worker(spec.target.worker);
    t->set_rref_local(spec.target.local);
    env.set_method_on_rref(true);
  }
  if (const uint64_t ctx = spec.recordAutograd ? tlsAutogradContext : 0;
      ctx != 0) {
    if (d.autograd == nullptr) {
      return makeErrorFuture<Reply>(
          Error(Code::kFailedPrecondition,
                "call of '" + std::string(spec.function) +
                    "' inside a distributed-autograd context, but agent '" +
                    d.me.name + "' has no dist_autograd support linked in"));
    }
    try {
      env.set_autograd_context_id(ctx);
      env.set_autograd_message_id(
          d.autograd->recordSend(ctx, to, args.gradTensors()));
    } catch (...) {
      Error e = errorFromCurrentException();
      return makeErrorFuture<Reply>(Error(
          e.code(), "rpc of '" + std::string(spec.function) + "' to " +
                        describeWorker(d.workers[to]) + ": " + e.message()));
    }
  }

  Promise<Reply> promise;
  auto future = promise.getFuture();
  std::shared_ptr<PipeState> ps;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.stopping) {
      return makeErrorFuture<Reply>(Error::cancelled(
          "rpc agent '" + d.me.name + "' is shut down; call of '" +
          std::string(spec.function) + "' not sent"));
    }
    ps = d.outPipe(to);
    PendingCall pc;
    pc.promise = promise;
    pc.to = to;
    pc.function = std::string(spec.function);
    pc.pipe = ps.get();
    pc.timeout = timeout;
    const auto& nested = NestedProfileScope::current();
    if (nested != nullptr || Profiler::active()) {
      env.set_profile(true);
      pc.profiled = true;
      pc.startUs = profilerNowUs();
      pc.thread = profilerThreadId();
      pc.nested = nested;
    }
    bool wakeTimer = false;
    if (timeout > Duration::zero()) {
      const auto at = Clock::now() + timeout;
      pc.timer = d.timers.emplace(at, id);
      pc.hasTimer = true;
      if (at < d.timerWakeAt) {
        d.timerWakeAt = at;
        wakeTimer = true;
      }
    }
    pc.completeOnLoop = spec.completeOnLoop;
    d.pending.emplace(id, std::move(pc));
    if (wakeTimer) {
      d.timerCv.notify_one();
    }
  }
  d.send(ps, env, std::move(args), std::move(context),
         [&d, id](const Error& e) {
           if (!e.ok()) {
             d.failCall(id, e);
           }
         });
  return future;
}

void Agent::Impl::failCall(uint64_t id, const Error& error) {
  auto pc = takePending(id, nullptr);
  if (!pc) {
    return;
  }
  Error e(error.code(), "rpc of '" + pc->function + "' to " +
                            describeWorker(workers[pc->to]) + ": " +
                            error.message());
  failLater(std::move(*pc), std::move(e));
}

// ---- receiving -------------------------------------------------------------

void Agent::Impl::accept() {
  listener->accept([this](const Error& e, std::shared_ptr<tp::Pipe> pipe) {
    if (!e.ok()) {
      if (e.code() != Code::kCancelled) {
        TRELLIS_LOG_WARN("rpc agent {}: listener stopped: {}", me.name,
                         e.what());
      }
      return;
    }
    auto ps = std::make_shared<PipeState>();
    ps->pipe = std::move(pipe);
    {
      std::lock_guard<std::mutex> lock(mu);
      if (closed) {
        ps->pipe->close();
        return;
      }
      inPipes.insert(ps);
    }
    armRead(ps);
    accept();
  });
}

void Agent::Impl::armRead(const std::shared_ptr<PipeState>& ps) {
  ps->pipe->readDescriptor([this, ps](const Error& e, tp::Descriptor desc) {
    if (!e.ok()) {
      onPipeError(ps, e);
      return;
    }
    onDescriptor(ps, std::move(desc));
  });
}

void Agent::Impl::onDescriptor(const std::shared_ptr<PipeState>& ps,
                               tp::Descriptor desc) {
  auto env = std::make_shared<pb::Envelope>();
  const std::string where = "rpc agent '" + me.name + "': message from " +
                            ps->pipe->peerAddress() + ": ";
  auto bad = [&](const std::string& what) {
    onPipeError(ps, Error::protocol(where + what));
  };
  if (Error e =
          parseEnvelope(desc.descriptor, worldSize, !ps->outgoing, env.get());
      !e.ok()) {
    return bad(e.message());
  }
  const auto from = static_cast<int32_t>(env->from_worker());
  int32_t known = -1;
  if (!ps->peer.compare_exchange_strong(known, from) && known != from) {
    return bad("from_worker " + std::to_string(from) + " on a pipe of rank " +
               std::to_string(known));
  }
  if (desc.payloadLengths.size() != 1) {
    return bad("expected 1 payload, got " +
               std::to_string(desc.payloadLengths.size()));
  }
  if (desc.payloadLengths[0] > options.maxMessageBytes) {
    return bad("payload of " + std::to_string(desc.payloadLengths[0]) +
               " bytes exceeds maxMessageBytes");
  }
  auto body = std::make_shared<Reply>();
  body->from = from;
  tp::Allocation alloc;
  try {
    body->bytes.resize(desc.payloadLengths[0]);
    alloc.payloads.push_back({body->bytes.data(), body->bytes.size()});
    for (const auto& t : desc.tensors) {
      at::TensorOptions o = at::TensorOptions().dtype(at::kByte);
      if (t.device.type == tp::DeviceType::kCuda) {
        o = o.device(at::Device(at::kCUDA,
                                static_cast<c10::DeviceIndex>(t.device.index)));
      }
      at::Tensor buf = t.device.type == tp::DeviceType::kCpu
                           ? receiveBuffers.take(t.length)
                           : at::empty({static_cast<int64_t>(t.length)}, o);
      alloc.tensors.push_back({buf.data_ptr(), t.length});
      body->tensors.push_back(std::move(buf));
    }
  } catch (...) {
    return bad("cannot allocate the receive buffers: " +
               errorFromCurrentException().message());
  }
  const auto arrived = Clock::now();
  ps->pipe->read(std::move(alloc), [this, ps, env, body,
                                    arrived](const Error& e) {
    if (!e.ok()) {
      onPipeError(ps, e);
      return;
    }
    received.fetch_add(1, std::memory_order_relaxed);
    if (ps->outgoing) {
      auto pc = takePending(env->request_id(), ps.get());
      if (!pc) {
        lateReplies.fetch_add(1, std::memory_order_relaxed);
        TRELLIS_LOG_DEBUG("rpc agent {}: dropping the late reply {} from {}",
                          me.name, env->request_id(),
                          describeWorker(workers[body->from]));
        return;
      }
      if (pc->completeOnLoop) {
        // A blocked rpcSync waits on this future with no callbacks: setting
        // it here wakes the caller directly, one thread hop fewer.
        handleReply(std::move(*pc), *env, std::move(*body));
        return;
      }
      post(*completions,
           [this, env, body,
            pc = std::make_shared<PendingCall>(std::move(*pc))](const Error&) {
             handleReply(std::move(*pc), *env, std::move(*body));
           });
    } else {
      running.fetch_add(1);
      // The reply comes back to this loop from a worker thread within
      // microseconds for most calls: poll for it rather than sleep.
      ctx->beginExpectedWork();
      if (const FunctionEntry* entry = Registry::global().find(env->function());
          entry != nullptr && entry->runOnLoop) {
        handleRequest(ps, env, std::move(*body), arrived);
        return;
      }
      post(*handlers, [this, ps, env, body, arrived](const Error& pe) {
        if (!pe.ok()) {  // pool shut down (closed at once)
          running.fetch_sub(1);
          ctx->endExpectedWork();
          notifyIdle();
          return;
        }
        handleRequest(ps, env, std::move(*body), arrived);
      });
    }
  });
  armRead(ps);
}

void Agent::Impl::onPipeError(const std::shared_ptr<PipeState>& ps,
                              const Error& error) {
  if (ps->failed.exchange(true)) {
    return;
  }
  ps->pipe->close();
  std::vector<uint64_t> ids;
  bool quiet;
  {
    std::lock_guard<std::mutex> lock(mu);
    quiet = stopping;
    if (ps->outgoing) {
      auto it = outPipes.find(ps->peer);
      if (it != outPipes.end() && it->second == ps) {
        outPipes.erase(it);
      }
      for (const auto& [id, pc] : pending) {
        if (pc.pipe == ps.get()) {
          ids.push_back(id);
        }
      }
    } else {
      inPipes.erase(ps);
    }
  }
  const int32_t peer = ps->peer;
  const std::string who = peer >= 0 ? describeWorker(workers[peer])
                                    : "peer " + ps->pipe->peerAddress();
  if (error.code() == Code::kDataLoss ||
      error.code() == Code::kUnauthenticated) {
    TRELLIS_LOG_WARN("rpc agent {}: closing pipe to {}: {}", me.name, who,
                     error.what());
  } else if (!quiet && !ids.empty()) {
    TRELLIS_LOG_INFO("rpc agent {}: pipe to {} failed: {}", me.name, who,
                     error.what());
  }
  for (uint64_t id : ids) {
    failCall(id, error);
  }
}

void Agent::Impl::handleRequest(const std::shared_ptr<PipeState>& ps,
                                std::shared_ptr<pb::Envelope> env, Reply body,
                                Clock::time_point arrived) {
  const FunctionEntry* entry = Registry::global().find(env->function());
  const int64_t profileStartUs = env->profile() ? profilerNowUs() : 0;
  std::shared_ptr<NestedEvents> nested;
  if (env->profile()) {
    nested = std::make_shared<NestedEvents>();
    nested->thread = profilerThreadId();
  }
  auto fail = [&](Error e) {
    respond(ps, *env, makeErrorFuture<AnyValue>(std::move(e)), profileStartUs,
            nested);
  };
  if (env->timeout_us() > 0 &&
      Clock::now() - arrived >
          std::chrono::microseconds(static_cast<int64_t>(env->timeout_us()))) {
    return fail(Error::timeout("'" + env->function() + "' waited on '" +
                               me.name +
                               "' longer than its timeout for a free worker "
                               "thread and was not run"));
  }
  if (entry == nullptr) {
    return fail(Error::notFound("function '" + env->function() +
                                "' is not registered on worker '" + me.name +
                                "'"));
  }
  if (entry->signature != env->signature()) {
    return fail(Error(Code::kFailedPrecondition,
                      "signature mismatch for '" + env->function() +
                          "': the caller and worker '" + me.name +
                          "' were built with different parameter or result "
                          "types"));
  }
  if (env->method_on_rref() != (entry->classTypeId != nullptr)) {
    return fail(Error::invalidArgument(
        "'" + env->function() + "' is " +
        (entry->classTypeId != nullptr ? "a method: call it through an RRef"
                                       : "not a method")));
  }
  const uint64_t autogradContext = env->autograd_context_id();
  std::shared_ptr<GradReceiver> receiver;
  if (autogradContext != 0) {
    if (autograd == nullptr) {
      return fail(Error(Code::kFailedPrecondition,
                        "'" + env->function() +
                            "' was called inside a distributed-autograd "
                            "context, but worker '" +
                            me.name +
                            "' has no dist_autograd support linked "
                            "in"));
    }
    try {
      receiver = autograd->recordRecv(autogradContext, body.from,
                                      env->autograd_message_id());
    } catch (...) {
      return fail(errorFromCurrentException());
    }
  }
  auto context = hooks == nullptr ? nullptr : hooks->makeContext(body.from);
  auto run = [entry, body = std::move(body), autogradContext,
              receiver = std::move(receiver),
              context = std::shared_ptr<CodecContext>(std::move(context)),
              nested](void* target) mutable {
    Decoder dec(body.bytes, std::move(body.tensors), context.get());
    dec.setGradReceiver(receiver.get());
    // Nested calls of the function join the caller's context, and its
    // profile when it is profiled.
    AutogradContextScope scope(autogradContext);
    std::optional<NestedProfileScope> profile;
    if (nested != nullptr) {
      profile.emplace(nested);
    }
    return entry->invoke(dec, target);
  };
  Future<AnyValue> result;
  if (env->method_on_rref()) {
    if (hooks == nullptr) {
      return fail(Error(Code::kFailedPrecondition,
                        "RRef method call, but worker '" + me.name +
                            "' has no RRef support linked in"));
    }
    CallSpec::RRefId id{env->target().rref_worker(),
                        env->target().rref_local()};
    const char* wantType = entry->classTypeId;
    std::string fn = env->function();
    result = hooks->ownerValue(id).then(
        [run = std::move(run), wantType,
         fn](const std::pair<std::shared_ptr<void>, const char*>& v) mutable {
          if (v.second == nullptr || std::strcmp(v.second, wantType) != 0) {
            throwError(
                Error::invalidArgument("method '" + fn +
                                       "' called on an RRef whose value is of "
                                       "another type"));
          }
          // The shared_ptr keeps the object alive while the method runs.
          auto holder = v.first;
          return run(holder.get()).then([holder](const AnyValue& a) {
            return a;
          });
        });
  } else {
    result = run(nullptr);
  }
  if (env->store_result_in_rref()) {
    if (hooks == nullptr) {
      return fail(Error(Code::kFailedPrecondition,
                        "remote() call, but worker '" + me.name +
                            "' has no RRef support linked in"));
    }
    hooks->storeOwnerValue(
        {env->rref().rref_worker(), env->rref().rref_local()},
        {env->rref().fork_worker(), env->rref().fork_local()},
        static_cast<int32_t>(env->from_worker()), result);
    // The reply only confirms (or fails) the creation; no value travels.
    result = result.then([](const AnyValue&) { return AnyValue{}; });
  }
  respond(ps, *env, result, profileStartUs, std::move(nested));
}

void Agent::Impl::respond(const std::shared_ptr<PipeState>& ps,
                          const pb::Envelope& req,
                          const Future<AnyValue>& result,
                          int64_t profileStartUs,
                          std::shared_ptr<NestedEvents> nested) {
  const uint64_t id = req.request_id();
  const int32_t peer = static_cast<int32_t>(req.from_worker());
  const uint64_t autogradContext = req.autograd_context_id();
  std::string function = req.function();
  result.addDoneCallback([this, ps, id, peer, profileStartUs, autogradContext,
                          nested = std::move(nested),
                          function =
                              std::move(function)](const Future<AnyValue>& f) {
    CurrentAgentScope scope(self);
    pb::Envelope env;
    env.set_version(kEnvelopeVersion);
    env.set_kind(pb::Envelope::RESPONSE);
    env.set_request_id(id);
    env.set_from_worker(static_cast<uint32_t>(me.rank));
    if (profileStartUs != 0) {
      auto* ev = env.add_events();
      ev->set_name(function);
      ev->set_worker(me.name);
      ev->set_start_us(profileStartUs);
      ev->set_duration_us(profilerNowUs() - profileStartUs);
      // The thread that started running it; the nested calls' events
      // (recorded before their futures completed) follow.
      ev->set_thread(nested != nullptr ? nested->thread : 0);
      if (nested != nullptr) {
        for (auto& e : nested->take()) {
          auto* n = env.add_events();
          n->set_name(std::move(e.name));
          n->set_worker(std::move(e.worker));
          n->set_start_us(e.startUs);
          n->set_duration_us(e.durationUs);
          n->set_thread(e.thread);
        }
      }
    }
    auto context = hooks == nullptr ? nullptr : hooks->makeContext(peer);
    Encoder body(context.get());
    Error error = f.error();
    if (error.ok()) {
      try {
        const AnyValue& v = f.value();
        if (v.value == nullptr) {
          encodeValue<std::monostate>(body, std::monostate{});
        } else if (v.encode == nullptr) {
          error = Error::invalidArgument(
              "the result of '" + function +
              "' has no wire encoding (declare it serializable, or return it "
              "through remote() and call methods on the RRef)");
        } else {
          v.encode(body, v.value.get());
        }
        if (autogradContext != 0 && !body.gradTensors().empty()) {
          // The result's gradient comes back to this worker's graph.
          env.set_autograd_context_id(autogradContext);
          env.set_autograd_message_id(
              autograd->recordSend(autogradContext, peer, body.gradTensors()));
        }
      } catch (...) {
        error = errorFromCurrentException();
      }
    }
    if (!error.ok()) {
      env.clear_autograd_context_id();
      env.clear_autograd_message_id();
      body = Encoder(context.get());
      encodeValue<std::monostate>(body, std::monostate{});
      auto* info = env.mutable_error();
      info->set_code(static_cast<uint32_t>(error.code()));
      info->set_message(error.message());
      if (const RemoteOrigin* o = error.remoteOrigin();
          o != nullptr && !o->worker.empty()) {
        info->set_worker(o->worker);  // raised further down a nested call
        info->set_function(o->function);
        info->set_exception_type(o->exceptionType);
      } else {
        info->set_worker(me.name);
        info->set_function(function);
        if (o != nullptr) {
          info->set_exception_type(o->exceptionType);
        }
      }
    }
    send(ps, env, std::move(body), std::move(context),
         [this, ps](const Error& e) {
           if (!e.ok()) {
             onPipeError(ps, e);
           }
         });
    ctx->endExpectedWork();
    running.fetch_sub(1);
    notifyIdle();
  });
}

std::optional<PendingCall> Agent::Impl::takePending(uint64_t id,
                                                    const PipeState* pipe) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = pending.find(id);
  if (it == pending.end() || (pipe != nullptr && it->second.pipe != pipe)) {
    return std::nullopt;
  }
  if (it->second.hasTimer) {
    timers.erase(it->second.timer);
  }
  std::optional<PendingCall> pc(std::move(it->second));
  pending.erase(it);
  if (quiescing.load(std::memory_order_acquire)) {
    idleCv.notify_all();  // under mu
  }
  return pc;
}

void Agent::Impl::failLater(PendingCall&& pc, Error error) {
  post(*completions,
       [promise = std::move(pc.promise), e = std::move(error)](
           const Error&) mutable { promise.setError(std::move(e)); });
}

void Agent::Impl::handleReply(PendingCall&& pc, const pb::Envelope& env,
                              Reply body) {
  if (pc.profiled) {
    const int64_t now = profilerNowUs();
    auto record = [&pc](ProfileEvent e) {
      if (pc.nested != nullptr) {
        pc.nested->add(std::move(e));
      } else {
        Profiler::record(std::move(e));
      }
    };
    record(ProfileEvent{
        "rpc#" + pc.function + " " + me.name + " -> " + workers[pc.to].name,
        me.name, pc.startUs, now - pc.startUs, pc.thread});
    for (const auto& ev : env.events()) {
      record(ProfileEvent{ev.name(), ev.worker(), ev.start_us(),
                          ev.duration_us(), ev.thread()});
    }
  }
  if (env.has_error()) {
    const auto& info = env.error();
    RemoteOrigin origin{info.worker(), info.function(), info.exception_type()};
    std::string msg = info.message();
    // The code the callee raised with; one this build does not know (a
    // newer or a hostile peer) reads as UNKNOWN.
    const uint32_t raw = info.code();
    const Code code =
        raw >= 1 && raw <= static_cast<uint32_t>(Code::kUnauthenticated)
            ? static_cast<Code>(raw)
            : Code::kUnknown;
    pc.promise.setError(Error::remote(std::move(origin), std::move(msg), code));
    return;
  }
  body.autogradContextId = env.autograd_context_id();
  body.autogradMessageId = env.autograd_message_id();
  pc.promise.setValue(std::move(body));
}

// ---- timers ----------------------------------------------------------------

void Agent::Impl::timerLoop() {
  tTimerOf = this;
  std::unique_lock<std::mutex> lock(mu);
  while (!closed) {
    if (timers.empty()) {
      timerWakeAt = Clock::time_point::max();
      timerCv.wait(lock);
      continue;
    }
    const auto next = timers.begin()->first;
    if (Clock::now() < next) {
      timerWakeAt = next;
      timerCv.wait_until(lock, next);
      continue;
    }
    std::vector<PendingCall> expired;
    const auto now = Clock::now();
    while (!timers.empty() && timers.begin()->first <= now) {
      const uint64_t id = timers.begin()->second;
      timers.erase(timers.begin());
      auto it = pending.find(id);
      if (it != pending.end()) {
        it->second.hasTimer = false;
        expired.push_back(std::move(it->second));
        pending.erase(it);
      }
    }
    if (!expired.empty() && quiescing.load(std::memory_order_acquire)) {
      idleCv.notify_all();  // under mu
    }
    lock.unlock();
    for (auto& pc : expired) {
      Error e = Error::timeout(
          "rpc of '" + pc.function + "' to " + describeWorker(workers[pc.to]) +
          " timed out after " + formatDuration(pc.timeout));
      failLater(std::move(pc), std::move(e));
    }
    lock.lock();
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
    {
      std::lock_guard<std::mutex> lock(d_.mu);
      c.active = d_.pending.size();
    }
    c.active += d_.running.load();
    c.sent = d_.sent.load();
    c.received = d_.received.load();
    return c;
  }

  void waitIdle(Deadline deadline) override {
    std::unique_lock<std::mutex> lock(d_.mu);
    auto idle = [&] { return d_.pending.empty() && d_.running.load() == 0; };
    if (deadline.isNever()) {
      d_.idleCv.wait(lock, idle);
    } else {
      d_.idleCv.wait_until(lock, deadline.timePoint(), idle);
    }
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
    return describeWorker(d_.workers[rank]);
  }

 private:
  Impl& d_;
  const Duration probeTimeout_;
};

void Agent::Impl::notifyIdle() {
  if (quiescing.load(std::memory_order_acquire)) {
    // Taken and released so that a waiter between its check and its wait
    // cannot miss this notification.
    { std::lock_guard<std::mutex> lock(mu); }
    idleCv.notify_all();
  }
}

void Agent::Impl::gracefulQuiesce(Duration arrivalTimeout,
                                  Duration quiesceTimeout) {
  if (hooks != nullptr) {
    hooks->releaseUsers();
  }
  // Every store operation of the protocol gets the shutdown's bound: a
  // store whose server stopped answering (its host is stopped or hangs)
  // must fail the shutdown in time, not after the store's own timeout. Only
  // for the store this agent made; a user's store keeps its timeout.
  if (ownStore && quiesceTimeout > Duration::zero()) {
    store->setTimeout(
        std::chrono::duration_cast<std::chrono::milliseconds>(quiesceTimeout));
  }
  detail::QuiescenceOptions o;
  o.keyPrefix = kKeyPrefix + "shutdown/";
  o.name = me.name;
  o.rank = me.rank;
  o.worldSize = worldSize;
  o.arrivalTimeout = arrivalTimeout;
  o.quiesceTimeout = quiesceTimeout;
  o.hostsStore = storeServer != nullptr;
  Participant participant(*this, quiesceTimeout);
  quiescing.store(true, std::memory_order_release);
  try {
    detail::runQuiescence(*store, participant, o);
  } catch (const Exception& e) {
    quiescing.store(false);
    const std::string& msg = e.error().message();
    if (msg.rfind("rpc shutdown of", 0) == 0) {
      throw;
    }
    // The store's own error: say which store, and who serves it.
    throwError(Error(e.code(), "rpc shutdown of '" + me.name +
                                   "': " + storeDescription + ": " + msg));
  }
  quiescing.store(false);
  if (hooks != nullptr) {
    auto leaks = hooks->leaks();
    if (!leaks.empty()) {
      std::string list;
      for (size_t i = 0; i < leaks.size() && i < 10; ++i) {
        list += (i ? "; " : "") + leaks[i];
      }
      TRELLIS_LOG_WARN(
          "rpc agent {}: {} RRef value(s) still held at "
          "shutdown: {}",
          me.name, leaks.size(), list);
    }
  }
}

void Agent::Impl::closeAll(const Error& reason) {
  std::vector<uint64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
    for (const auto& [id, pc] : pending) {
      ids.push_back(id);
    }
  }
  for (uint64_t id : ids) {
    failCall(id, reason);
  }
  if (ctx != nullptr) {
    ctx->close();
    if (!ctx->join(std::chrono::seconds(30))) {
      TRELLIS_LOG_ERROR("rpc agent {}: transport loop did not stop in 30 s",
                        me.name);
    }
  }
  handlers->shutdown(ThreadPool::ShutdownMode::kCancel);
  handlers->join();
  completions->shutdown(ThreadPool::ShutdownMode::kDrain);
  completions->join();
  {
    std::lock_guard<std::mutex> lock(mu);
    closed = true;
    outPipes.clear();
    inPipes.clear();
  }
  timerCv.notify_all();
  if (timerThread.joinable()) {
    timerThread.join();
  }
  if (storeServer != nullptr) {
    storeServer->stop();
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
  std::lock_guard<std::mutex> once(d.shutdownMu);
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.closed) {
      return;
    }
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
    std::lock_guard<std::mutex> lock(gProcessMu);
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
    std::lock_guard<std::mutex> lock(gProcessMu);
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
    std::lock_guard<std::mutex> lock(gProcessMu);
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
