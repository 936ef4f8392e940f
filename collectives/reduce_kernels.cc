#include <algorithm>
#include <bit>
#include <cstdint>
#include <string>
#include <type_traits>

#include <trellis/collectives/reduce_kernels.h>
#include <trellis/core/check.h>

namespace trellis::collectives::detail {
namespace {

// Elements of float16/bfloat16 converted to float per block: two float
// blocks (2 KiB) stay in L1 and on the stack, and the conversion loops
// vectorise like the float32 ones.
constexpr size_t kBlock = 256;

inline uint32_t bitsOf(float f) { return std::bit_cast<uint32_t>(f); }
inline float floatOf(uint32_t bits) { return std::bit_cast<float>(bits); }

// cond ? a : b through an all-ones/all-zeros mask. The half conversions use
// it instead of ?:, which GCC turns into a branch around the float
// arithmetic (it may not speculate a trapping operation) and then cannot
// vectorise.
inline uint32_t select(bool cond, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(cond);
  return (a & mask) | (b & ~mask);
}

// IEEE binary16 <-> binary32. Branch-free (selects only) so that the block
// loops vectorise; each is exact or rounds to nearest even.
struct Half {
  static float toFloat(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t magnitude = h & 0x7fffu;
    // Normal numbers: the exponent and mantissa fields move up by 13 bits
    // and the exponent is rebiased by 127 - 15 = 112; inf and NaN (exponent
    // 31) need 255 - 31 = 224 instead, which keeps a NaN's payload.
    const uint32_t rebias = magnitude >= 0x7c00u ? 224u : 112u;
    const float normal = floatOf((magnitude << 13) + (rebias << 23));
    // Subnormals (and zero) are mantissa * 2^-24, exactly: the integer is at
    // most 10 bits and the result a normal float (no denormal arithmetic).
    const float subnormal =
        static_cast<float>(static_cast<int32_t>(magnitude)) * 0x1p-24f;
    return floatOf(
        select(magnitude < 0x0400u, bitsOf(subnormal), bitsOf(normal)) | sign);
  }

  static uint16_t fromFloat(float f) {
    const uint32_t bits = bitsOf(f);
    const uint32_t sign = (bits >> 16) & 0x8000u;
    const uint32_t magnitude = bits & 0x7fffffffu;
    // Normal results: rebias the exponent by -112 (0xc8000000 mod 2^32) and
    // round at bit 13 to nearest even (add just under half, plus the lowest
    // kept bit); a carry out of the mantissa correctly bumps the exponent.
    const uint32_t normal =
        (magnitude + 0xc8000fffu + ((magnitude >> 13) & 1u)) >> 13;
    // Results below 2^-14: adding 0.5 puts the half's subnormal quantum
    // (2^-24) at the float's last mantissa bit, so the FPU's own rounding
    // (nearest even) does it; the low bits are then the half's bits.
    const uint32_t subnormal = bitsOf(floatOf(magnitude) + 0.5f) - 0x3f000000u;
    // Quiet NaN, keeping the top of the payload.
    const uint32_t nan = 0x7e00u | ((magnitude >> 13) & 0x3ffu);
    uint32_t h = select(magnitude < 0x38800000u, subnormal, normal);
    h = select(magnitude >= 0x477ff000u, 0x7c00u, h);  // >= 65520: inf
    h = select(magnitude > 0x7f800000u, nan, h);
    return static_cast<uint16_t>(h | sign);
  }
};

// bfloat16: the upper 16 bits of a binary32.
struct BFloat16 {
  static float toFloat(uint16_t h) {
    return floatOf(static_cast<uint32_t>(h) << 16);
  }

  static uint16_t fromFloat(float f) {
    const uint32_t bits = bitsOf(f);
    // Round to nearest even at bit 16; overflow carries into inf.
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t nan = (bits >> 16) | 0x0040u;  // quiet, payload kept
    return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan
                                                                    : rounded);
  }
};

// Runs body(i) for i < n, shaped for GCC's -O2 vectoriser (the "very cheap"
// cost model), which takes a loop only when its trip count is a known
// multiple of the vector width: the first loop covers a multiple of 64 bytes
// of T (enough for AVX-512) and a scalar loop finishes the rest. With two
// lanes per SSE register (8-byte T) that model finds a plain loop not worth
// it; two elements per iteration make it pair them. -O3 and clang vectorise
// either way.
template <typename T, typename Body>
inline void forEachIndex(size_t n, Body body) {
  constexpr size_t kLanes = 64 / sizeof(T);
  const size_t vectorPart = n & ~(kLanes - 1);
  if constexpr (sizeof(T) == 8) {
    for (size_t i = 0; i < vectorPart; i += 2) {
      body(i);
      body(i + 1);
    }
  } else {
    for (size_t i = 0; i < vectorPart; ++i) {
      body(i);
    }
  }
  for (size_t i = vectorPart; i < n; ++i) {
    body(i);
  }
}

// The loop functions below stay out of line: inlined into the dispatch, GCC
// loses the __restrict of their parameters and wants run-time overlap checks
// that -O2 refuses. One call per kernel call (per block for float16/bfloat16)
// costs nothing.

template <typename Codec>
[[gnu::noinline]] void decode(const uint16_t* __restrict in,
                              float* __restrict out, size_t n) {
  forEachIndex<float>(n, [=](size_t i) { out[i] = Codec::toFloat(in[i]); });
}

template <typename Codec>
[[gnu::noinline]] void encode(const float* __restrict in,
                              uint16_t* __restrict out, size_t n) {
  forEachIndex<float>(n, [=](size_t i) { out[i] = Codec::fromFloat(in[i]); });
}

// --- Element operations. Each is a plain expression (selects, no calls) so
// that the loops below vectorise.

struct Add {
  template <typename T>
  T operator()(T a, T b) const {
    return a + b;
  }
};

struct Mul {
  template <typename T>
  T operator()(T a, T b) const {
    return a * b;
  }
};

// NaN-propagating, as torch.minimum/maximum: b wins when it is NaN, and when
// a is NaN the comparison is false so a (NaN) stays.
struct FloatMin {
  template <typename T>
  T operator()(T a, T b) const {
    return (b < a || b != b) ? b : a;
  }
};

struct FloatMax {
  template <typename T>
  T operator()(T a, T b) const {
    return (b > a || b != b) ? b : a;
  }
};

// Integer sum and product in unsigned arithmetic (wrap-around, no UB); types
// narrower than unsigned are widened to it first so that promotion to int
// cannot overflow (e.g. a uint16 product).
template <typename T>
using WrapType = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned,
                                    std::make_unsigned_t<T>>;

struct WrapAdd {
  template <typename T>
  T operator()(T a, T b) const {
    using W = WrapType<T>;
    return static_cast<T>(static_cast<W>(a) + static_cast<W>(b));
  }
};

struct WrapMul {
  template <typename T>
  T operator()(T a, T b) const {
    using W = WrapType<T>;
    return static_cast<T>(static_cast<W>(a) * static_cast<W>(b));
  }
};

struct IntMin {
  template <typename T>
  T operator()(T a, T b) const {
    return b < a ? b : a;
  }
};

struct IntMax {
  template <typename T>
  T operator()(T a, T b) const {
    return b > a ? b : a;
  }
};

struct BitAnd {
  template <typename T>
  T operator()(T a, T b) const {
    return static_cast<T>(a & b);
  }
};

struct BitOr {
  template <typename T>
  T operator()(T a, T b) const {
    return static_cast<T>(a | b);
  }
};

struct BitXor {
  template <typename T>
  T operator()(T a, T b) const {
    return static_cast<T>(a ^ b);
  }
};

// Bools are bytes: any nonzero byte is true, results are 0 or 1.
struct BoolOr {
  uint8_t operator()(uint8_t a, uint8_t b) const {
    return static_cast<uint8_t>((a | b) != 0);
  }
};

struct BoolAnd {
  uint8_t operator()(uint8_t a, uint8_t b) const {
    return static_cast<uint8_t>((a != 0) & (b != 0));
  }
};

struct BoolXor {
  uint8_t operator()(uint8_t a, uint8_t b) const {
    return static_cast<uint8_t>((a != 0) != (b != 0));
  }
};

// --- Loops. __restrict lets the compiler vectorise without run-time overlap
// checks (which -O2's cost model would refuse); the three shapes cover the
// aliasing reduceThreeWay allows, each with no two restrict pointers to the
// same buffer.

template <typename T, typename Op>
[[gnu::noinline]] void loopInto(T* __restrict dst, const T* __restrict src,
                                size_t n, Op op) {
  forEachIndex<T>(n, [=](size_t i) { dst[i] = op(dst[i], src[i]); });
}

// dst = op(src, dst): reduceThreeWay with dst == b keeps the operand order
// (min/max of +0 and -0, or of two NaNs, depend on it).
template <typename T, typename Op>
[[gnu::noinline]] void loopIntoReversed(T* __restrict dst,
                                        const T* __restrict src, size_t n,
                                        Op op) {
  forEachIndex<T>(n, [=](size_t i) { dst[i] = op(src[i], dst[i]); });
}

template <typename T, typename Op>
[[gnu::noinline]] void loopOutOfPlace(T* __restrict dst, const T* __restrict a,
                                      const T* __restrict b, size_t n, Op op) {
  forEachIndex<T>(n, [=](size_t i) { dst[i] = op(a[i], b[i]); });
}

struct Operands {
  void* dst;
  const void* a;
  const void* b;
  size_t count;
};

template <typename T, typename Op>
void run(const Operands& x, Op op) {
  auto* dst = static_cast<T*>(x.dst);
  const auto* a = static_cast<const T*>(x.a);
  const auto* b = static_cast<const T*>(x.b);
  if (a == dst) {
    loopInto(dst, b, x.count, op);
  } else if (b == dst) {
    loopIntoReversed(dst, a, x.count, op);
  } else {
    loopOutOfPlace(dst, a, b, x.count, op);
  }
}

// float16/bfloat16: both inputs of a block are decoded before the block is
// written, so dst may be a or b.
template <typename Codec, typename Op>
void runHalf(const Operands& x, Op op) {
  auto* dst = static_cast<uint16_t*>(x.dst);
  const auto* a = static_cast<const uint16_t*>(x.a);
  const auto* b = static_cast<const uint16_t*>(x.b);
  alignas(64) float fa[kBlock];
  alignas(64) float fb[kBlock];
  for (size_t start = 0; start < x.count; start += kBlock) {
    const size_t n = std::min(kBlock, x.count - start);
    decode<Codec>(a + start, fa, n);
    decode<Codec>(b + start, fb, n);
    loopInto(fa, fb, n, op);
    encode<Codec>(fa, dst + start, n);
  }
}

// The with*Op helpers call fn with the element operation for op; the caller
// has checked supports() already.
template <typename Fn>
void withFloatingOp(ReduceOp op, Fn&& fn) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      fn(Add{});
      return;
    case ReduceOp::kProduct:
      fn(Mul{});
      return;
    case ReduceOp::kMin:
      fn(FloatMin{});
      return;
    case ReduceOp::kMax:
      fn(FloatMax{});
      return;
    default:
      break;
  }
  TRELLIS_CHECK(false, "unreachable: op was checked");
}

template <typename Fn>
void withIntegerOp(ReduceOp op, Fn&& fn) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      fn(WrapAdd{});
      return;
    case ReduceOp::kProduct:
      fn(WrapMul{});
      return;
    case ReduceOp::kMin:
      fn(IntMin{});
      return;
    case ReduceOp::kMax:
      fn(IntMax{});
      return;
    case ReduceOp::kBand:
      fn(BitAnd{});
      return;
    case ReduceOp::kBor:
      fn(BitOr{});
      return;
    case ReduceOp::kBxor:
      fn(BitXor{});
      return;
  }
  TRELLIS_CHECK(false, "unreachable: op was checked");
}

template <typename Fn>
void withBoolOp(ReduceOp op, Fn&& fn) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
    case ReduceOp::kMax:
    case ReduceOp::kBor:
      fn(BoolOr{});
      return;
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kBand:
      fn(BoolAnd{});
      return;
    case ReduceOp::kBxor:
      fn(BoolXor{});
      return;
  }
  TRELLIS_CHECK(false, "unreachable: op was checked");
}

// Once per call, so always on: an unsupported pair would otherwise leave the
// buffer silently unreduced in a release build.
void checkSupported(DType dtype, ReduceOp op) {
  if (!supports(dtype, op)) [[unlikely]] {
    TRELLIS_CHECK(false, "reduce kernel called for an unsupported pair: " +
                             std::string(toString(dtype)) + " " +
                             std::string(toString(op)));
  }
}

bool isAligned(const void* p, DType dtype) {
  return reinterpret_cast<uintptr_t>(p) % elementSize(dtype) == 0;
}

bool disjoint(const void* p, const void* q, size_t bytes) {
  const auto x = reinterpret_cast<uintptr_t>(p);
  const auto y = reinterpret_cast<uintptr_t>(q);
  return x + bytes <= y || y + bytes <= x;
}

void reduce(const Operands& x, DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::kFloat32:
      withFloatingOp(op, [&](auto f) { run<float>(x, f); });
      return;
    case DType::kFloat64:
      withFloatingOp(op, [&](auto f) { run<double>(x, f); });
      return;
    case DType::kFloat16:
      withFloatingOp(op, [&](auto f) { runHalf<Half>(x, f); });
      return;
    case DType::kBFloat16:
      withFloatingOp(op, [&](auto f) { runHalf<BFloat16>(x, f); });
      return;
    case DType::kInt8:
      withIntegerOp(op, [&](auto f) { run<int8_t>(x, f); });
      return;
    case DType::kUInt8:
      withIntegerOp(op, [&](auto f) { run<uint8_t>(x, f); });
      return;
    case DType::kInt32:
      withIntegerOp(op, [&](auto f) { run<int32_t>(x, f); });
      return;
    case DType::kInt64:
      withIntegerOp(op, [&](auto f) { run<int64_t>(x, f); });
      return;
    case DType::kBool:
      withBoolOp(op, [&](auto f) { run<uint8_t>(x, f); });
      return;
  }
  TRELLIS_CHECK(false, "unreachable: dtype was checked");
}

template <typename T>
[[gnu::noinline]] void divideFloating(T* __restrict data, size_t n, T divisor) {
  forEachIndex<T>(n, [=](size_t i) { data[i] = data[i] / divisor; });
}

template <typename Codec>
void divideHalf(uint16_t* data, size_t n, float divisor) {
  alignas(64) float block[kBlock];
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t len = std::min(kBlock, n - start);
    decode<Codec>(data + start, block, len);
    divideFloating(block, len, divisor);
    encode<Codec>(block, data + start, len);
  }
}

// Truncating division in int64 (C++ rounds toward zero, as torch's integer
// division for avg); the quotient's magnitude is at most the dividend's, so
// it fits T.
template <typename T>
void divideInteger(T* data, size_t n, int64_t divisor) {
  for (size_t i = 0; i < n; ++i) {
    data[i] = static_cast<T>(static_cast<int64_t>(data[i]) / divisor);
  }
}

}  // namespace

bool supports(DType dtype, ReduceOp op) {
  if (elementSize(dtype) == 0) {
    return false;
  }
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kMax:
      return true;
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      return !isFloatingPoint(dtype);
  }
  return false;
}

void reduceInto(void* dst, const void* src, size_t count, DType dtype,
                ReduceOp op) {
  checkSupported(dtype, op);
  if (count == 0) {
    return;
  }
  TRELLIS_DCHECK(isAligned(dst, dtype) && isAligned(src, dtype),
                 "reduceInto: misaligned buffer");
  TRELLIS_DCHECK(disjoint(dst, src, count * elementSize(dtype)),
                 "reduceInto: src overlaps dst");
  reduce(Operands{dst, dst, src, count}, dtype, op);
}

void reduceThreeWay(void* dst, const void* a, const void* b, size_t count,
                    DType dtype, ReduceOp op) {
  checkSupported(dtype, op);
  if (count == 0) {
    return;
  }
  TRELLIS_DCHECK(
      isAligned(dst, dtype) && isAligned(a, dtype) && isAligned(b, dtype),
      "reduceThreeWay: misaligned buffer");
  const size_t bytes = count * elementSize(dtype);
  TRELLIS_DCHECK((dst == a || disjoint(dst, a, bytes)) &&
                     (dst == b || disjoint(dst, b, bytes)) &&
                     !(dst == a && dst == b),
                 "reduceThreeWay: dst partially overlaps an input");
  reduce(Operands{dst, a, b, count}, dtype, op);
}

void divideBy(void* data, size_t count, DType dtype, int64_t divisor) {
  TRELLIS_CHECK(divisor > 0, "divideBy: the divisor must be positive");
  TRELLIS_CHECK(elementSize(dtype) != 0, "divideBy: dtype out of range");
  if (count == 0) {
    return;
  }
  TRELLIS_DCHECK(isAligned(data, dtype), "divideBy: misaligned buffer");
  switch (dtype) {
    case DType::kFloat32:
      divideFloating(static_cast<float*>(data), count,
                     static_cast<float>(divisor));
      return;
    case DType::kFloat64:
      divideFloating(static_cast<double*>(data), count,
                     static_cast<double>(divisor));
      return;
    case DType::kFloat16:
      divideHalf<Half>(static_cast<uint16_t*>(data), count,
                       static_cast<float>(divisor));
      return;
    case DType::kBFloat16:
      divideHalf<BFloat16>(static_cast<uint16_t*>(data), count,
                           static_cast<float>(divisor));
      return;
    case DType::kInt8:
      divideInteger(static_cast<int8_t*>(data), count, divisor);
      return;
    case DType::kUInt8:
      divideInteger(static_cast<uint8_t*>(data), count, divisor);
      return;
    case DType::kInt32:
      divideInteger(static_cast<int32_t*>(data), count, divisor);
      return;
    case DType::kInt64:
      divideInteger(static_cast<int64_t*>(data), count, divisor);
      return;
    case DType::kBool:
      return;  // see the header: bools are left as they are
  }
}

}  // namespace trellis::collectives::detail
