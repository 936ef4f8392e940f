// rref/: the owner/user protocol (docs/rref.md) and rref/'s agent
// extension. Over ~600 lines because the protocol's state (RRefContext),
// its message handlers and the RRefState they drive are one state machine
// whose invariants (a fork is confirmed before its parent lets go; a
// delete before its fork leaves a tombstone) read best in one place;
// protocol.{h,cc} holds the pure decoding.

#include <algorithm>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include <trellis/core/check.h>
#include <trellis/core/logging.h>
#include <trellis/core/mutex.h>
#include <trellis/rpc/extension.h>
#include <trellis/rref/protocol.h>
#include <trellis/rref/rref.h>

namespace trellis::rpc {
namespace detail {
namespace {

using Key = std::pair<uint32_t, uint64_t>;
Key keyOf(const RRefId& id) { return {id.worker, id.local}; }
std::string str(const RRefId& id) {
  return "(" + std::to_string(id.worker) + "," + std::to_string(id.local) + ")";
}

// Deletes remembered for forks not seen yet (see addTombstoneLocked).
constexpr size_t kMaxTombstones = size_t{1} << 16;

// Owner values freed on the transport loop at most this big (a tensor's
// storage); a bigger one goes back to the allocator on a worker thread.
constexpr size_t kLoopFreeBytes = size_t{1} << 20;

template <typename T>
bool holds(const AnyValue& v) {
  return v.typeId != nullptr && std::strcmp(v.typeId, typeid(T).name()) == 0;
}

// A number or bool: kCarriedByConfirmation's list (rref.h), at run time.
bool holdsNumber(const AnyValue& v) {
  static_assert(
      kCarriedByConfirmation<bool> && kCarriedByConfirmation<int32_t> &&
      kCarriedByConfirmation<int64_t> && kCarriedByConfirmation<uint32_t> &&
      kCarriedByConfirmation<uint64_t> && kCarriedByConfirmation<float> &&
      kCarriedByConfirmation<double>);
  return holds<bool>(v) || holds<int32_t>(v) || holds<int64_t>(v) ||
         holds<uint32_t>(v) || holds<uint64_t>(v) || holds<float>(v) ||
         holds<double>(v);
}

size_t storageBytes(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().nbytes() : 0;
}

// Whether dropping an owner value's last reference is quick and runs no
// user code, so that a delete handled on the loop may free it there: no
// value, numbers, strings, and tensors of at most kLoopFreeBytes. Anything
// else (a user's object, whose destructor may block or make RPCs; a large
// tensor, whose pages go back to the kernel) is freed on a worker thread.
bool freesQuickly(const AnyValue& v) {
  if (v.value == nullptr) {
    return true;
  }
  if (holds<at::Tensor>(v)) {
    return storageBytes(*static_cast<const at::Tensor*>(v.value.get())) <=
           kLoopFreeBytes;
  }
  if (holds<std::vector<at::Tensor>>(v)) {
    size_t bytes = 0;
    for (const auto& t :
         *static_cast<const std::vector<at::Tensor>*>(v.value.get())) {
      bytes += storageBytes(t);
    }
    return bytes <= kLoopFreeBytes;
  }
  return holdsNumber(v) || holds<std::string>(v);
}

// Whether a remote()'s result rides on its reply: the owner's side of
// kCarriedByConfirmation (rref.h), the same list. Such a value never
// changes, so the copy the creator keeps is always the owner's value.
bool carriedByConfirmation(const AnyValue& v) {
  return v.encode != nullptr && holdsNumber(v);
}

// Names of the protocol's messages; they travel as ordinary requests.
constexpr std::string_view kForkFn = "trellis.rref.fork";
constexpr std::string_view kDeleteFn = "trellis.rref.delete";
constexpr std::string_view kAcceptFn = "trellis.rref.accept";
constexpr std::string_view kFetchFn = "trellis.rref.fetch";

// The value an owner holds for one RRef, and the forks it knows.
struct OwnerEntry {
  Promise<AnyValue> promise;
  Future<AnyValue> value = promise.getFuture();
  bool created = false;  // the remote() request (or a local owner) arrived
  std::set<Key> forks;
  // For leak reports: the worker whose remote() made it, or this one's
  // makeRRef() (origin == -1 once created).
  int32_t origin = -1;
  // The creator's remote() request whose reply has not gone yet: a fetch
  // from the creator that finds it pending answers it too (kClaimed), and
  // its own reply is then not sent (docs/rref.md, "One reply for remote()
  // and toHere()"). Whichever of the two comes first decides, under mu_.
  enum class Confirm : uint8_t { kNone, kPending, kClaimed };
  Confirm confirm = Confirm::kNone;
  uint64_t confirmRequest = 0;
};

class RRefContext;

// What an Encoder/Decoder of a message to/from `peer` carries.
// One per peer, made with the context and handed out as a shared pointer
// that keeps the context alive (RRefContext::codecContext).
class RRefCodecContext : public CodecContext {
 public:
  RRefCodecContext(RRefContext* ctx, int32_t peer) : ctx(ctx), peer(peer) {}
  RRefContext* ctx;
  int32_t peer;
};

// rref/'s agent extension (rpc/extension.h): one per agent, made when the
// agent starts, so that a worker that never calls into rref/ still owns
// the results of remote() calls made to it.
class RRefContext : public AgentExtension,
                    public std::enable_shared_from_this<RRefContext> {
 public:
  explicit RRefContext(Agent& agent) : agent_(&agent) {
    codecs_.reserve(static_cast<size_t>(agent.worldSize()));
    for (int32_t peer = 0; peer < agent.worldSize(); ++peer) {
      codecs_.emplace_back(this, peer);
    }
  }

  std::string_view name() const override { return "RRef"; }
  uint32_t wireId() const override { return kRRefExtension; }

  Agent& agent() const { return *agent_; }
  int32_t rank() const { return agent_->self().rank; }

  RRefId newId() {
    return RRefId{static_cast<uint32_t>(rank()), next_.fetch_add(1)};
  }

  // ---- owner side --------------------------------------------------------

  // A request naming this extension: a method call on an RRef's value
  // and/or a remote() whose result this worker keeps as owner.
  Future<AnyValue> onRequest(ExtensionRequest& request) override {
    const std::string& fn = request.entry->name;
    RRefCall call;
    if (Error e = decodeRRefCall(request.payload, agent_->worldSize(), &call);
        !e.ok()) {
      return makeErrorFuture<AnyValue>(
          Error::protocol("'" + fn + "': " + e.message()));
    }
    if (call.method != (request.entry->classTypeId != nullptr)) {
      return makeErrorFuture<AnyValue>(
          Error::invalidArgument("'" + fn + "' is " +
                                 (request.entry->classTypeId != nullptr
                                      ? "a method: call it through an RRef"
                                      : "not a method")));
    }
    Future<AnyValue> result;
    if (call.method) {
      const char* wantType = request.entry->classTypeId;
      result =
          ownerValue(call.target)
              .then([run = std::move(request.run), wantType,
                     fn](const std::pair<std::shared_ptr<void>, const char*>&
                             v) mutable {
                if (v.second == nullptr ||
                    std::strcmp(v.second, wantType) != 0) {
                  throwError(Error::invalidArgument(
                      "method '" + fn +
                      "' called on an RRef whose value is of "
                      "another type"));
                }
                // The shared_ptr keeps the object alive while the
                // method runs.
                auto holder = v.first;
                return run(holder.get()).then([holder](const AnyValue& a) {
                  return a;
                });
              });
    } else {
      result = request.run(nullptr);
    }
    if (call.storeResult) {
      // A reply that carries nothing but the result may be merged into the
      // reply to the creator's fetch.
      const uint64_t mergeable = request.plainReply ? request.requestId : 0;
      storeOwnerValue(call.rref, call.fork, request.caller, result, mergeable);
      // The reply confirms (or fails) the creation. It carries the value
      // when the creator asked for it and it is a number or bool, which
      // never changes: the creator's toHere() then needs no fetch
      // (docs/rref.md). Only the creator knows that the function made the
      // value (a std::shared_ptr result may be an object it keeps and
      // changes): it asks only then.
      std::weak_ptr<RRefContext> weak = shared_from_this();
      const bool valueInReply = call.valueInReply;
      result = result.then([weak, k = keyOf(call.rref), mergeable,
                            valueInReply](const AnyValue& made) {
        AnyValue confirmation;
        if (mergeable != 0) {
          if (valueInReply && carriedByConfirmation(made)) {
            confirmation.value = made.value;
            confirmation.typeId = made.typeId;
            confirmation.encode = made.encode;
          }
          if (auto self = weak.lock()) {
            confirmation.noReply = !self->takeConfirmation(k);
          }
        }
        return confirmation;
      });
    }
    return result;
  }

  // Callee of remote(): keeps the result (or its error) as owner value.
  // `request`: the remote()'s request id when its reply may be merged into
  // a fetch's (0: it may not).
  void storeOwnerValue(const RRefId& rref, const RRefId& fork, int32_t caller,
                       const Future<AnyValue>& value, uint64_t request) {
    {
      MutexLock lock(mu_);
      OwnerEntry& e = owners_[keyOf(rref)];
      e.created = true;
      e.origin = caller;
      if (request != 0) {
        e.confirm = OwnerEntry::Confirm::kPending;
        e.confirmRequest = request;
      }
      addForkLocked(e, keyOf(fork));
    }
    std::weak_ptr<RRefContext> weak = shared_from_this();
    const Key k = keyOf(rref);
    value.addDoneCallback([weak, k](const Future<AnyValue>& f) {
      auto self = weak.lock();
      if (self == nullptr) {
        return;
      }
      std::optional<Promise<AnyValue>> p;  // no promise of its own
      {
        MutexLock lock(self->mu_);
        auto it = self->owners_.find(k);
        if (it == self->owners_.end()) {
          return;  // every reference went away before the value was made
        }
        p = it->second.promise;
      }
      if (f.hasError()) {
        p->setError(f.error());
      } else {
        p->setValue(f.value());
      }
    });
    maybeFree(keyOf(rref));
  }

  // Callee of a method call: the owner value, once it exists, and its type.
  Future<std::pair<std::shared_ptr<void>, const char*>> ownerValue(
      const RRefId& rref) {
    Future<AnyValue> f;
    {
      MutexLock lock(mu_);
      f = owners_[keyOf(rref)].value;
    }
    return f.then(
        [](const AnyValue& v) { return std::make_pair(v.value, v.typeId); });
  }

  Future<AnyValue> ownerAny(const RRefId& rref) {
    MutexLock lock(mu_);
    return owners_[keyOf(rref)].value;
  }

  // The two sides of one reply for a remote() and its creator's fetch, once
  // the value exists. A fetch from `from` claims the remote()'s pending
  // reply when `from` created the RRef: the remote()'s request id, which
  // the fetch's reply then also answers, or 0. The remote()'s reply takes
  // it back: false when a fetch claimed it (no reply is sent).
  uint64_t claimConfirmation(const RRefId& rref, int32_t from) {
    if (from < 0 || static_cast<uint32_t>(from) != rref.worker) {
      return 0;  // only the creator made the remote()
    }
    MutexLock lock(mu_);
    auto it = owners_.find(keyOf(rref));
    if (it == owners_.end() ||
        it->second.confirm != OwnerEntry::Confirm::kPending) {
      return 0;
    }
    it->second.confirm = OwnerEntry::Confirm::kClaimed;
    return it->second.confirmRequest;
  }
  bool takeConfirmation(const Key& k) {
    MutexLock lock(mu_);
    auto it = owners_.find(k);
    if (it == owners_.end()) {
      return true;
    }
    const bool claimed = it->second.confirm == OwnerEntry::Confirm::kClaimed;
    it->second.confirm = OwnerEntry::Confirm::kNone;
    return !claimed;
  }

  void createLocal(const RRefId& rref, AnyValue value) {
    std::optional<Promise<AnyValue>> p;
    {
      MutexLock lock(mu_);
      OwnerEntry& e = owners_[keyOf(rref)];
      e.created = true;
      addForkLocked(e, keyOf(rref));
      p = e.promise;
    }
    p->setValue(std::move(value));
  }

  void addFork(const RRefId& rref, const RRefId& fork) {
    MutexLock lock(mu_);
    addForkLocked(owners_[keyOf(rref)], keyOf(fork));
  }

  // Idempotent; deleting a fork the owner has not seen yet (its fork request
  // is still on a handler thread) leaves a tombstone that cancels it.
  void removeFork(const RRefId& rref, const RRefId& fork) {
    {
      MutexLock lock(mu_);
      auto it = owners_.find(keyOf(rref));
      if (it == owners_.end() || it->second.forks.erase(keyOf(fork)) == 0) {
        addTombstoneLocked(keyOf(fork));
      }
    }
    maybeFree(keyOf(rref));
  }

  // ---- user side ---------------------------------------------------------

  void registerUser(const std::shared_ptr<RRefState>& s) {
    MutexLock lock(mu_);
    users_[keyOf(s->fork())] = s;
  }
  void forgetUser(const RRefId& fork) {
    MutexLock lock(mu_);
    users_.erase(keyOf(fork));
  }
  void holdParent(const RRefId& child, std::shared_ptr<RRefState> parent) {
    MutexLock lock(mu_);
    pendingChildren_[keyOf(child)] = std::move(parent);
  }
  void childAccepted(const RRefId& child) {
    std::shared_ptr<RRefState> parent;  // released after the lock
    {
      MutexLock lock(mu_);
      auto it = pendingChildren_.find(keyOf(child));
      if (it == pendingChildren_.end()) {
        return;
      }
      parent = std::move(it->second);
      pendingChildren_.erase(it);
    }
  }

  // Sends one protocol message (a fork, whose reply confirms the new
  // holder).
  Future<Reply> send(int32_t to, std::string_view fn, const RRefId& a,
                     const RRefId& b) {
    return agent_->call(to, protocolSpec(fn), encodeIds(a, b));
  }

  // Sends one protocol message nobody needs an answer to (an accept, a
  // delete): one-way, so the receiver sends none and this worker does not
  // wake for one. The future fails only when it cannot be written.
  Future<Reply> notify(int32_t to, std::string_view fn, const RRefId& a,
                       const RRefId& b) {
    CallSpec spec = protocolSpec(fn);
    spec.oneWay = true;
    return agent_->call(to, spec, encodeIds(a, b));
  }

  static Encoder encodeIds(const RRefId& a, const RRefId& b) {
    Encoder e;
    encodeArgs(e, a.worker, a.local, b.worker, b.local);
    return e;
  }

  static CallSpec protocolSpec(std::string_view fn) {
    CallSpec spec;
    spec.function = fn;
    spec.signature = protocolSignature(fn);
    spec.recordAutograd = false;
    return spec;
  }

  // Computed once per name: every message of the protocol carries one.
  static uint64_t protocolSignature(std::string_view fn) {
    auto of = [](std::string_view name) {
      return signatureFingerprint<std::monostate, uint32_t, uint64_t, uint32_t,
                                  uint64_t>(name);
    };
    static const uint64_t kFork = of(kForkFn);
    static const uint64_t kDelete = of(kDeleteFn);
    static const uint64_t kAccept = of(kAcceptFn);
    return fn == kForkFn     ? kFork
           : fn == kDeleteFn ? kDelete
           : fn == kAcceptFn ? kAccept
                             : of(fn);
  }

  void dropFork(const RRefId& id, const RRefId& fork, int32_t owner) {
    forgetUser(fork);
    if (owner == rank()) {
      removeFork(id, fork);
      return;
    }
    if (agent_->isShutDown()) {
      return;
    }
    auto f = notify(owner, kDeleteFn, id, fork);
    f.addDoneCallback([id, fork](const Future<Reply>& r) {
      if (r.hasError()) {
        TRELLIS_LOG_DEBUG("RRef {} fork {}: deletion not sent: {}", str(id),
                          str(fork), r.error().what());
      }
    });
  }

  // ---- hooks -------------------------------------------------------------

  // A message's context: the peer's, sharing ownership of this context
  // (no allocation). A rank outside the group (a call that will fail on
  // it) gets one of its own.
  std::shared_ptr<CodecContext> codecContext(int32_t peer) override {
    if (peer >= 0 && static_cast<size_t>(peer) < codecs_.size()) {
      return std::shared_ptr<CodecContext>(shared_from_this(),
                                           &codecs_[static_cast<size_t>(peer)]);
    }
    struct Lone : RRefCodecContext {
      Lone(std::shared_ptr<RRefContext> keep, int32_t peer)
          : RRefCodecContext(keep.get(), peer), keep(std::move(keep)) {}
      std::shared_ptr<RRefContext> keep;
    };
    return std::make_shared<Lone>(shared_from_this(), peer);
  }

  // Graceful shutdown: releases this worker's user references.
  void beforeQuiescence() override {
    std::map<Key, std::shared_ptr<RRefState>> children;
    std::vector<std::shared_ptr<RRefState>> live;
    {
      MutexLock lock(mu_);
      children.swap(pendingChildren_);
      for (auto& [k, w] : users_) {
        if (auto s = w.lock()) {
          live.push_back(std::move(s));
        }
      }
    }
    for (auto& s : live) {
      s->release();
    }
    children.clear();
    live.clear();
  }

  std::vector<std::string> leaks() override {
    std::vector<std::string> out;
    MutexLock lock(mu_);
    for (const auto& [k, e] : owners_) {
      out.push_back(
          "RRef " + str(RRefId{k.first, k.second}) + " with " +
          std::to_string(e.forks.size()) + " fork(s), " +
          (!e.created ? std::string("never created")
           : e.origin >= 0
               ? "created by remote() from " + agent_->workerInfo(e.origin).name
               : "created by makeRRef() on " + agent_->self().name));
    }
    return out;
  }

  size_t ownedCount() {
    MutexLock lock(mu_);
    return owners_.size();
  }
  size_t userCount() {
    MutexLock lock(mu_);
    size_t n = 0;
    for (const auto& [k, w] : users_) {
      n += w.expired() ? 0 : 1;
    }
    return n;
  }

 private:
  // Bounded: a delete whose fork never arrives (a peer that died between
  // the two, or one that sends garbage) must not grow this forever. The
  // oldest go first; a fork arrives within a round trip of its delete.
  void addTombstoneLocked(const Key& fork) TRELLIS_REQUIRES(mu_) {
    if (tombstones_.insert(fork).second) {
      tombstoneOrder_.push_back(fork);
      if (tombstoneOrder_.size() > kMaxTombstones) {
        tombstones_.erase(tombstoneOrder_.front());
        tombstoneOrder_.pop_front();
      }
    }
  }

  void addForkLocked(OwnerEntry& e, const Key& fork) TRELLIS_REQUIRES(mu_) {
    if (tombstones_.erase(fork) == 0) {
      e.forks.insert(fork);
    }
  }

  void maybeFree(const Key& k) {
    std::optional<OwnerEntry> dead;  // the value dies outside the lock
    {
      MutexLock lock(mu_);
      auto it = owners_.find(k);
      if (it == owners_.end() || !it->second.created ||
          !it->second.forks.empty()) {
        return;
      }
      dead.emplace(std::move(it->second));
      owners_.erase(it);
    }
    TRELLIS_LOG_DEBUG("RRef {}: last reference gone, value freed",
                      str(RRefId{k.first, k.second}));
    if (agent_->onLoopThread() && dead->value.hasValue() &&
        !freesQuickly(dead->value.value())) {
      // A delete runs on the loop, where nothing may block: the value
      // dies on a worker (at once, here, when the pool is closed).
      agent_->runOnWorkerThread([dead = std::move(dead)](const Error&) {});
    }
  }

  Agent* agent_;
  // codecContext()'s, by peer rank; fixed after construction.
  std::vector<RRefCodecContext> codecs_;
  std::atomic<uint64_t> next_{1};
  Mutex mu_;
  std::map<Key, OwnerEntry> owners_ TRELLIS_GUARDED_BY(mu_);
  // Forks deleted before their addition arrived; fork ids are unique in the
  // group, so the fork alone is the key.
  std::set<Key> tombstones_ TRELLIS_GUARDED_BY(mu_);
  std::deque<Key> tombstoneOrder_ TRELLIS_GUARDED_BY(mu_);
  std::map<Key, std::weak_ptr<RRefState>> users_ TRELLIS_GUARDED_BY(mu_);
  std::map<Key, std::shared_ptr<RRefState>> pendingChildren_
      TRELLIS_GUARDED_BY(mu_);
};

RRefContext& contextOf(Agent& agent) {
  auto* context = agent.extension<RRefContext>();
  if (context == nullptr) {
    throwError(Error(Code::kFailedPrecondition,
                     "agent '" + agent.self().name +
                         "' has no RRef support (link trellis::rref)"));
  }
  return *context;
}

// ---- protocol handlers (run on the owner / parent's worker threads) --------

// Each runs on the worker a message names, with the ids decoded and
// checked against the group (protocol.h); a malformed message is the
// caller's RemoteError and changes nothing here.
Future<AnyValue> handleFork(Decoder& d, void*) {
  Agent& agent = Agent::current();
  RRefId rref, fork;
  if (Error e = decodeTwoIds(d, agent.worldSize(), &rref, &fork); !e.ok()) {
    return makeErrorFuture<AnyValue>(e);
  }
  contextOf(agent).addFork(rref, fork);
  return makeReadyFuture(AnyValue{});
}

Future<AnyValue> handleDelete(Decoder& d, void*) {
  Agent& agent = Agent::current();
  RRefId rref, fork;
  if (Error e = decodeTwoIds(d, agent.worldSize(), &rref, &fork); !e.ok()) {
    return makeErrorFuture<AnyValue>(e);
  }
  contextOf(agent).removeFork(rref, fork);
  return makeReadyFuture(AnyValue{});
}

Future<AnyValue> handleAccept(Decoder& d, void*) {
  Agent& agent = Agent::current();
  RRefId child, unused;
  if (Error e = decodeTwoIds(d, agent.worldSize(), &child, &unused); !e.ok()) {
    return makeErrorFuture<AnyValue>(e);
  }
  contextOf(agent).childAccepted(child);
  return makeReadyFuture(AnyValue{});
}

Future<AnyValue> handleFetch(Decoder& d, void*) {
  Agent& agent = Agent::current();
  RRefId id;
  std::string type;
  if (Error e = decodeFetch(d, agent.worldSize(), &id, &type); !e.ok()) {
    return makeErrorFuture<AnyValue>(e);
  }
  const auto* codec = dynamic_cast<RRefCodecContext*>(d.context());
  const int32_t from = codec != nullptr ? codec->peer : -1;
  RRefContext& ctx = contextOf(agent);
  std::weak_ptr<RRefContext> weak = ctx.shared_from_this();
  return ctx.ownerAny(id).then([type, weak, id, from](const AnyValue& v) {
    if (v.typeId == nullptr || type != v.typeId) {
      throwError(Error::invalidArgument(
          "toHere(): the RRef's value has another type than the "
          "caller's RRef<T>"));
    }
    AnyValue out = v;
    if (auto self = weak.lock()) {
      out.alsoAnswers = self->claimConfirmation(id, from);
    }
    return out;
  });
}

uint64_t fetchSignature() {
  static const uint64_t kSignature =
      signatureFingerprint<std::monostate, uint32_t, uint64_t, std::string>(
          kFetchFn);
  return kSignature;
}

bool registerProtocol() {
  auto add = [](std::string_view name, uint64_t sig,
                Future<AnyValue> (*fn)(Decoder&, void*), bool onLoop) {
    FunctionEntry e;
    e.name = std::string(name);
    e.signature = sig;
    e.invoke = fn;
    e.runOnLoop = onLoop;
    Registry::global().add(std::move(e));
  };
  // Forks, fetches and deletes only touch the context's tables (a fetch
  // chains on the owner value's future; a delete that frees a value whose
  // destruction may block hands it to a worker, maybeFree), so they run on
  // the transport loop (docs/rref.md). Accepts stay on a worker thread: one
  // may drop a parent's last handle, whose release sends a delete or frees
  // a local owner value.
  add(kForkFn, RRefContext::protocolSignature(kForkFn), &handleFork, true);
  add(kDeleteFn, RRefContext::protocolSignature(kDeleteFn), &handleDelete,
      true);
  add(kAcceptFn, RRefContext::protocolSignature(kAcceptFn), &handleAccept,
      false);
  add(kFetchFn, fetchSignature(), &handleFetch, true);
  registerExtension<RRefContext>();
  return true;
}

[[maybe_unused]] const bool kRegistered = registerProtocol();

}  // namespace

// ---- RRefState
// ---------------------------------------------------------------

RRefState::RRefState(std::weak_ptr<Agent> agent, RRefId id, RRefId fork,
                     int32_t owner, const char* typeId)
    : agent_(std::move(agent)),
      id_(id),
      fork_(fork),
      owner_(owner),
      typeId_(typeId) {}

RRefState::~RRefState() {
  if (released_.exchange(true)) {
    return;
  }
  try {
    if (auto a = agent_.lock()) {
      contextOf(*a).dropFork(id_, fork_, owner_);
    }
  } catch (...) {
    TRELLIS_LOG_DEBUG("RRef {}: release at destruction failed: {}", str(id_),
                      errorFromCurrentException().what());
  }
}

bool RRefState::isOwner() const {
  auto a = agent_.lock();
  return a != nullptr && a->self().rank == owner_;
}

std::shared_ptr<Agent> RRefState::agent() const {
  auto a = agent_.lock();
  if (a == nullptr) {
    throwError(Error(Code::kFailedPrecondition,
                     "RRef " + str(id_) + ": its RPC agent is gone"));
  }
  return a;
}

void RRefState::confirm(const Error& error) {
  if (error.ok()) {
    confirmed_.setValue();
  } else {
    confirmed_.setError(error);
  }
}

void RRefState::confirmCreated(const Future<Reply>& reply) {
  if (reply.hasError()) {
    confirm(reply.error());
    return;
  }
  if (expectsValue_ && !reply.value().bytes.empty()) {
    created_ = reply.value();
  }
  confirm(Error());
}

void RRefState::release() {
  if (released_.exchange(true)) {
    return;
  }
  if (auto a = agent_.lock()) {
    contextOf(*a).dropFork(id_, fork_, owner_);
  }
}

std::shared_ptr<RRefState> makeCreatorState(Agent& agent, int32_t owner,
                                            const char* typeId) {
  RRefContext& ctx = contextOf(agent);
  const RRefId id = ctx.newId();
  auto state = std::make_shared<RRefState>(agent.weak_from_this(), id, id,
                                           owner, typeId);
  ctx.registerUser(state);
  return state;
}

std::shared_ptr<RRefState> makeLocalOwnerState(Agent& agent, AnyValue value) {
  RRefContext& ctx = contextOf(agent);
  const RRefId id = ctx.newId();
  auto state = std::make_shared<RRefState>(agent.weak_from_this(), id, id,
                                           agent.self().rank, value.typeId);
  ctx.createLocal(id, std::move(value));
  ctx.registerUser(state);
  state->confirm(Error());
  return state;
}

std::shared_ptr<void> localValueOf(const RRefState& state, Duration timeout) {
  auto agent = state.agent();
  if (agent->self().rank != state.owner()) {
    throwError(Error(Code::kFailedPrecondition,
                     "localValue() of RRef " + str(state.id()) + " on '" +
                         agent->self().name + "', but its owner is '" +
                         agent->workerInfo(state.owner()).name +
                         "': use toHere()"));
  }
  const AnyValue& v = contextOf(*agent)
                          .ownerAny(state.id())
                          .wait(Deadline::fromTimeout(timeout));
  if (v.typeId == nullptr || std::strcmp(v.typeId, state.typeId()) != 0) {
    throwError(Error::invalidArgument("localValue(): RRef " + str(state.id()) +
                                      " holds another type"));
  }
  return v.value;
}

std::optional<Reply> createdValueOf(const std::shared_ptr<RRefState>& state,
                                    std::optional<Duration>* timeout) {
  if (!state->expectsValue()) {
    return std::nullopt;
  }
  auto agent = state->agent();
  const Duration limit =
      timeoutOr(*timeout, agent->options().defaultTimeout, "toHere timeout");
  const Deadline deadline = Deadline::fromTimeout(limit);
  const Future<void> confirmed = state->confirmed();
  if (deadline.isNever()) {
    while (!confirmed.waitFor(std::chrono::hours(1))) {
    }
  } else if (!confirmed.waitFor(deadline.remaining())) {
    throwError(Error(Code::kDeadlineExceeded,
                     "toHere() of RRef " + str(state->id()) +
                         ": the remote() that makes the value on owner '" +
                         agent->workerInfo(state->owner()).name +
                         "' timed out after " + formatDuration(limit)));
  } else {
    *timeout = std::max(deadline.remaining(), Duration(1));
  }
  if (confirmed.hasError() &&
      confirmed.error().code() == Code::kDeadlineExceeded) {
    // The remote() itself timed out, as torch's to_here() reports after
    // one. Its timer started before this wait, with the same default, so
    // a fetch would have next to no time left and time out again.
    throwError(
        confirmed.error().withContext("toHere() of RRef " + str(state->id())));
  }
  if (confirmed.hasError() || state->createdValue().bytes.empty()) {
    // The owner's error comes back from the fetch as it always did.
    return std::nullopt;
  }
  return state->createdValue();
}

Future<Reply> fetchValue(const std::shared_ptr<RRefState>& state,
                         std::optional<Duration> timeout) {
  auto agent = state->agent();
  Encoder e;
  encodeArgs(e, state->id().worker, state->id().local,
             std::string(state->typeId()));
  CallSpec spec;
  spec.function = kFetchFn;
  spec.signature = fetchSignature();
  spec.timeout = timeout;
  // The callback below only hands the reply on to the promise, whose one
  // waiter is toHere()'s thread: the loop may run it (CallSpec).
  spec.completeOnLoop = true;
  // Keeps this fork alive until the value has arrived, and says what the
  // failed call was for.
  Promise<Reply> promise;
  auto out = promise.getFuture();
  agent->call(state->owner(), spec, std::move(e))
      .addDoneCallback([state, promise](const Future<Reply>& f) mutable {
        if (f.hasError()) {
          promise.setError(
              f.error().withContext("toHere() of RRef " + str(state->id())));
        } else {
          promise.setValue(f.value());
        }
      });
  return out;
}

void encodeRRef(Encoder& e, const std::shared_ptr<RRefState>& state) {
  auto* c = dynamic_cast<RRefCodecContext*>(e.context());
  if (c == nullptr || state == nullptr) {
    throwError(Error::invalidArgument(
        state == nullptr ? "cannot send an empty RRef"
                         : "an RRef can only travel as an RPC argument or "
                           "result"));
  }
  RRefContext& ctx = *c->ctx;
  const RRefId child = ctx.newId();
  encodeRRefWire(e, {state->id(), state->owner(), child}, state->typeId());
  // Undone if the message never goes (Encoder::onUnsent): the owner would
  // keep a fork nobody holds, or this worker a hold nobody releases, and
  // the value would live until shutdown reported it as a leak.
  std::shared_ptr<RRefContext> keep = ctx.shared_from_this();
  if (state->owner() == ctx.rank()) {
    ctx.addFork(state->id(), child);
    e.onUnsent([keep = std::move(keep), id = state->id(), child] {
      keep->removeFork(id, child);
    });
  } else {
    ctx.holdParent(child, state);
    e.onUnsent([keep = std::move(keep), child] { keep->childAccepted(child); });
  }
}

std::shared_ptr<RRefState> decodeRRef(Decoder& d, const char* typeId) {
  auto* c = dynamic_cast<RRefCodecContext*>(d.context());
  if (c == nullptr) {
    d.fail("RRef", "an RRef can only be decoded by the RPC agent");
    return nullptr;
  }
  RRefContext& ctx = *c->ctx;
  RRefWire w;
  if (!decodeRRefWire(d, ctx.agent().worldSize(), typeId, &w)) {
    return nullptr;
  }
  const RRefId id = w.id;
  const RRefId child = w.child;
  const int32_t owner = w.owner;
  const int32_t parent = c->peer;
  const int32_t me = ctx.rank();
  auto state = std::make_shared<RRefState>(ctx.agent().weak_from_this(), id,
                                           child, owner, typeId);
  ctx.registerUser(state);
  if (me == owner) {
    ctx.addFork(id, child);
    state->confirm(Error());
    if (parent != owner) {
      (void)ctx.notify(parent, kAcceptFn, child, child);
    }
  } else if (parent == owner) {
    state->confirm(Error());  // the owner added this fork when it sent it
  } else {
    std::weak_ptr<RRefState> weak = state;
    std::weak_ptr<RRefContext> wctx = ctx.shared_from_this();
    ctx.send(owner, kForkFn, id, child)
        .addDoneCallback([weak, wctx, parent, child](const Future<Reply>& f) {
          if (auto s = weak.lock()) {
            s->confirm(f.error());
          }
          if (auto cx = wctx.lock();
              cx != nullptr && !cx->agent().isShutDown()) {
            (void)cx->notify(parent, kAcceptFn, child, child);
          }
        });
  }
  return state;
}

void ensureRRefSupport(Agent& agent) { (void)contextOf(agent); }

void setMethodTarget(CallSpec& spec, const RRefId& target) {
  RRefCall call;
  call.method = true;
  call.target = target;
  spec.extension = kRRefExtension;
  spec.extensionPayload = encodeRRefCall(call);
}

void setStoreResult(CallSpec& spec, const RRefId& rref, const RRefId& fork,
                    bool valueInReply) {
  RRefCall call;
  if (spec.extension == kRRefExtension) {
    // A method call made before: keep its target. Our own bytes.
    TRELLIS_CHECK(decodeRRefCall(spec.extensionPayload,
                                 std::numeric_limits<int32_t>::max(), &call)
                      .ok(),
                  "RRef call payload");
  }
  call.storeResult = true;
  call.rref = rref;
  call.fork = fork;
  call.valueInReply = valueInReply;
  spec.extension = kRRefExtension;
  spec.extensionPayload = encodeRRefCall(call);
}

}  // namespace detail

size_t ownedRRefCount(Agent& agent) {
  return detail::contextOf(agent).ownedCount();
}
size_t userRRefCount(Agent& agent) {
  return detail::contextOf(agent).userCount();
}

}  // namespace trellis::rpc
