#pragma once

// RRef<T>: a reference to a value that lives on one worker, its owner
// (docs/rref.md has the protocol as a state machine, message by message).
//
//   auto server = rpc::remote<makeServer>("ps", 100000, 64);   // RRef<Server>
//   auto rows = server.rpcSync<&Server::lookup>(ids, offsets);
//   auto copy = rpc::remote<makeTensor>("ps").toHere();
//
// Contract
//  - The owner keeps the value while any reference to it exists on any
//    worker. Every worker's reference is a "fork" the owner knows by id.
//    Sending an RRef to another worker makes a child fork; the sender keeps
//    its own fork alive until the owner has confirmed the child, so the
//    value cannot be freed while a reference is in flight. When the last
//    RRef<T> handle for a fork goes away, a deletion message goes to the
//    owner (acknowledged, idempotent); when the owner has no fork left, it
//    frees the value, exactly then.
//  - remote() returns at once; the RRef is confirmedByOwner() once the
//    owner's reply to remote() (or to the fork request) has arrived, which
//    may be after a toHere() or method call on it has already succeeded. If the
//    function fails, toHere() and method calls fail with that error.
//  - toHere(timeout) copies the value here (T must be serializable);
//    localValue() is the value itself, on the owner only (a
//    FailedPreconditionError elsewhere).
//  - A number or bool in an RRef never changes: no method runs on it, and
//    localValue() gives it const. So the owner's reply to remote() carries
//    it, and the creator's toHere() returns it with no message of its own
//    (docs/rref.md, "Numbers travel with the confirmation").
//  - A std::shared_ptr<T> result makes an RRef<T> (so objects that cannot
//    be copied, such as modules, can live in an RRef); any other result R
//    makes an RRef<R>.
//  - Graceful rpc::shutdown() releases this worker's references; values an
//    owner still holds after the whole group is idle are reported as leaks
//    (count, ids, type, the function that created them).
//  - Thread safety: RRef<T> handles are values; copy them freely between
//    threads.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>

#include <trellis/core/deadline.h>
#include <trellis/core/future.h>
#include <trellis/rpc/agent.h>
#include <trellis/rpc/autograd_hooks.h>
#include <trellis/rpc/codec.h>
#include <trellis/rpc/registry.h>
#include <trellis/rpc/rpc.h>
#include <trellis/rref/rref_id.h>

namespace trellis::rpc {

namespace detail {

// The value types an RRef holds unchanged for its whole life, small enough
// to ride on the owner's reply to remote() (docs/rref.md, "Numbers travel
// with the confirmation"). rref.cc's carriedByConfirmation() names the
// same list for the owner's side.
template <typename T>
inline constexpr bool kCarriedByConfirmation =
    std::is_same_v<T, bool> || std::is_same_v<T, int32_t> ||
    std::is_same_v<T, int64_t> || std::is_same_v<T, uint32_t> ||
    std::is_same_v<T, uint64_t> || std::is_same_v<T, float> ||
    std::is_same_v<T, double>;

// The state behind every RRef<T> handle of one fork on one worker.
class RRefState {
 public:
  RRefState(std::weak_ptr<Agent> agent, RRefId id, RRefId fork, int32_t owner,
            const char* typeId);
  ~RRefState();
  RRefState(const RRefState&) = delete;
  RRefState& operator=(const RRefState&) = delete;

  const RRefId& id() const { return id_; }
  const RRefId& fork() const { return fork_; }
  int32_t owner() const { return owner_; }
  bool isOwner() const;
  const char* typeId() const { return typeId_; }
  std::shared_ptr<Agent> agent() const;

  // Completes once the owner knows this fork (or with the creation error).
  Future<void> confirmed() const { return confirmed_.getFuture(); }
  void confirm(const Error& error);
  // The creator's reference made by remote(): confirmed by `reply`, which
  // carries the value when it is a number or bool (expectValue() was
  // called before the remote() went).
  void expectValue() { expectsValue_ = true; }
  bool expectsValue() const { return expectsValue_; }
  void confirmCreated(const Future<Reply>& reply);
  // The value the reply to remote() carried; empty bytes when it carried
  // none. Read only once confirmed() has completed without error.
  const Reply& createdValue() const { return created_; }

  // Graceful shutdown: sends the deletion now; the destructor then sends
  // nothing. Idempotent.
  void release();

 private:
  std::weak_ptr<Agent> agent_;
  RRefId id_;
  RRefId fork_;
  int32_t owner_;
  const char* typeId_;
  Promise<void> confirmed_;
  // Set before the remote() is sent; created_ is written once, before
  // confirmed_ completes, and read only after (the promise orders the two).
  bool expectsValue_ = false;
  Reply created_;
  std::atomic<bool> released_{false};
};

std::shared_ptr<RRefState> makeCreatorState(Agent& agent, int32_t owner,
                                            const char* typeId);
// An owner reference to a value this worker already has.
std::shared_ptr<RRefState> makeLocalOwnerState(Agent& agent, AnyValue value);
// Owner value of `state` (owner only) as the erased pointer; throws.
std::shared_ptr<void> localValueOf(const RRefState& state, Duration timeout);
// The value the creator's reply to remote() carried (a number or bool:
// RRefState::expectValue), once that reply is here; waits for it up to
// `*timeout` (unset: the agent's default call timeout; zero: no limit) and
// leaves in `*timeout` what is left of it. Empty when the reply carried
// none (an owner that sends none, a profiled remote()) or failed: then
// fetch. Throws TimeoutError when the reply does not come in time, and the
// remote()'s own TimeoutError when it timed out.
std::optional<Reply> createdValueOf(const std::shared_ptr<RRefState>& state,
                                    std::optional<Duration>* timeout);
// Fetches the owner's value encoded; decode as T. The future completes on
// the transport loop: wait on it, never chain work on it.
Future<Reply> fetchValue(const std::shared_ptr<RRefState>& state,
                         std::optional<Duration> timeout);
void encodeRRef(Encoder& e, const std::shared_ptr<RRefState>& state);
std::shared_ptr<RRefState> decodeRRef(Decoder& d, const char* typeId);
// Throws FailedPreconditionError when `agent` has no RRef extension.
void ensureRRefSupport(Agent& agent);
// What rref/'s agent extension adds to a request (rpc/extension.h): run a
// method on the owner value of `target`; keep the result as the owner
// value of `rref`, `fork` being the caller's user reference. The two
// combine (a method's result kept in a new RRef).
void setMethodTarget(CallSpec& spec, const RRefId& target);
// `valueInReply`: the creator takes a number or bool in the reply
// (RRefState::expectValue).
void setStoreResult(CallSpec& spec, const RRefId& rref, const RRefId& fork,
                    bool valueInReply);

}  // namespace detail

template <typename T>
class RRef {
 public:
  RRef() = default;
  explicit RRef(std::shared_ptr<detail::RRefState> state,
                std::optional<Duration> timeout = std::nullopt)
      : state_(std::move(state)), timeout_(timeout) {}

  bool valid() const { return state_ != nullptr; }
  int32_t owner() const { return state_->owner(); }
  std::string ownerName() const {
    return state_->agent()->workerInfo(state_->owner()).name;
  }
  bool isOwner() const { return state_->isOwner(); }
  bool confirmedByOwner() const {
    auto f = state_->confirmed();
    return f.completed() && !f.hasError();
  }
  // Waits until the owner confirmed this reference; throws the creation
  // error (e.g. the RemoteError of a failed remote()).
  // Unset or zero: no limit.
  void waitConfirmed(std::optional<Duration> timeout = std::nullopt) const {
    state_->confirmed().wait(Deadline::fromTimeout(
        timeoutOr(timeout, Duration::zero(), "waitConfirmed timeout")));
  }
  // (creator worker, counter): unique in the group.
  RRefId id() const { return state_->id(); }

  // A handle whose proxy calls and toHere() use `timeout` by default.
  template <typename Rep, typename Period>
  RRef withTimeout(std::chrono::duration<Rep, Period> timeout) const {
    return RRef(state_, std::chrono::duration_cast<Duration>(timeout));
  }

  // Copies the value here. `timeout` unset: the handle's (withTimeout),
  // else the agent's default call timeout; zero: none.
  T toHere(std::optional<Duration> timeout = std::nullopt) const {
    static_assert(kIsSerializable<T>,
                  "toHere() copies the value: its type needs a Codec");
    std::optional<Duration> t = timeout.has_value() ? timeout : timeout_;
    if (isOwner()) {
      return *localValue(t);
    }
    std::optional<detail::Reply> created;
    if constexpr (detail::kCarriedByConfirmation<T>) {
      created = detail::createdValueOf(state_, &t);
    }
    const detail::Reply reply = created.has_value()
                                    ? std::move(*created)
                                    : detail::fetchValue(state_, t).wait();
    auto agent = state_->agent();
    auto context = agent->codecContext(reply.from);
    auto receiver = agent->gradReceiver(reply);
    Decoder d(reply.bytes, reply.tensors, context.get());
    d.setGradReceiver(receiver.get());
    T value = decodeValue<T>(d);
    throwIfError(d.finish());
    return value;
  }

  // The value itself; owner only. Waits for it to exist (a remote() still
  // running here) up to `timeout`; unset or zero: no limit. Const for a
  // number or bool, which never changes (kCarriedByConfirmation).
  using LocalValue =
      std::conditional_t<detail::kCarriedByConfirmation<T>, const T, T>;
  std::shared_ptr<LocalValue> localValue(
      std::optional<Duration> timeout = std::nullopt) const {
    return std::static_pointer_cast<LocalValue>(detail::localValueOf(
        *state_, timeoutOr(timeout, Duration::zero(), "localValue timeout")));
  }

  template <auto M, typename... A>
  Future<detail::ResultOf<M>> rpcAsync(A&&... args) const {
    return detail::decodeReply<detail::ResultOf<M>>(
        sendMethod<M>(methodSpec<M>(), std::forward<A>(args)...),
        *state_->agent());
  }

  // rpcAsync whose reply completes the future on the transport loop
  // thread, so the future's callbacks run there, one thread hand-off fewer
  // than rpcAsync. Only for callbacks that are short and never block (the
  // library's own calls: DistributedOptimizer's step); a callback that
  // waits stalls every pipe of the loop.
  template <auto M, typename... A>
  Future<detail::ResultOf<M>> rpcAsyncOnLoop(A&&... args) const {
    detail::CallSpec spec = methodSpec<M>();
    spec.completeOnLoop = true;
    return detail::decodeReply<detail::ResultOf<M>>(
        sendMethod<M>(spec, std::forward<A>(args)...), *state_->agent());
  }

  template <auto M, typename... A>
  detail::ResultOf<M> rpcSync(A&&... args) const {
    detail::CallSpec spec = methodSpec<M>();
    spec.completeOnLoop = true;  // this thread decodes the reply itself
    auto reply = sendMethod<M>(spec, std::forward<A>(args)...);
    return detail::decodeReplyHere<detail::ResultOf<M>>(reply.wait(),
                                                        *state_->agent());
  }

  // Runs the method on the owner and keeps its result there.
  template <auto M, typename... A>
  auto remote(A&&... args) const;

  const std::shared_ptr<detail::RRefState>& state() const { return state_; }

 private:
  template <auto M>
  detail::CallSpec methodSpec() const {
    static_assert(std::is_base_of_v<typename detail::Traits<M>::Class, T>,
                  "this method belongs to another class than the RRef's");
    detail::CallSpec spec;
    spec.signature = detail::fingerprintOf<M>();  // first: "not registered"
    spec.function = RemoteName<M>::value;
    spec.timeout = timeout_;
    detail::setMethodTarget(spec, state_->id());
    return spec;
  }

  template <auto M, typename... A>
  Future<detail::Reply> sendMethod(const detail::CallSpec& spec,
                                   A&&... args) const {
    auto agent = state_->agent();
    return detail::sendCall<M>(*agent, state_->owner(), spec,
                               std::forward<A>(args)...);
  }

  std::shared_ptr<detail::RRefState> state_;
  std::optional<Duration> timeout_;
};

namespace detail {

template <typename R>
using RRefOf = RRef<typename RRefValue<WireType<R>>::type>;

template <auto Fn, typename... A>
RRefOf<ResultOf<Fn>> remoteCall(Agent& agent, int32_t to, CallSpec spec,
                                A&&... args) {
  using V = typename RRefValue<WireType<ResultOf<Fn>>>::type;
  ensureRRefSupport(agent);
  auto state = makeCreatorState(agent, to, typeid(V).name());
  // A number or bool made as it is (not a std::shared_ptr the function may
  // keep and change): the owner's reply carries it, except inside a
  // distributed-autograd context (that reply carries more than the
  // result), where toHere() fetches at once.
  if constexpr (std::is_same_v<WireType<ResultOf<Fn>>, V> &&
                kCarriedByConfirmation<V>) {
    if (currentAutogradContext() == 0) {
      state->expectValue();
    }
  }
  setStoreResult(spec, state->id(), state->fork(), state->expectsValue());
  // The reply confirms the fork (below), and may carry the value: setting
  // a promise, and the library's callbacks on it only add context to an
  // error, so the loop runs it instead of waking a completion thread
  // (CallSpec).
  spec.completeOnLoop = true;
  auto reply = sendCall<Fn>(agent, to, spec, std::forward<A>(args)...);
  std::weak_ptr<RRefState> weak = state;
  reply.addDoneCallback([weak](const Future<Reply>& f) {
    if (auto s = weak.lock()) {
      s->confirmCreated(f);
    }
  });
  return RRefOf<ResultOf<Fn>>(std::move(state), spec.timeout);
}

}  // namespace detail

template <typename T>
template <auto M, typename... A>
auto RRef<T>::remote(A&&... args) const {
  detail::CallSpec spec = methodSpec<M>();
  auto agent = state_->agent();
  return detail::remoteCall<M>(*agent, state_->owner(), spec,
                               std::forward<A>(args)...);
}

// Runs Fn on `to` and keeps the result there, as the owner of the returned
// RRef. Returns at once.
template <auto Fn, typename... A>
auto remote(const Callee& to, A&&... args) {
  auto agent = Agent::currentShared();
  const int32_t rank = to.resolve(*agent);
  return detail::remoteCall<Fn>(*agent, rank, detail::functionSpec<Fn>(to),
                                std::forward<A>(args)...);
}

// An RRef owned by this worker, holding `value` (torch's RRef(value)):
// hand it to other workers as an argument or result.
template <typename T>
RRef<T> makeRRef(std::shared_ptr<T> value) {
  auto& agent = Agent::current();
  return RRef<T>(
      detail::makeLocalOwnerState(agent, detail::wrapResult(std::move(value))));
}

// Number of values this worker owns (tests, leak checks).
size_t ownedRRefCount(Agent& agent);
// Number of live user forks on this worker.
size_t userRRefCount(Agent& agent);

template <typename T>
struct Codec<RRef<T>> {
  static void encode(Encoder& e, const RRef<T>& r) {
    detail::encodeRRef(e, r.state());
  }
  static RRef<T> decode(Decoder& d) {
    auto state = detail::decodeRRef(d, typeid(T).name());
    return state == nullptr ? RRef<T>() : RRef<T>(std::move(state));
  }
  static std::string typeName() {
    return std::string("RRef<") + typeid(T).name() + ">";
  }
};

}  // namespace trellis::rpc
