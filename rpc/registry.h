#pragma once

// The function registry: every function and method that may be called
// remotely, by name (docs/rpc.md, "Registering functions").
//
// Registration happens at static-initialisation time through the macros at
// the end of this file, used at global namespace scope:
//
//   torch::Tensor addOne(torch::Tensor t) { return t + 1; }
//   TRELLIS_REMOTE_FUNCTION(addOne);
//
//   struct Counter { int64_t add(int64_t n); };
//   TRELLIS_REMOTE_METHODS(Counter, add);
//
// Every worker links the same registrations. The caller names the function
// as a template argument (rpcSync<addOne>(...)), so its arguments are
// checked against the signature at compile time, and calling a function
// that was never registered does not compile. Each call carries a
// fingerprint of the signature as the caller compiled it; a callee built
// from a different signature answers with a RemoteError that says so, as
// it does for a name it does not know.
//
// A function may return Future<R>: it is then an async user function; it
// holds no thread while the future is pending and its reply goes out when
// the future completes.
//
// Thread safety: registration is static-init only; lookups are read-only
// afterwards and safe from any thread.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <variant>

#include <trellis/core/error.h>
#include <trellis/core/future.h>
#include <trellis/rpc/codec.h>

namespace trellis::rpc {

// A result of a registered function, type-erased so that the agent can
// either encode it into a reply or keep it as the value of an owner RRef.
struct AnyValue {
  std::shared_ptr<void> value;  // the object; null for void results
  // typeid(T).name() of the object's type; identifies it for RRef method
  // calls and for typed localValue() checks.
  const char* typeId = nullptr;
  // Encodes *value as T; null when T has no Codec (such values can live in
  // an RRef and be called through method proxies, but not be sent).
  void (*encode)(Encoder& encoder, const void* value) = nullptr;
  // For extensions (rpc/extension.h), set on a request's result: the
  // reply also answers the caller's request of this id (Envelope
  // also_answers; 0: none), or no reply is sent at all, since another
  // request's reply answered this one. Never set by user functions.
  uint64_t alsoAnswers = 0;
  bool noReply = false;
};

struct FunctionEntry {
  std::string name;
  uint64_t signature = 0;
  // For methods: typeid(Class).name() of the object they run on.
  const char* classTypeId = nullptr;
  // Decodes the arguments and runs the function (for a method: on `self`,
  // a Class*). Never throws: an exception becomes the future's error.
  Future<AnyValue> (*invoke)(Decoder& args, void* self) = nullptr;
  // Run on the transport loop thread instead of a worker thread: internal
  // protocol messages that never block (the shutdown's ping, RRef forks
  // and fetches, a context's release) and user functions registered with
  // TRELLIS_REMOTE_INLINE. Saves the hand-off to the pool and back.
  bool runOnLoop = false;
  // Registered with TRELLIS_REMOTE_STEP_SAFE: the graph its forward records
  // on the callee keeps no copy of the callee's parameters, so an optimizer
  // step there may land between this call and its backward (the step gate
  // does not wait for the gradient of its result).
  bool stepSafe = false;
};

class Registry {
 public:
  static Registry& global();
  // Static-init time only. A second entry with the same name is remembered
  // and reported by rpc::init() (FailedPrecondition naming it).
  bool add(FunctionEntry entry);
  const FunctionEntry* find(std::string_view name) const;
  // Static-init time only: `name` runs on the transport loop
  // (FunctionEntry::runOnLoop), whether it was added before or is added
  // after this call (the macros of different translation units run in no
  // fixed order).
  void markInline(std::string_view name);
  // Static-init time only: `name` is step-safe (FunctionEntry::stepSafe),
  // in whichever order it and its registration run.
  void markStepSafe(std::string_view name);
  // Non-OK when registration went wrong (a duplicate name).
  Error status() const;
  size_t size() const;

 private:
  Registry() = default;
  struct Impl;
  Impl& impl() const;
};

// The registered name of a function or method; specialised by the macros
// (`kRegistered` tells the calls, which refuse to compile without it).
template <auto Fn>
struct RemoteName {
  static constexpr bool kRegistered = false;
};

namespace detail {

template <typename T>
struct FutureResult {
  using type = T;
  static constexpr bool kAsync = false;
};
template <typename T>
struct FutureResult<Future<T>> {
  using type = T;
  static constexpr bool kAsync = true;
};

template <typename F>
struct FunctionTraits;

template <typename R, typename... A>
struct FunctionTraits<R (*)(A...)> {
  using Class = void;
  using Return = R;
  using Params = std::tuple<A...>;
  using Args = std::tuple<std::decay_t<A>...>;
};
template <typename R, typename... A>
struct FunctionTraits<R (*)(A...) noexcept> : FunctionTraits<R (*)(A...)> {};
template <typename R, typename C, typename... A>
struct FunctionTraits<R (C::*)(A...)> : FunctionTraits<R (*)(A...)> {
  using Class = C;
};
template <typename R, typename C, typename... A>
struct FunctionTraits<R (C::*)(A...) const> : FunctionTraits<R (C::*)(A...)> {};
template <typename R, typename C, typename... A>
struct FunctionTraits<R (C::*)(A...) noexcept>
    : FunctionTraits<R (C::*)(A...)> {};
template <typename R, typename C, typename... A>
struct FunctionTraits<R (C::*)(A...) const noexcept>
    : FunctionTraits<R (C::*)(A...)> {};

template <auto Fn>
using Traits = FunctionTraits<decltype(Fn)>;

// What the caller gets back: R for R and Future<R> returns.
template <auto Fn>
using ResultOf = typename FutureResult<typename Traits<Fn>::Return>::type;

// How a result travels: void as std::monostate.
template <typename R>
using WireType = std::conditional_t<std::is_void_v<R>, std::monostate, R>;

// The type an owner RRef holds: T for std::shared_ptr<T> results (so that
// non-copyable objects such as modules can live in an RRef), else R.
template <typename R>
struct RRefValue {
  using type = R;
};
template <typename T>
struct RRefValue<std::shared_ptr<T>> {
  using type = T;
};

template <typename P>
constexpr bool kParamOk =
    !(std::is_lvalue_reference_v<P> &&
      !std::is_const_v<
          std::remove_reference_t<P>>)&&!std::is_pointer_v<std::decay_t<P>>;

template <typename Tuple>
struct ParamsOk;
template <typename... P>
struct ParamsOk<std::tuple<P...>> {
  static constexpr bool value = (kParamOk<P> && ...);
};

// The wire type name where there is one; types that never travel (an
// object an RRef holds) are named by the ABI's type name, which is the same
// in every binary built with the same compiler.
template <typename T>
std::string signatureTypeName() {
  if constexpr (kIsSerializable<T>) {
    return typeName<T>();
  } else {
    return std::string("?") + typeid(T).name();
  }
}

template <typename Tuple>
struct SignatureOf;
template <typename... A>
struct SignatureOf<std::tuple<A...>> {
  template <typename R>
  static uint64_t fingerprint(std::string_view name) {
    std::string s(name);
    s += '(';
    ((s += signatureTypeName<A>(), s += ','), ...);
    s += ")->";
    s += signatureTypeName<R>();
    return fnv1a64(s);
  }
};

template <auto Fn>
uint64_t fingerprintOf() {
  static_assert(RemoteName<Fn>::kRegistered,
                "this function or method is not registered: add "
                "TRELLIS_REMOTE_FUNCTION(f) or TRELLIS_REMOTE_METHODS(Class, "
                "m, ...) at global scope, in a header or above this call");
  static const uint64_t value =
      SignatureOf<typename Traits<Fn>::Args>::template fingerprint<
          WireType<ResultOf<Fn>>>(RemoteName<Fn>::value);
  return value;
}

template <typename T>
void encodeErased(Encoder& encoder, const void* value) {
  encodeValue<T>(encoder, *static_cast<const T*>(value));
}

template <typename T>
constexpr auto encoderFor() -> void (*)(Encoder&, const void*) {
  if constexpr (kIsSerializable<T>) {
    return &encodeErased<T>;
  } else {
    return nullptr;
  }
}

template <typename R>
AnyValue wrapResult(R&& result) {
  using V = std::decay_t<R>;
  AnyValue out;
  if constexpr (std::is_same_v<V, std::monostate>) {
    // void: no value
  } else if constexpr (!std::is_same_v<typename RRefValue<V>::type, V>) {
    using T = typename RRefValue<V>::type;
    out.value = std::static_pointer_cast<void>(
        std::const_pointer_cast<std::remove_const_t<T>>(result));
    out.typeId = typeid(T).name();
    out.encode = encoderFor<T>();
  } else {
    out.value = std::make_shared<V>(std::forward<R>(result));
    out.typeId = typeid(V).name();
    out.encode = encoderFor<V>();
  }
  return out;
}

// The exception in flight as an Error whose message starts with its type.
Error currentExceptionError();

template <auto Fn, size_t... I>
decltype(auto) callWith(void* self, typename Traits<Fn>::Args& args,
                        std::index_sequence<I...>) {
  using T = Traits<Fn>;
  if constexpr (std::is_void_v<typename T::Class>) {
    return Fn(std::move(std::get<I>(args))...);
  } else {
    return (static_cast<typename T::Class*>(self)->*Fn)(
        std::move(std::get<I>(args))...);
  }
}

template <typename Tuple>
struct ArgsDecoder;
template <typename... A>
struct ArgsDecoder<std::tuple<A...>> {
  static std::tuple<A...> decode(Decoder& d) { return decodeArgs<A...>(d); }
};

template <auto Fn>
Future<AnyValue> invoke(Decoder& decoder, void* self) {
  using T = Traits<Fn>;
  using Ret = typename T::Return;
  auto args = ArgsDecoder<typename T::Args>::decode(decoder);
  Error finished = decoder.finish();
  if (!finished.ok()) {
    return makeErrorFuture<AnyValue>(std::move(finished));
  }
  constexpr auto seq =
      std::make_index_sequence<std::tuple_size_v<typename T::Args>>{};
  try {
    if constexpr (FutureResult<Ret>::kAsync) {
      using R = typename FutureResult<Ret>::type;
      Future<R> f = callWith<Fn>(self, args, seq);
      if constexpr (std::is_void_v<R>) {
        return f.then([] { return AnyValue{}; });
      } else {
        return f.then([](const R& r) { return wrapResult(R(r)); });
      }
    } else if constexpr (std::is_void_v<Ret>) {
      callWith<Fn>(self, args, seq);
      return makeReadyFuture(AnyValue{});
    } else {
      return makeReadyFuture(wrapResult(callWith<Fn>(self, args, seq)));
    }
  } catch (...) {
    return makeErrorFuture<AnyValue>(currentExceptionError());
  }
}

template <auto Fn>
bool registerRemote() {
  using T = Traits<Fn>;
  static_assert(ParamsOk<typename T::Params>::value,
                "remote functions take parameters by value, const reference "
                "or rvalue reference; pointers and non-const references "
                "cannot cross a process boundary");
  FunctionEntry e;
  e.name = RemoteName<Fn>::value;
  e.signature = fingerprintOf<Fn>();
  if constexpr (!std::is_void_v<typename T::Class>) {
    e.classTypeId = typeid(typename T::Class).name();
  }
  e.invoke = &invoke<Fn>;
  return Registry::global().add(std::move(e));
}

template <auto Fn>
bool markInline() {
  static_assert(RemoteName<Fn>::kRegistered,
                "TRELLIS_REMOTE_INLINE names a function or method that is not "
                "registered in this translation unit: put it after the "
                "TRELLIS_REMOTE_FUNCTION / TRELLIS_REMOTE_METHODS line");
  Registry::global().markInline(RemoteName<Fn>::value);
  return true;
}

template <auto Fn>
bool markStepSafe() {
  static_assert(RemoteName<Fn>::kRegistered,
                "TRELLIS_REMOTE_STEP_SAFE names a function or method that is "
                "not registered in this translation unit: put it after the "
                "TRELLIS_REMOTE_FUNCTION / TRELLIS_REMOTE_METHODS line");
  Registry::global().markStepSafe(RemoteName<Fn>::value);
  return true;
}

}  // namespace detail
}  // namespace trellis::rpc

#define TRELLIS_RPC_CONCAT_INNER(a, b) a##b
#define TRELLIS_RPC_CONCAT(a, b) TRELLIS_RPC_CONCAT_INNER(a, b)

// Registers a free function (by its qualified name as written). Use at
// global namespace scope, once per program (in a .cc file).
#define TRELLIS_REMOTE_FUNCTION(fn)                      \
  template <>                                            \
  struct trellis::rpc::RemoteName<&fn> {                 \
    static constexpr bool kRegistered = true;            \
    static constexpr std::string_view value = #fn;       \
  };                                                     \
  [[maybe_unused]] static const bool TRELLIS_RPC_CONCAT( \
      trellisRemoteRegistered_, __COUNTER__) =           \
      ::trellis::rpc::detail::registerRemote<&fn>()

#define TRELLIS_RPC_METHOD_ONE(Class, method)                      \
  template <>                                                      \
  struct trellis::rpc::RemoteName<&Class::method> {                \
    static constexpr bool kRegistered = true;                      \
    static constexpr std::string_view value = #Class "::" #method; \
  };                                                               \
  [[maybe_unused]] static const bool TRELLIS_RPC_CONCAT(           \
      trellisRemoteRegistered_, __COUNTER__) =                     \
      ::trellis::rpc::detail::registerRemote<&Class::method>();

// Registers up to 16 methods of Class, callable on an RRef<Class> through
// rref.rpcSync<&Class::method>(...) and friends.
#define TRELLIS_RPC_FE_1(C, m) TRELLIS_RPC_METHOD_ONE(C, m)
#define TRELLIS_RPC_FE_2(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_1(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_3(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_2(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_4(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_3(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_5(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_4(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_6(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_5(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_7(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_6(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_8(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_7(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_9(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_8(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_10(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_9(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_11(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_10(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_12(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_11(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_13(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_12(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_14(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_13(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_15(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_14(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_16(C, m, ...) \
  TRELLIS_RPC_METHOD_ONE(C, m) TRELLIS_RPC_FE_15(C, __VA_ARGS__)
#define TRELLIS_RPC_FE_PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, \
                            _13, _14, _15, _16, N, ...)                        \
  N
#define TRELLIS_REMOTE_METHODS(Class, ...)                                     \
  TRELLIS_RPC_FE_PICK(__VA_ARGS__, TRELLIS_RPC_FE_16, TRELLIS_RPC_FE_15,       \
                      TRELLIS_RPC_FE_14, TRELLIS_RPC_FE_13, TRELLIS_RPC_FE_12, \
                      TRELLIS_RPC_FE_11, TRELLIS_RPC_FE_10, TRELLIS_RPC_FE_9,  \
                      TRELLIS_RPC_FE_8, TRELLIS_RPC_FE_7, TRELLIS_RPC_FE_6,    \
                      TRELLIS_RPC_FE_5, TRELLIS_RPC_FE_4, TRELLIS_RPC_FE_3,    \
                      TRELLIS_RPC_FE_2, TRELLIS_RPC_FE_1)                      \
  (Class, __VA_ARGS__) static_assert(true, "")

// Runs a registered function or method on the callee's transport loop
// thread instead of its worker pool (docs/rpc.md, "Inline functions"): one
// thread hand-off fewer each way, for functions that never block (a table
// lookup, a little tensor math). "Never block" means: no lock another
// thread may hold for long, no I/O, no sleep, no wait on a future and no
// synchronous RPC (an async function returning a Future is fine), and
// microseconds to a millisecond of work. While it runs, no message of any
// pipe of that worker moves. A function whose runs hold the loop longer
// than TRELLIS_RPC_INLINE_WARN_US (default 1000) twice in a row, the second
// time computing or waiting (not preempted), is logged as a warning naming
// it and counted in Agent::Stats::slowInlineRuns. Use after the
// registration, in the same file:
//
//   TRELLIS_REMOTE_METHODS(Table, lookup, push);
//   TRELLIS_REMOTE_INLINE(Table::lookup);
// Declares that a registered function's autograd graph on the callee keeps
// no copy of the callee's parameters: its backward needs none of their
// values (docs/dist_autograd.md, "Steps and backward passes"). An
// EmbeddingBag lookup without per-sample weights is such a function
// (libtorch's EmbeddingBagBackward0 then saves the indices and offsets,
// not the weight); a Linear layer is not (it saves its weight). The step
// gate then lets a DistributedOptimizer step on the callee's parameters
// land between the call and its backward, instead of waiting for the
// gradient of its result; the call itself still waits for a step that is
// running (it reads the values). Declaring a function that does save a
// parameter makes a backward after such a step fail libtorch's version
// check ("modified by an inplace operation"). Use after the registration,
// in the same file:
//
//   TRELLIS_REMOTE_METHODS(Table, lookup);
//   TRELLIS_REMOTE_STEP_SAFE(Table::lookup);
#define TRELLIS_REMOTE_STEP_SAFE(fn)                     \
  [[maybe_unused]] static const bool TRELLIS_RPC_CONCAT( \
      trellisRemoteStepSafe_, __COUNTER__) =             \
      ::trellis::rpc::detail::markStepSafe<&fn>()

#define TRELLIS_REMOTE_INLINE(fn)                                             \
  [[maybe_unused]] static const bool TRELLIS_RPC_CONCAT(trellisRemoteInline_, \
                                                        __COUNTER__) =        \
      ::trellis::rpc::detail::markInline<&fn>()
