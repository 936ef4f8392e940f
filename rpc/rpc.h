#pragma once

// The RPC API users call (docs/rpc.md).
//
//   auto env = trellis::WorkerEnv::fromEnvironment();
//   trellis::rpc::init("trainer1", env.rank, env.worldSize);
//   torch::Tensor y = trellis::rpc::rpcSync<addOne>("ps", x);
//   auto f = trellis::rpc::rpcAsync<addOne>({"ps", 5s}, x);
//   trellis::rpc::shutdown();
//
// Calls name the function as a template argument, so arguments are checked
// against its registered signature when the caller compiles. Errors:
// TimeoutError (the call's timeout passed; names callee and function),
// ConnectionError (the callee died or cannot be reached; names it),
// RemoteError (the callee raised: worker, function, exception type and
// message; also an unknown function or a signature mismatch),
// ProtocolError (a malformed reply). rpcSync throws them; rpcAsync's future
// carries them.

#include <optional>
#include <string>
#include <utility>

#include <trellis/rpc/agent.h>
#include <trellis/rpc/codec.h>
#include <trellis/rpc/registry.h>

namespace trellis::rpc {

// Where a call goes, and optionally its timeout:
//   "ps", 0 (a rank), workerInfo, {"ps", 5s}.
struct Callee {
  Callee(const char* name)
      : name(name) {}  // NOLINT(google-explicit-constructor)
  Callee(std::string name) : name(std::move(name)) {}  // NOLINT
  Callee(int32_t rank) : rank(rank) {}                 // NOLINT
  Callee(const WorkerInfo& info) : rank(info.rank) {}  // NOLINT
  template <typename Rep, typename Period>
  Callee(std::string name, std::chrono::duration<Rep, Period> timeout)
      : name(std::move(name)),
        timeout(std::chrono::duration_cast<Duration>(timeout)) {}
  template <typename Rep, typename Period>
  Callee(int32_t rank, std::chrono::duration<Rep, Period> timeout)
      : rank(rank), timeout(std::chrono::duration_cast<Duration>(timeout)) {}

  std::string name;
  int32_t rank = -1;
  // Unset: RpcOptions::defaultTimeout. Zero: none. Negative: the call
  // fails with InvalidArgumentError.
  std::optional<Duration> timeout;
  // The rank on `agent`; throws NotFoundError for an unknown worker.
  int32_t resolve(const Agent& agent) const;
};

// Starts this process's agent (see Agent::start) and makes it the process
// agent. Throws FailedPreconditionError if one is already running.
void init(const std::string& name, int32_t rank, int32_t worldSize,
          RpcOptions options = {});
// Shuts the process agent down (see Agent::shutdown and ShutdownOptions)
// and clears it:
//   trellis::rpc::shutdown();                    // graceful, default bounds
//   trellis::rpc::shutdown({.graceful = false}); // at once
void shutdown(ShutdownOptions options = {});

WorkerInfo getWorkerInfo();
WorkerInfo getWorkerInfo(const std::string& name);
WorkerInfo getWorkerInfo(int32_t rank);
std::vector<WorkerInfo> getWorkerInfos();

namespace detail {

template <typename Tuple, typename... A>
struct ArgsEncoder;
template <typename... P, typename... A>
struct ArgsEncoder<std::tuple<P...>, A...> {
  static void encode(Encoder& e, A&&... args) {
    // Converts each argument to the declared parameter type first (so an
    // int literal for an int64_t parameter encodes as int64_t).
    (encodeOne<P>(e, std::forward<A>(args)), ...);
  }
  template <typename Param, typename Arg>
  static void encodeOne(Encoder& e, Arg&& arg) {
    if constexpr (std::is_same_v<Param, std::decay_t<Arg>>) {
      encodeValue<Param>(e, arg);
    } else {
      encodeValue<Param>(e, Param(std::forward<Arg>(arg)));
    }
  }
};

template <auto Fn, typename... A>
Future<Reply> sendCall(Agent& agent, int32_t to, const CallSpec& spec,
                       A&&... args) {
  using Args = typename Traits<Fn>::Args;
  static_assert(std::tuple_size_v<Args> == sizeof...(A),
                "wrong number of arguments for this remote function");
  auto context = agent.codecContext(to);
  Encoder e(context.get());
  ArgsEncoder<Args, A...>::encode(e, std::forward<A>(args)...);
  return agent.call(to, spec, std::move(e), std::move(context));
}

template <typename R>
R decodeReplyHere(const Reply& r, Agent& agent) {
  auto context = agent.codecContext(r.from);
  auto receiver = agent.gradReceiver(r);
  Decoder d(r.bytes, r.tensors, context.get());
  d.setGradReceiver(receiver.get());
  auto value = decodeValue<WireType<R>>(d);
  throwIfError(d.finish());
  if constexpr (!std::is_void_v<R>) {
    return value;
  }
}

// The callback does not own the agent. It decodes only a successful reply,
// which the agent delivers on its own threads before its teardown has
// joined them; an agent torn down first fails the reply with CANCELLED and
// the callback never touches it. Owning it here made a cycle (agent ->
// pending call -> promise -> callback -> agent): an agent whose user had
// let go lived on until a late reply or timeout dropped the last reference
// on the agent's own completion thread, which then had to join itself.
template <typename R>
Future<R> decodeReply(Future<Reply> reply, Agent& agent) {
  return reply.then([agent = &agent](const Reply& r) -> R {
    return decodeReplyHere<R>(r, *agent);
  });
}

}  // namespace detail

namespace detail {

// The request header of a call of the free function Fn.
template <auto Fn>
CallSpec functionSpec(const Callee& to) {
  static_assert(std::is_void_v<typename Traits<Fn>::Class>,
                "methods are called through an RRef: "
                "rref.rpcSync / rpcAsync / remote<&C::m>()");
  CallSpec spec;
  spec.signature = fingerprintOf<Fn>();  // first: says "not registered"
  spec.function = RemoteName<Fn>::value;
  spec.timeout = to.timeout;
  return spec;
}

}  // namespace detail

template <auto Fn, typename... A>
Future<detail::ResultOf<Fn>> rpcAsync(const Callee& to, A&&... args) {
  auto agent = Agent::currentShared();
  const int32_t rank = to.resolve(*agent);
  auto reply = detail::sendCall<Fn>(*agent, rank, detail::functionSpec<Fn>(to),
                                    std::forward<A>(args)...);
  return detail::decodeReply<detail::ResultOf<Fn>>(std::move(reply), *agent);
}

template <auto Fn, typename... A>
detail::ResultOf<Fn> rpcSync(const Callee& to, A&&... args) {
  auto agent = Agent::currentShared();
  const int32_t rank = to.resolve(*agent);
  detail::CallSpec spec = detail::functionSpec<Fn>(to);
  spec.completeOnLoop = true;  // this thread decodes the reply itself
  auto reply =
      detail::sendCall<Fn>(*agent, rank, spec, std::forward<A>(args)...);
  return detail::decodeReplyHere<detail::ResultOf<Fn>>(reply.wait(), *agent);
}

}  // namespace trellis::rpc
