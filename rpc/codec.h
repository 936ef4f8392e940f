#pragma once

// The RPC argument and result codec (docs/rpc_wire.md).
//
// A call's arguments (or its result) become one byte string written with
// core/wire.h primitives plus a list of tensor spans that the transport sends
// out of band, next to the bytes. Each supported C++ type has a Codec<T>
// specialization; user structs get one from TRELLIS_SERIALIZABLE
// (rpc/serializable.h).
//
// Encoding is the caller's side: it throws InvalidArgumentError for a value
// that cannot travel (a sparse tensor, an unsupported dtype or device), which
// is caller misuse. Decoding reads bytes from the network: it never throws.
// The first problem is recorded as a ProtocolError (code DATA_LOSS) naming
// the field and byte offset; after it every read yields a default value, so
// a caller decodes everything and checks ok() (or finish()) once.
//
// Every count and length is checked against DecodeLimits and against the
// bytes left before anything is allocated from it.
//
// typeName() names the wire type, not the C++ type: types that encode the
// same bytes share a name (std::map and std::unordered_map are "map<K,V>",
// std::optional and std::shared_ptr are "opt<T>"), and integers are named by
// width and signedness only, so int64_t and long long are both "i64" on every
// compiler. signatureFingerprint() hashes these names, so a caller and callee
// agree on a function exactly when their argument bytes agree.
//
// Thread safety: an Encoder or Decoder belongs to one thread at a time.
//
// Over 600 lines on purpose: every Codec specialization has to be visible
// wherever a call's template expands, and each is a few lines; split by
// type family, a user would have to know which header makes a
// std::map<std::string, at::Tensor> argument compile.

#include <ATen/core/Tensor.h>
#include <algorithm>
#include <array>
#include <bit>
#include <c10/util/SmallVector.h>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include <trellis/core/error.h>
#include <trellis/core/wire.h>

namespace trellis::rpc {

// Hooks for layers above the codec (rref/ adds reference bookkeeping to the
// context it passes in); opaque here.
class GradReceiver;  // rpc/autograd_hooks.h

class CodecContext {
 public:
  virtual ~CodecContext() = default;
};

class Encoder {
 public:
  explicit Encoder(CodecContext* context = nullptr) : context_(context) {}
  // Undoes what was encoded (onUnsent) unless the message was sent.
  ~Encoder() { undoUnsent(); }
  Encoder(Encoder&& other) noexcept;
  Encoder& operator=(Encoder&& other) noexcept;
  Encoder(const Encoder&) = delete;
  Encoder& operator=(const Encoder&) = delete;

  ::trellis::wire::WireWriter& wire() { return wire_; }
  // The encoding's size without the data of tensors that travel inside it
  // (takeInlineRoom): what RpcOptions::maxMessageBytes bounds.
  size_t wireBytes() const { return wire_.size() - inlineBytes_; }
  // The encoding as it is sent, with that data.
  size_t payloadBytes() const { return wire_.size(); }

  // A CPU tensor of at most kInlineTensorBytes travels inside the argument
  // bytes instead of as a transport tensor of its own, while the message's
  // inlined data stays within kInlineBytesPerMessage (docs/rpc_wire.md,
  // "Small tensors"): a separate transport tensor costs a receive buffer,
  // a second tensor object and a frame of its own, several times what
  // copying a few KiB costs.
  static constexpr size_t kInlineTensorBytes = size_t{4} << 10;
  static constexpr size_t kInlineBytesPerMessage = size_t{64} << 10;
  // Whether `bytes` more may go inline; if so, counts them.
  bool takeInlineRoom(size_t bytes) {
    if (tensorsApart_ || bytes > kInlineTensorBytes ||
        inlineBytes_ + bytes > kInlineBytesPerMessage) {
      return false;
    }
    inlineBytes_ += bytes;
    return true;
  }
  // Every tensor encoded from here on travels as a transport tensor of its
  // own, however small (tests and fuzzers of that path).
  void sendTensorsApart() { tensorsApart_ = true; }

  // Registers `t` to travel out of band and returns its index in
  // outgoing(). The span sent is the tensor's own memory when it is
  // non-overlapping and dense (even a view into a larger storage: only its
  // span travels), else a contiguous copy. Throws InvalidArgumentError for
  // an undefined or non-strided tensor, or one not on CPU or CUDA.
  uint32_t addTensor(const at::Tensor& t);

  // One entry per addTensor: that tensor, or its contiguous copy, as it is
  // sent. Each is non-overlapping and dense, so data_ptr() .. + nbytes()
  // is exactly its span. The transport keeps them alive until its write
  // completes.
  const std::vector<at::Tensor>& outgoing() const { return tensors_; }
  // The same spans as a receiver gets them, 1-D uint8 tensors on the same
  // memory: for decoding in the same process (tests, fuzzers). Made on
  // each call; sending uses outgoing() and makes none.
  std::vector<at::Tensor> tensors() const;

  CodecContext* context() const { return context_; }

  // A side effect of encoding that stands only if the message goes out
  // (rref/: the fork that encoding an RRef registers with its owner).
  // `undo` runs when this encoder is destroyed or assigned over before
  // sent(): the message was never handed to the transport (the call failed
  // before it was sent, or encoding a later argument threw). It must not
  // throw.
  void onUnsent(std::function<void()> undo) {
    unsent_.push_back(std::move(undo));
  }
  // The message was handed to the transport (rpc/connections.cc): what it
  // carries stands from here on, whatever becomes of the write.
  void sent() { unsent_.clear(); }

  // The tensors encoded so far that require grad (the originals, in order):
  // distributed autograd records a send function for them.
  const std::vector<at::Tensor>& gradTensors() const { return gradTensors_; }
  void noteGradTensor(const at::Tensor& t) { gradTensors_.push_back(t); }

 private:
  ::trellis::wire::WireWriter wire_;
  std::vector<at::Tensor> tensors_;
  std::vector<at::Tensor> gradTensors_;
  size_t inlineBytes_ = 0;  // tensor data written into wire_
  bool tensorsApart_ = false;
  CodecContext* context_;
  std::vector<std::function<void()>> unsent_;

  void undoUnsent() noexcept;
};

struct DecodeLimits {
  size_t maxStringBytes = size_t{1} << 30;  // one string, bytes or message
  size_t maxElements = size_t{1} << 28;     // one container's count
  size_t maxDims = 64;                      // one tensor's rank
};

// What the argument bytes say about one tensor (see docs/rpc_wire.md).
// Sizes and strides of up to 6 dimensions live inline: decoding a tensor
// allocates nothing for them.
struct TensorMeta {
  at::ScalarType dtype = at::ScalarType::Undefined;
  c10::DeviceType deviceType = c10::DeviceType::CPU;
  int32_t deviceIndex = -1;
  bool requiresGrad = false;
  c10::SmallVector<int64_t, 6> sizes;
  c10::SmallVector<int64_t, 6> strides;
  int64_t offset = 0;  // in elements, from the start of the span
};

class Decoder {
 public:
  // `tensors`: the received spans, each a 1-D uint8 CPU (or CUDA) tensor of
  // the length the transport delivered. `bytes` must outlive the decoder.
  Decoder(std::span<const uint8_t> bytes, std::vector<at::Tensor> tensors,
          CodecContext* context = nullptr, DecodeLimits limits = {});

  ::trellis::wire::WireReader& wire() { return wire_; }

  // Returns received span `index` as the tensor `meta` describes, on the
  // span's device (the transport applied any device map when it allocated
  // the span; meta.deviceType/deviceIndex are the sender's). Fails the
  // decoder and returns an undefined tensor for a bad index, a span used
  // twice, a dtype outside the allow-list, sizes/strides/offset reaching
  // outside the span, too many dims, or a size product that overflows.
  at::Tensor tensor(uint32_t index, const TensorMeta& meta);
  // A new contiguous CPU tensor `meta` describes (its strides and offset
  // are ignored), holding `data`, which must be exactly its bytes. Fails
  // the decoder as tensor() does.
  at::Tensor inlineTensor(const TensorMeta& meta,
                          std::span<const uint8_t> data);

  // Reads a container count: a varint that must be <= limits().maxElements
  // and, when each element needs at least `minBytesEach` bytes, fit in what
  // is left. Returns 0 after a failure.
  size_t count(size_t minBytesEach, std::string_view field);

  void fail(std::string_view field, std::string_view message) {
    wire_.fail(field, message);
  }
  bool ok() const { return wire_.ok(); }
  const Error& error() const { return wire_.error(); }

  // Call after the top-level value: every byte consumed and every tensor used
  // exactly once, else ProtocolError. Returns the decoder's error.
  Error finish();

  CodecContext* context() const { return context_; }
  const DecodeLimits& limits() const { return limits_; }

  // Tensors decoded with requires_grad go to `receiver` (distributed
  // autograd) instead of becoming leaves; null restores that default.
  void setGradReceiver(GradReceiver* receiver) { gradReceiver_ = receiver; }

 private:
  ::trellis::wire::WireReader wire_;
  std::vector<at::Tensor> tensors_;
  std::vector<bool> used_;
  CodecContext* context_;
  DecodeLimits limits_;
  GradReceiver* gradReceiver_ = nullptr;
};

// One specialization per supported type (primary left undefined):
//   static void encode(Encoder&, const T&);
//   static T decode(Decoder&);      // never throws; fails the Decoder
//   static std::string typeName();  // the wire type, stable everywhere
//   static constexpr size_t kMinBytes;  // optional: least encoded size
template <typename T, typename Enable = void>
struct Codec;

template <typename T>
concept Serializable = requires(Encoder& e, Decoder& d, const T& v) {
  Codec<T>::encode(e, v);
  { Codec<T>::decode(d) } -> std::same_as<T>;
  { Codec<T>::typeName() } -> std::convertible_to<std::string>;
};

template <typename T>
inline constexpr bool kIsSerializable = Serializable<std::remove_cvref_t<T>>;

// Least number of bytes one T takes on the wire; 0 when unknown.
template <typename T>
constexpr size_t minWireBytes() {
  if constexpr (requires { Codec<T>::kMinBytes; }) {
    return Codec<T>::kMinBytes;
  } else {
    return 0;
  }
}

template <typename T>
std::string typeName() {
  if constexpr (std::is_void_v<T>) {
    return "void";
  } else {
    return Codec<std::remove_cvref_t<T>>::typeName();
  }
}

template <typename T>
void encodeValue(Encoder& e, const T& v) {
  Codec<std::remove_cvref_t<T>>::encode(e, v);
}

template <typename T>
T decodeValue(Decoder& d) {
  if (!d.ok()) {
    return T{};
  }
  return Codec<T>::decode(d);
}

template <typename... Ts>
void encodeArgs(Encoder& e, const Ts&... vs) {
  (encodeValue(e, vs), ...);
}

template <typename... Ts>
std::tuple<Ts...> decodeArgs(Decoder& d) {
  // Braced initialisation evaluates left to right, the order on the wire.
  return std::tuple<Ts...>{decodeValue<Ts>(d)...};
}

uint64_t fnv1a64(std::string_view s);

// "name(t1,t2,...)->r" from typeName().
template <typename R, typename... Args>
std::string signatureString(std::string_view name) {
  std::string s(name);
  s += '(';
  bool first = true;
  ((s += (first ? "" : ","), s += typeName<Args>(), first = false), ...);
  s += ")->";
  s += typeName<R>();
  return s;
}

template <typename R, typename... Args>
uint64_t signatureFingerprint(std::string_view name) {
  return fnv1a64(signatureString<R, Args...>(name));
}

// ---------------------------------------------------------------------------
// Scalars.

namespace detail {

template <typename T>
concept CharType = std::same_as<T, char> || std::same_as<T, wchar_t> ||
    std::same_as<T, char8_t> || std::same_as<T, char16_t> ||
    std::same_as<T, char32_t>;

// Integers by width, never by spelling; plain char is left out because its
// signedness differs between platforms.
template <typename T>
concept WireInteger =
    std::is_integral_v<T> && !std::same_as<T, bool> && !CharType<T>;

// Types whose vectors and arrays travel as one little-endian block.
template <typename T>
concept BulkArithmetic =
    WireInteger<T> || std::same_as<T, float> || std::same_as<T, double>;

template <typename T>
void putBulk(Encoder& e, const T* data, size_t n) {
  if constexpr (std::endian::native == std::endian::little || sizeof(T) == 1) {
    e.wire().putRaw(std::span<const uint8_t>(
        reinterpret_cast<const uint8_t*>(data), n * sizeof(T)));
  } else {
    for (size_t i = 0; i < n; ++i) {
      uint8_t b[sizeof(T)];
      std::memcpy(b, &data[i], sizeof(T));
      for (size_t k = 0; k < sizeof(T); ++k) {
        e.wire().putU8(b[sizeof(T) - 1 - k]);
      }
    }
  }
}

// Reads n elements into `out` (already sized); false after a failure.
template <typename T>
bool getBulk(Decoder& d, T* out, size_t n, std::string_view field) {
  if (n > std::numeric_limits<size_t>::max() / sizeof(T)) {
    d.fail(field, "element count overflows");
    return false;
  }
  auto bytes = d.wire().raw(n * sizeof(T), field);
  if (!d.ok()) {
    return false;
  }
  if constexpr (std::endian::native == std::endian::little || sizeof(T) == 1) {
    if (n > 0) {
      std::memcpy(out, bytes.data(), bytes.size());
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      uint8_t b[sizeof(T)];
      for (size_t k = 0; k < sizeof(T); ++k) {
        b[k] = bytes[i * sizeof(T) + sizeof(T) - 1 - k];
      }
      std::memcpy(&out[i], b, sizeof(T));
    }
  }
  return true;
}

}  // namespace detail

template <>
struct Codec<bool> {
  static constexpr size_t kMinBytes = 1;
  static void encode(Encoder& e, bool v) { e.wire().putBool(v); }
  static bool decode(Decoder& d) { return d.wire().boolean("bool"); }
  static std::string typeName() { return "bool"; }
};

// 8-bit integers as one byte; wider ones as (zig-zag) varints.
template <detail::WireInteger T>
struct Codec<T> {
  static constexpr size_t kMinBytes = 1;
  static void encode(Encoder& e, T v) {
    if constexpr (sizeof(T) == 1) {
      e.wire().putU8(static_cast<uint8_t>(v));
    } else if constexpr (std::is_signed_v<T>) {
      e.wire().putSignedVarint(static_cast<int64_t>(v));
    } else {
      e.wire().putVarint(static_cast<uint64_t>(v));
    }
  }
  static T decode(Decoder& d) {
    constexpr std::string_view kField = std::is_signed_v<T> ? "int" : "uint";
    if constexpr (sizeof(T) == 1) {
      return static_cast<T>(d.wire().u8(kField));
    } else if constexpr (std::is_signed_v<T>) {
      const int64_t v = d.wire().signedVarint(kField);
      if (v < std::numeric_limits<T>::min() ||
          v > std::numeric_limits<T>::max()) {
        d.fail(kField, "value " + std::to_string(v) + " out of range for " +
                           typeName());
        return 0;
      }
      return static_cast<T>(v);
    } else {
      return static_cast<T>(
          d.wire().varint(std::numeric_limits<T>::max(), kField));
    }
  }
  static std::string typeName() {
    return (std::is_signed_v<T> ? "i" : "u") + std::to_string(sizeof(T) * 8);
  }
};

template <typename T>
requires std::same_as<T, float> || std::same_as<T, double>
struct Codec<T> {
  static constexpr size_t kMinBytes = sizeof(T);
  static void encode(Encoder& e, T v) { detail::putBulk(e, &v, 1); }
  static T decode(Decoder& d) {
    T v{};
    detail::getBulk(d, &v, 1, typeName());
    return v;
  }
  static std::string typeName() { return sizeof(T) == 4 ? "f32" : "f64"; }
};

template <typename T>
requires std::is_enum_v<T> && Serializable<std::underlying_type_t<T>>
struct Codec<T> {
  using U = std::underlying_type_t<T>;
  static constexpr size_t kMinBytes = minWireBytes<U>();
  static void encode(Encoder& e, T v) {
    Codec<U>::encode(e, static_cast<U>(v));
  }
  static T decode(Decoder& d) { return static_cast<T>(Codec<U>::decode(d)); }
  static std::string typeName() { return "enum<" + Codec<U>::typeName() + ">"; }
};

template <>
struct Codec<std::monostate> {
  static constexpr size_t kMinBytes = 0;
  static void encode(Encoder&, std::monostate) {}
  static std::monostate decode(Decoder&) { return {}; }
  static std::string typeName() { return "void"; }
};

template <>
struct Codec<std::string> {
  static constexpr size_t kMinBytes = 1;
  static void encode(Encoder& e, const std::string& v) {
    e.wire().putString(v);
  }
  static std::string decode(Decoder& d) {
    return std::string(d.wire().string(d.limits().maxStringBytes, "str"));
  }
  static std::string typeName() { return "str"; }
};

// ---------------------------------------------------------------------------
// Tensors (bodies in codec.cc).

void encodeTensor(Encoder& e, const at::Tensor& t);
at::Tensor decodeTensor(Decoder& d);

// A new 1-D uint8 CPU tensor of `length` uninitialised bytes from ATen's CPU
// allocator (the memory at::empty would give), made without the dispatcher:
// at::empty cost 0.5-1.7 µs per received tensor on the transport loop, this
// 0.3-1.0 (docs/benchmarks.md, RPC). For receive buffers.
at::Tensor emptyBytes(size_t length);

template <>
struct Codec<at::Tensor> {
  static constexpr size_t kMinBytes = 1;
  static void encode(Encoder& e, const at::Tensor& t) { encodeTensor(e, t); }
  static at::Tensor decode(Decoder& d) { return decodeTensor(d); }
  static std::string typeName() { return "Tensor"; }
};

// ---------------------------------------------------------------------------
// Containers.

template <Serializable T>
struct Codec<std::vector<T>> {
  static constexpr size_t kMinBytes = 1;
  static void encode(Encoder& e, const std::vector<T>& v) {
    e.wire().putVarint(v.size());
    if constexpr (detail::BulkArithmetic<T>) {
      detail::putBulk(e, v.data(), v.size());
    } else {
      for (const auto& x : v) {
        Codec<T>::encode(e, x);
      }
    }
  }
  static std::vector<T> decode(Decoder& d) {
    std::vector<T> out;
    if constexpr (detail::BulkArithmetic<T>) {
      const size_t n = d.count(sizeof(T), "vec.count");
      out.resize(n);
      detail::getBulk(d, out.data(), n, "vec.data");
    } else {
      const size_t n = d.count(minWireBytes<T>(), "vec.count");
      // An element may be far larger in memory than on the wire: grow with
      // what actually decodes rather than trusting the count.
      out.reserve(std::min<size_t>(n, 1024));
      for (size_t i = 0; i < n && d.ok(); ++i) {
        out.push_back(Codec<T>::decode(d));
      }
    }
    if (!d.ok()) {
      return {};
    }
    return out;
  }
  static std::string typeName() { return "vec<" + Codec<T>::typeName() + ">"; }
};

template <Serializable T, size_t N>
struct Codec<std::array<T, N>> {
  static constexpr size_t kMinBytes = N * minWireBytes<T>();
  static void encode(Encoder& e, const std::array<T, N>& v) {
    if constexpr (detail::BulkArithmetic<T>) {
      detail::putBulk(e, v.data(), N);
    } else {
      for (const auto& x : v) {
        Codec<T>::encode(e, x);
      }
    }
  }
  static std::array<T, N> decode(Decoder& d) {
    std::array<T, N> out{};
    if constexpr (detail::BulkArithmetic<T>) {
      detail::getBulk(d, out.data(), N, "arr.data");
    } else {
      for (size_t i = 0; i < N && d.ok(); ++i) {
        out[i] = Codec<T>::decode(d);
      }
    }
    if (!d.ok()) {
      return {};
    }
    return out;
  }
  static std::string typeName() {
    return "arr<" + Codec<T>::typeName() + "," + std::to_string(N) + ">";
  }
};

namespace detail {

template <typename M>
struct MapCodec {
  using K = typename M::key_type;
  using V = typename M::mapped_type;
  static constexpr size_t kMinBytes = 1;
  static void encode(Encoder& e, const M& m) {
    e.wire().putVarint(m.size());
    for (const auto& [k, v] : m) {
      Codec<K>::encode(e, k);
      Codec<V>::encode(e, v);
    }
  }
  static M decode(Decoder& d) {
    M out;
    const size_t n =
        d.count(minWireBytes<K>() + minWireBytes<V>(), "map.count");
    for (size_t i = 0; i < n && d.ok(); ++i) {
      K k = Codec<K>::decode(d);
      V v = Codec<V>::decode(d);
      if (!d.ok()) {
        break;
      }
      if (!out.emplace(std::move(k), std::move(v)).second) {
        d.fail("map.key", "duplicate key");
      }
    }
    if (!d.ok()) {
      return {};
    }
    return out;
  }
  static std::string typeName() {
    return "map<" + Codec<K>::typeName() + "," + Codec<V>::typeName() + ">";
  }
};

template <typename S>
struct SetCodec {
  using K = typename S::key_type;
  static constexpr size_t kMinBytes = 1;
  static void encode(Encoder& e, const S& s) {
    e.wire().putVarint(s.size());
    for (const auto& k : s) {
      Codec<K>::encode(e, k);
    }
  }
  static S decode(Decoder& d) {
    S out;
    const size_t n = d.count(minWireBytes<K>(), "set.count");
    for (size_t i = 0; i < n && d.ok(); ++i) {
      K k = Codec<K>::decode(d);
      if (d.ok() && !out.insert(std::move(k)).second) {
        d.fail("set.key", "duplicate key");
      }
    }
    if (!d.ok()) {
      return {};
    }
    return out;
  }
  static std::string typeName() { return "set<" + Codec<K>::typeName() + ">"; }
};

}  // namespace detail

template <Serializable K, Serializable V, typename C, typename A>
struct Codec<std::map<K, V, C, A>> : detail::MapCodec<std::map<K, V, C, A>> {};

template <Serializable K, Serializable V, typename H, typename E, typename A>
struct Codec<std::unordered_map<K, V, H, E, A>>
    : detail::MapCodec<std::unordered_map<K, V, H, E, A>> {};

template <Serializable K, typename C, typename A>
struct Codec<std::set<K, C, A>> : detail::SetCodec<std::set<K, C, A>> {};

template <Serializable K, typename H, typename E, typename A>
struct Codec<std::unordered_set<K, H, E, A>>
    : detail::SetCodec<std::unordered_set<K, H, E, A>> {};

template <Serializable T>
struct Codec<std::optional<T>> {
  static constexpr size_t kMinBytes = 1;
  static void encode(Encoder& e, const std::optional<T>& v) {
    e.wire().putBool(v.has_value());
    if (v) {
      Codec<T>::encode(e, *v);
    }
  }
  static std::optional<T> decode(Decoder& d) {
    if (!d.wire().boolean("opt.present")) {
      return std::nullopt;
    }
    T v = Codec<T>::decode(d);
    if (!d.ok()) {
      return std::nullopt;
    }
    return v;
  }
  static std::string typeName() { return "opt<" + Codec<T>::typeName() + ">"; }
};

// Nullable; the pointee is copied, sharing does not survive the trip.
template <Serializable T>
struct Codec<std::shared_ptr<T>> {
  static constexpr size_t kMinBytes = 1;
  static void encode(Encoder& e, const std::shared_ptr<T>& v) {
    e.wire().putBool(v != nullptr);
    if (v) {
      Codec<T>::encode(e, *v);
    }
  }
  static std::shared_ptr<T> decode(Decoder& d) {
    if (!d.wire().boolean("opt.present")) {
      return nullptr;
    }
    T v = Codec<T>::decode(d);
    if (!d.ok()) {
      return nullptr;
    }
    return std::make_shared<T>(std::move(v));
  }
  static std::string typeName() { return "opt<" + Codec<T>::typeName() + ">"; }
};

template <Serializable A, Serializable B>
struct Codec<std::pair<A, B>> {
  static constexpr size_t kMinBytes = minWireBytes<A>() + minWireBytes<B>();
  static void encode(Encoder& e, const std::pair<A, B>& v) {
    Codec<A>::encode(e, v.first);
    Codec<B>::encode(e, v.second);
  }
  static std::pair<A, B> decode(Decoder& d) {
    A a = Codec<A>::decode(d);
    B b = Codec<B>::decode(d);
    return {std::move(a), std::move(b)};
  }
  static std::string typeName() {
    return "pair<" + Codec<A>::typeName() + "," + Codec<B>::typeName() + ">";
  }
};

template <Serializable... Ts>
struct Codec<std::tuple<Ts...>> {
  static constexpr size_t kMinBytes = (size_t{0} + ... + minWireBytes<Ts>());
  static void encode(Encoder& e, const std::tuple<Ts...>& v) {
    std::apply([&](const Ts&... xs) { (Codec<Ts>::encode(e, xs), ...); }, v);
  }
  static std::tuple<Ts...> decode(Decoder& d) {
    return std::tuple<Ts...>{decodeValue<Ts>(d)...};
  }
  static std::string typeName() {
    std::string s = "tuple<";
    bool first = true;
    ((s += (first ? "" : ","), s += Codec<Ts>::typeName(), first = false), ...);
    return s + ">";
  }
};

// ---------------------------------------------------------------------------
// Protobuf messages, recognised by shape so that this header needs no
// protobuf include. They travel as one length-prefixed byte string.

template <typename T>
concept ProtobufMessage = std::default_initializable<T> &&
    requires(const T& c, T& m, std::string* s, const void* p, int n) {
  { c.SerializeToString(s) } -> std::convertible_to<bool>;
  { m.ParseFromArray(p, n) } -> std::convertible_to<bool>;
  std::string(c.GetTypeName());
};

template <ProtobufMessage T>
struct Codec<T> {
  static constexpr size_t kMinBytes = 1;
  static void encode(Encoder& e, const T& v) {
    std::string bytes;
    if (!v.SerializeToString(&bytes)) {
      throwError(Error::invalidArgument("cannot serialize protobuf " +
                                        std::string(v.GetTypeName())));
    }
    e.wire().putString(bytes);
  }
  static T decode(Decoder& d) {
    const size_t limit =
        std::min<size_t>(d.limits().maxStringBytes,
                         static_cast<size_t>(std::numeric_limits<int>::max()));
    auto bytes = d.wire().bytes(limit, "proto");
    T v;
    if (d.ok() &&
        !v.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
      d.fail("proto", "malformed " + std::string(v.GetTypeName()));
    }
    return v;
  }
  static std::string typeName() {
    return "proto<" + std::string(T().GetTypeName()) + ">";
  }
};

}  // namespace trellis::rpc
