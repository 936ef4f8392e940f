// The reduction kernels against plain per-element reference code. float16
// and bfloat16 references convert the slow, obvious way (double arithmetic,
// nearbyint), and those conversions are checked against known bit patterns
// first.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <trellis/collectives/reduce_kernels.h>

namespace trellis::collectives::detail {
namespace {

constexpr size_t kCounts[] = {0, 1, 7, 255, 256, 257, 10000};

constexpr DType kAllDTypes[] = {
    DType::kFloat32,  DType::kFloat64, DType::kFloat16,
    DType::kBFloat16, DType::kInt8,    DType::kUInt8,
    DType::kInt32,    DType::kInt64,   DType::kBool,
};

constexpr ReduceOp kAllOps[] = {
    ReduceOp::kSum, ReduceOp::kAvg,  ReduceOp::kProduct, ReduceOp::kMin,
    ReduceOp::kMax, ReduceOp::kBand, ReduceOp::kBor,     ReduceOp::kBxor,
};

// --- Reference conversions.

float refHalfToFloat(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  double value;
  if (exponent == 0x1f) {
    value = mantissa != 0 ? std::numeric_limits<double>::quiet_NaN()
                          : std::numeric_limits<double>::infinity();
  } else if (exponent == 0) {
    value = std::ldexp(mantissa, -24);
  } else {
    value = std::ldexp(mantissa + 1024, exponent - 25);
  }
  return static_cast<float>((h & 0x8000) != 0 ? -value : value);
}

// Rounds |f| to a multiple of the quantum of its binade (nearbyint: ties to
// even in the default rounding mode), then encodes.
uint16_t refFloatToHalf(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) {
    return sign | 0x7e00;
  }
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(a)) {
    return sign | 0x7c00;
  }
  if (a == 0) {
    return sign;
  }
  int e = 0;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const int exponent = std::max(e - 1, -14);
  if (exponent > 15) {
    return sign | 0x7c00;
  }
  const double steps = std::nearbyint(a / std::ldexp(1.0, exponent - 10));
  // Subnormals (exponent -14, steps < 1024) land on the same formula.
  const long bits = ((exponent + 15L) << 10) + static_cast<long>(steps) - 1024;
  return static_cast<uint16_t>(sign | std::min(bits, 0x7c00L));
}

float refBFloat16ToFloat(uint16_t h) {
  const int exponent = (h >> 7) & 0xff;
  const int mantissa = h & 0x7f;
  double value;
  if (exponent == 0xff) {
    value = mantissa != 0 ? std::numeric_limits<double>::quiet_NaN()
                          : std::numeric_limits<double>::infinity();
  } else if (exponent == 0) {
    value = std::ldexp(mantissa, -133);
  } else {
    value = std::ldexp(mantissa + 128, exponent - 134);
  }
  return static_cast<float>((h & 0x8000) != 0 ? -value : value);
}

uint16_t refFloatToBFloat16(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) {
    return sign | 0x7fc0;
  }
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(a)) {
    return sign | 0x7f80;
  }
  if (a == 0) {
    return sign;
  }
  int e = 0;
  std::frexp(a, &e);
  const int exponent = std::max(e - 1, -126);
  const double steps = std::nearbyint(a / std::ldexp(1.0, exponent - 7));
  const long bits = ((exponent + 127L) << 7) + static_cast<long>(steps) - 128;
  return static_cast<uint16_t>(sign | std::min(bits, 0x7f80L));
}

bool isHalfNaN(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff); }
bool isBFloat16NaN(uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x7f); }

// --- Per-dtype reference traits. Half, BFloat16 and Bool are tags.

struct Half {};
struct BFloat16 {};
struct Bool {};

template <typename T>
T refFloating(T a, T b, ReduceOp op) {
  const T nan = std::numeric_limits<T>::quiet_NaN();
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return a + b;
    case ReduceOp::kProduct:
      return a * b;
    case ReduceOp::kMin:
      return std::isnan(a) || std::isnan(b) ? nan : std::min(a, b);
    case ReduceOp::kMax:
      return std::isnan(a) || std::isnan(b) ? nan : std::max(a, b);
    default:
      ADD_FAILURE() << "no reference for " << toString(op);
      return a;
  }
}

template <typename T>
struct Traits {
  // Integers.
  using Storage = T;
  static Storage random(std::mt19937_64& rng) { return static_cast<T>(rng()); }
  static Storage reduce(T a, T b, ReduceOp op) {
    const auto ua = static_cast<uint64_t>(a);
    const auto ub = static_cast<uint64_t>(b);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        return static_cast<T>(ua + ub);
      case ReduceOp::kProduct:
        return static_cast<T>(ua * ub);
      case ReduceOp::kMin:
        return std::min(a, b);
      case ReduceOp::kMax:
        return std::max(a, b);
      case ReduceOp::kBand:
        return static_cast<T>(ua & ub);
      case ReduceOp::kBor:
        return static_cast<T>(ua | ub);
      case ReduceOp::kBxor:
        return static_cast<T>(ua ^ ub);
    }
    ADD_FAILURE() << "bad op";
    return a;
  }
  static bool same(T x, T y) { return x == y; }
  static std::string show(T x) { return std::to_string(x); }
};

template <typename T>
struct FloatingTraits {
  using Storage = T;
  // Mostly ordinary values, with NaN, infinities, signed zeros, subnormals
  // and values whose sum or product overflows mixed in.
  static Storage random(std::mt19937_64& rng) {
    std::uniform_int_distribution<int> kind(0, 19);
    switch (kind(rng)) {
      case 0:
        return std::numeric_limits<T>::quiet_NaN();
      case 1:
        return std::numeric_limits<T>::infinity();
      case 2:
        return -std::numeric_limits<T>::infinity();
      case 3:
        return static_cast<T>(-0.0);
      case 4:
        return std::numeric_limits<T>::denorm_min() * 3;
      case 5:
        return std::numeric_limits<T>::max() * static_cast<T>(0.75);
      default:
        return std::uniform_real_distribution<T>(-100, 100)(rng);
    }
  }
  static Storage reduce(T a, T b, ReduceOp op) { return refFloating(a, b, op); }
  static bool same(T x, T y) {
    return (std::isnan(x) && std::isnan(y)) ||
           std::memcmp(&x, &y, sizeof(T)) == 0;
  }
  static std::string show(T x) { return std::to_string(x); }
};

template <>
struct Traits<float> : FloatingTraits<float> {};
template <>
struct Traits<double> : FloatingTraits<double> {};

template <>
struct Traits<Half> {
  using Storage = uint16_t;
  // Every bit pattern: all classes, and sums that round.
  static Storage random(std::mt19937_64& rng) {
    return static_cast<uint16_t>(rng());
  }
  static Storage reduce(uint16_t a, uint16_t b, ReduceOp op) {
    return refFloatToHalf(
        refFloating(refHalfToFloat(a), refHalfToFloat(b), op));
  }
  static bool same(uint16_t x, uint16_t y) {
    return (isHalfNaN(x) && isHalfNaN(y)) || x == y;
  }
  static std::string show(uint16_t x) { return std::to_string(x); }
};

template <>
struct Traits<BFloat16> {
  using Storage = uint16_t;
  static Storage random(std::mt19937_64& rng) {
    return static_cast<uint16_t>(rng());
  }
  static Storage reduce(uint16_t a, uint16_t b, ReduceOp op) {
    return refFloatToBFloat16(
        refFloating(refBFloat16ToFloat(a), refBFloat16ToFloat(b), op));
  }
  static bool same(uint16_t x, uint16_t y) {
    return (isBFloat16NaN(x) && isBFloat16NaN(y)) || x == y;
  }
  static std::string show(uint16_t x) { return std::to_string(x); }
};

template <>
struct Traits<Bool> {
  using Storage = uint8_t;
  // Zero, one, and other nonzero bytes (which read as true).
  static Storage random(std::mt19937_64& rng) {
    const auto r = static_cast<uint8_t>(rng());
    return r < 100 ? 0 : r < 180 ? 1 : r;
  }
  static Storage reduce(uint8_t a, uint8_t b, ReduceOp op) {
    const bool x = a != 0;
    const bool y = b != 0;
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
      case ReduceOp::kMax:
      case ReduceOp::kBor:
        return x || y;
      case ReduceOp::kProduct:
      case ReduceOp::kMin:
      case ReduceOp::kBand:
        return x && y;
      case ReduceOp::kBxor:
        return x != y;
    }
    ADD_FAILURE() << "bad op";
    return a;
  }
  static bool same(uint8_t x, uint8_t y) { return x == y; }
  static std::string show(uint8_t x) { return std::to_string(x); }
};

template <typename T>
using StorageOf = typename Traits<T>::Storage;

// Expects got == want element-wise; reports the first difference only.
template <typename T>
void expectSame(const std::vector<StorageOf<T>>& got,
                const std::vector<StorageOf<T>>& want,
                const std::vector<StorageOf<T>>& a,
                const std::vector<StorageOf<T>>& b, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (!Traits<T>::same(got[i], want[i])) {
      ADD_FAILURE() << what << ": element " << i << " of " << got.size()
                    << ": op(" << Traits<T>::show(a[i]) << ", "
                    << Traits<T>::show(b[i]) << ") gave "
                    << Traits<T>::show(got[i]) << ", want "
                    << Traits<T>::show(want[i]);
      return;
    }
  }
}

template <typename T>
void checkAgainstReference(DType dtype, ReduceOp op, size_t count) {
  using S = StorageOf<T>;
  std::mt19937_64 rng(count * 131 + static_cast<uint64_t>(dtype) * 17 +
                      static_cast<uint64_t>(op));
  std::vector<S> a(count);
  std::vector<S> b(count);
  std::vector<S> want(count);
  for (size_t i = 0; i < count; ++i) {
    a[i] = Traits<T>::random(rng);
    b[i] = Traits<T>::random(rng);
    want[i] = Traits<T>::reduce(a[i], b[i], op);
  }
  const std::string where = std::string(toString(dtype)) + " " +
                            std::string(toString(op)) + " count " +
                            std::to_string(count);

  std::vector<S> dst = a;
  reduceInto(dst.data(), b.data(), count, dtype, op);
  expectSame<T>(dst, want, a, b, "reduceInto " + where);

  std::vector<S> out(count);
  reduceThreeWay(out.data(), a.data(), b.data(), count, dtype, op);
  expectSame<T>(out, want, a, b, "reduceThreeWay " + where);

  dst = a;
  reduceThreeWay(dst.data(), dst.data(), b.data(), count, dtype, op);
  expectSame<T>(dst, want, a, b, "reduceThreeWay dst==a " + where);

  dst = b;
  reduceThreeWay(dst.data(), a.data(), dst.data(), count, dtype, op);
  expectSame<T>(dst, want, a, b, "reduceThreeWay dst==b " + where);
}

void checkAgainstReference(DType dtype, ReduceOp op, size_t count) {
  switch (dtype) {
    case DType::kFloat32:
      return checkAgainstReference<float>(dtype, op, count);
    case DType::kFloat64:
      return checkAgainstReference<double>(dtype, op, count);
    case DType::kFloat16:
      return checkAgainstReference<Half>(dtype, op, count);
    case DType::kBFloat16:
      return checkAgainstReference<BFloat16>(dtype, op, count);
    case DType::kInt8:
      return checkAgainstReference<int8_t>(dtype, op, count);
    case DType::kUInt8:
      return checkAgainstReference<uint8_t>(dtype, op, count);
    case DType::kInt32:
      return checkAgainstReference<int32_t>(dtype, op, count);
    case DType::kInt64:
      return checkAgainstReference<int64_t>(dtype, op, count);
    case DType::kBool:
      return checkAgainstReference<Bool>(dtype, op, count);
  }
  FAIL() << "bad dtype";
}

struct Pair {
  DType dtype;
  ReduceOp op;
};

void PrintTo(const Pair& pair, std::ostream* os) {
  *os << toString(pair.dtype) << " " << toString(pair.op);
}

std::vector<Pair> supportedPairs() {
  std::vector<Pair> pairs;
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      if (supports(dtype, op)) {
        pairs.push_back({dtype, op});
      }
    }
  }
  return pairs;
}

class ReduceKernelsPairs : public ::testing::TestWithParam<Pair> {};

TEST_P(ReduceKernelsPairs, MatchReference) {
  for (size_t count : kCounts) {
    checkAgainstReference(GetParam().dtype, GetParam().op, count);
  }
}

INSTANTIATE_TEST_SUITE_P(Supported, ReduceKernelsPairs,
                         ::testing::ValuesIn(supportedPairs()),
                         [](const ::testing::TestParamInfo<Pair>& info) {
                           return std::string(toString(info.param.dtype)) +
                                  "_" + std::string(toString(info.param.op));
                         });

// --- Names, sizes, wire values, supports().

TEST(ReduceKernels, DTypeNamesSizesAndWireValues) {
  const std::pair<DType, std::pair<std::string_view, size_t>> expected[] = {
      {DType::kFloat32, {"float32", 4}}, {DType::kFloat64, {"float64", 8}},
      {DType::kFloat16, {"float16", 2}}, {DType::kBFloat16, {"bfloat16", 2}},
      {DType::kInt8, {"int8", 1}},       {DType::kUInt8, {"uint8", 1}},
      {DType::kInt32, {"int32", 4}},     {DType::kInt64, {"int64", 8}},
      {DType::kBool, {"bool", 1}},
  };
  uint8_t wire = 0;
  for (const auto& [dtype, nameAndSize] : expected) {
    EXPECT_EQ(static_cast<uint8_t>(dtype), wire);  // never renumbered
    EXPECT_EQ(toString(dtype), nameAndSize.first);
    EXPECT_EQ(elementSize(dtype), nameAndSize.second);
    EXPECT_EQ(dtypeFromWire(wire), std::optional<DType>(dtype));
    ++wire;
  }
  for (int value = 9; value < 256; ++value) {
    EXPECT_FALSE(dtypeFromWire(static_cast<uint8_t>(value)).has_value());
  }
  EXPECT_EQ(toString(static_cast<DType>(200)), "unknown");
  EXPECT_EQ(elementSize(static_cast<DType>(200)), 0u);
}

TEST(ReduceKernels, ReduceOpNames) {
  EXPECT_EQ(toString(ReduceOp::kSum), "sum");
  EXPECT_EQ(toString(ReduceOp::kAvg), "avg");
  EXPECT_EQ(toString(ReduceOp::kProduct), "product");
  EXPECT_EQ(toString(ReduceOp::kMin), "min");
  EXPECT_EQ(toString(ReduceOp::kMax), "max");
  EXPECT_EQ(toString(ReduceOp::kBand), "band");
  EXPECT_EQ(toString(ReduceOp::kBor), "bor");
  EXPECT_EQ(toString(ReduceOp::kBxor), "bxor");
  EXPECT_EQ(toString(static_cast<ReduceOp>(8)), "unknown");
}

TEST(ReduceKernels, SupportsAllButBitwiseOnFloatingTypes) {
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      const bool bitwise = op == ReduceOp::kBand || op == ReduceOp::kBor ||
                           op == ReduceOp::kBxor;
      const bool floating =
          dtype == DType::kFloat32 || dtype == DType::kFloat64 ||
          dtype == DType::kFloat16 || dtype == DType::kBFloat16;
      EXPECT_EQ(supports(dtype, op), !(bitwise && floating))
          << toString(dtype) << " " << toString(op);
    }
    EXPECT_FALSE(supports(dtype, static_cast<ReduceOp>(8)));
  }
  EXPECT_FALSE(supports(static_cast<DType>(9), ReduceOp::kSum));
}

TEST(ReduceKernels, UnsupportedPairIsABug) {
  float dst = 1;
  const float src = 2;
  EXPECT_DEATH(reduceInto(&dst, &src, 1, DType::kFloat32, ReduceOp::kBand),
               "unsupported pair: float32 band");
  EXPECT_DEATH(
      reduceThreeWay(&dst, &dst, &src, 1, DType::kFloat32, ReduceOp::kBxor),
      "unsupported pair: float32 bxor");
}

// --- float16 / bfloat16 conversions.

TEST(ReduceKernels, Float16ReferenceMatchesKnownBits) {
  EXPECT_EQ(refFloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(refFloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(refFloatToHalf(65504.0f), 0x7bff);      // largest finite
  EXPECT_EQ(refFloatToHalf(0x1p-24f), 0x0001);      // smallest subnormal
  EXPECT_EQ(refFloatToHalf(0x1p-14f), 0x0400);      // smallest normal
  EXPECT_EQ(refFloatToHalf(0x1.ff8p-15f), 0x03ff);  // largest subnormal
  EXPECT_EQ(refFloatToHalf(0.1f), 0x2e66);
  EXPECT_EQ(refFloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(refFloatToHalf(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(refFloatToHalf(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(isHalfNaN(refFloatToHalf(std::nanf(""))));
  // Ties go to the even neighbour.
  EXPECT_EQ(refFloatToHalf(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(refFloatToHalf(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_EQ(refFloatToHalf(0x1p-25f), 0x0000);
  EXPECT_EQ(refFloatToHalf(3 * 0x1p-25f), 0x0002);
  EXPECT_EQ(refFloatToHalf(0x1p-26f), 0x0000);
  EXPECT_EQ(refFloatToHalf(65519.0f), 0x7bff);
  EXPECT_EQ(refFloatToHalf(65520.0f), 0x7c00);  // the tie above max: inf
  EXPECT_EQ(refFloatToHalf(1e10f), 0x7c00);

  EXPECT_EQ(refHalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(refHalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(refHalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(refHalfToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(refHalfToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(refHalfToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(refHalfToFloat(0x7e00)));
  EXPECT_TRUE(std::isnan(refHalfToFloat(0xfc01)));
}

TEST(ReduceKernels, BFloat16ReferenceMatchesKnownBits) {
  EXPECT_EQ(refFloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(refFloatToBFloat16(-2.0f), 0xc000);
  EXPECT_EQ(refFloatToBFloat16(65504.0f), 0x4780);     // rounds to 65536
  EXPECT_EQ(refFloatToBFloat16(0x1p-133f), 0x0001);    // smallest subnormal
  EXPECT_EQ(refFloatToBFloat16(0x1.fep127f), 0x7f7f);  // largest finite
  EXPECT_EQ(refFloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(refFloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_TRUE(isBFloat16NaN(refFloatToBFloat16(std::nanf(""))));
  EXPECT_EQ(refFloatToBFloat16(1.0f + 0x1p-8f), 0x3f80);
  EXPECT_EQ(refFloatToBFloat16(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_EQ(refFloatToBFloat16(0x1p-134f), 0x0000);
  EXPECT_EQ(refFloatToBFloat16(3 * 0x1p-134f), 0x0002);

  EXPECT_EQ(refBFloat16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(refBFloat16ToFloat(0x0001), 0x1p-133f);
  EXPECT_EQ(refBFloat16ToFloat(0x7f7f), 0x1.fep127f);
  EXPECT_EQ(refBFloat16ToFloat(0xff80),
            -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(refBFloat16ToFloat(0x7fc0)));
}

// x + (-0) == x for every x (and -0 + -0 == -0), so a sum with negative
// zeros round-trips every bit pattern through the kernel's conversions.
void expectRoundTripsEveryBitPattern(DType dtype, bool (*isNaN)(uint16_t)) {
  std::vector<uint16_t> dst(65536);
  for (size_t i = 0; i < dst.size(); ++i) {
    dst[i] = static_cast<uint16_t>(i);
  }
  const std::vector<uint16_t> negativeZeros(dst.size(), 0x8000);
  reduceInto(dst.data(), negativeZeros.data(), dst.size(), dtype,
             ReduceOp::kSum);
  for (size_t i = 0; i < dst.size(); ++i) {
    if (isNaN(static_cast<uint16_t>(i))) {
      EXPECT_TRUE(isNaN(dst[i])) << toString(dtype) << " " << i;
    } else {
      EXPECT_EQ(dst[i], i) << toString(dtype);
    }
  }
}

TEST(ReduceKernels, Float16RoundTripsEveryBitPattern) {
  expectRoundTripsEveryBitPattern(DType::kFloat16, isHalfNaN);
}

TEST(ReduceKernels, BFloat16RoundTripsEveryBitPattern) {
  expectRoundTripsEveryBitPattern(DType::kBFloat16, isBFloat16NaN);
}

// Element i of the result, op(a[i], b[i]), computed by the kernel over 300
// copies of the case (vector body and tail both run it).
template <typename S>
S reduceOne(DType dtype, ReduceOp op, S a, S b) {
  std::vector<S> dst(300, a);
  const std::vector<S> src(300, b);
  reduceInto(dst.data(), src.data(), dst.size(), dtype, op);
  for (S x : dst) {
    EXPECT_EQ(std::memcmp(&x, &dst[0], sizeof(S)), 0);
  }
  return dst.back();
}

TEST(ReduceKernels, Float16RoundsToNearestEven) {
  const auto sum = [](uint16_t a, uint16_t b) {
    return reduceOne<uint16_t>(DType::kFloat16, ReduceOp::kSum, a, b);
  };
  const auto product = [](uint16_t a, uint16_t b) {
    return reduceOne<uint16_t>(DType::kFloat16, ReduceOp::kProduct, a, b);
  };
  EXPECT_EQ(sum(0x3c00, 0x1000), 0x3c00);      // 1 + 2^-11: tie, down to even
  EXPECT_EQ(sum(0x3c01, 0x1000), 0x3c02);      // 1 + 3 * 2^-11: tie, up to even
  EXPECT_EQ(sum(0x3c00, 0x1001), 0x3c01);      // just above the tie
  EXPECT_EQ(product(0x0001, 0x3800), 0x0000);  // 2^-25: tie, to zero
  EXPECT_EQ(product(0x0003, 0x3800), 0x0002);  // 1.5 * 2^-24: up to even
  EXPECT_EQ(product(0x03ff, 0x4000), 0x07fe);  // subnormal to normal
  EXPECT_EQ(sum(0x7bff, 0x4c00), 0x7c00);      // 65504 + 16 = 65520: inf
  EXPECT_EQ(sum(0x7bff, 0x4800), 0x7bff);      // 65504 + 8 rounds down
  EXPECT_EQ(sum(0xfbff, 0xcc00), 0xfc00);      // -inf
  EXPECT_EQ(product(0x3c00, 0x7c00), 0x7c00);  // 1 * inf
  EXPECT_TRUE(isHalfNaN(product(0x0000, 0x7c00)));  // 0 * inf
  EXPECT_TRUE(isHalfNaN(sum(0x7c00, 0xfc00)));      // inf - inf
}

TEST(ReduceKernels, BFloat16RoundsToNearestEven) {
  const auto sum = [](uint16_t a, uint16_t b) {
    return reduceOne<uint16_t>(DType::kBFloat16, ReduceOp::kSum, a, b);
  };
  EXPECT_EQ(sum(0x3f80, 0x3b80), 0x3f80);  // 1 + 2^-8: tie, down to even
  EXPECT_EQ(sum(0x3f81, 0x3b80), 0x3f82);  // 1 + 3 * 2^-8: tie, up to even
  EXPECT_EQ(sum(0x7f7f, 0x7f7f), 0x7f80);  // overflow: inf
  EXPECT_EQ(sum(0x0001, 0x0001), 0x0002);  // subnormals
  EXPECT_TRUE(isBFloat16NaN(sum(0x7f80, 0xff80)));
}

// --- NaN, wrap-around, bool.

template <typename T>
void expectMinMaxPropagateNaN(DType dtype, T nan, T one, T two, T three,
                              bool (*isNaN)(T)) {
  // Cases repeat with period 4 over 300 elements, so NaN sits in every
  // vector lane and in the scalar tail.
  const T a[] = {nan, one, nan, two};
  const T b[] = {one, nan, nan, three};
  for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
    std::vector<T> dst(300);
    std::vector<T> src(300);
    for (size_t i = 0; i < dst.size(); ++i) {
      dst[i] = a[i % 4];
      src[i] = b[i % 4];
    }
    reduceInto(dst.data(), src.data(), dst.size(), dtype, op);
    for (size_t i = 0; i < dst.size(); ++i) {
      if (i % 4 == 3) {
        const T want = op == ReduceOp::kMin ? two : three;
        EXPECT_EQ(std::memcmp(&dst[i], &want, sizeof(T)), 0)
            << toString(dtype) << " " << toString(op) << " " << i;
      } else {
        EXPECT_TRUE(isNaN(dst[i]))
            << toString(dtype) << " " << toString(op) << " " << i;
      }
    }
  }
}

TEST(ReduceKernels, FloatingMinMaxPropagateNaN) {
  expectMinMaxPropagateNaN<float>(DType::kFloat32, std::nanf(""), 1.0f, 2.0f,
                                  3.0f, [](float x) { return std::isnan(x); });
  expectMinMaxPropagateNaN<double>(DType::kFloat64, std::nan(""), 1.0, 2.0, 3.0,
                                   [](double x) { return std::isnan(x); });
  expectMinMaxPropagateNaN<uint16_t>(DType::kFloat16, 0x7e00, 0x3c00, 0x4000,
                                     0x4200, isHalfNaN);
  expectMinMaxPropagateNaN<uint16_t>(DType::kBFloat16, 0x7fc0, 0x3f80, 0x4000,
                                     0x4040, isBFloat16NaN);
}

TEST(ReduceKernels, IntegerSumAndProductWrapAround) {
  using I8 = std::numeric_limits<int8_t>;
  using I32 = std::numeric_limits<int32_t>;
  using I64 = std::numeric_limits<int64_t>;
  const auto sum = ReduceOp::kSum;
  const auto product = ReduceOp::kProduct;
  EXPECT_EQ(reduceOne<int8_t>(DType::kInt8, sum, I8::max(), 1), I8::min());
  EXPECT_EQ(reduceOne<int8_t>(DType::kInt8, sum, I8::min(), -1), I8::max());
  EXPECT_EQ(reduceOne<int8_t>(DType::kInt8, product, I8::min(), -1), I8::min());
  EXPECT_EQ(reduceOne<int8_t>(DType::kInt8, product, 16, 16), 0);
  EXPECT_EQ(reduceOne<uint8_t>(DType::kUInt8, sum, 255, 1), 0);
  EXPECT_EQ(reduceOne<uint8_t>(DType::kUInt8, product, 16, 17), 16);
  EXPECT_EQ(reduceOne<int32_t>(DType::kInt32, sum, I32::max(), 1), I32::min());
  EXPECT_EQ(reduceOne<int32_t>(DType::kInt32, product, 65536, 65536), 0);
  EXPECT_EQ(reduceOne<int32_t>(DType::kInt32, product, I32::min(), -1),
            I32::min());
  EXPECT_EQ(reduceOne<int64_t>(DType::kInt64, sum, I64::max(), 1), I64::min());
  EXPECT_EQ(reduceOne<int64_t>(DType::kInt64, product, I64::max(), 2), -2);
  EXPECT_EQ(reduceOne<int64_t>(DType::kInt64, product, I64::min(), -1),
            I64::min());
}

TEST(ReduceKernels, BoolSemantics) {
  // Nonzero bytes other than 1 read as true; results are 0 or 1.
  const uint8_t t = 0x80;  // a true that is not 1
  struct Case {
    ReduceOp op;
    uint8_t ff, ft, tf, tt;
  };
  const Case cases[] = {
      {ReduceOp::kSum, 0, 1, 1, 1},     {ReduceOp::kAvg, 0, 1, 1, 1},
      {ReduceOp::kMax, 0, 1, 1, 1},     {ReduceOp::kBor, 0, 1, 1, 1},
      {ReduceOp::kProduct, 0, 0, 0, 1}, {ReduceOp::kMin, 0, 0, 0, 1},
      {ReduceOp::kBand, 0, 0, 0, 1},    {ReduceOp::kBxor, 0, 1, 1, 0},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(toString(c.op));
    EXPECT_EQ(reduceOne<uint8_t>(DType::kBool, c.op, 0, 0), c.ff);
    EXPECT_EQ(reduceOne<uint8_t>(DType::kBool, c.op, 0, t), c.ft);
    EXPECT_EQ(reduceOne<uint8_t>(DType::kBool, c.op, t, 0), c.tf);
    EXPECT_EQ(reduceOne<uint8_t>(DType::kBool, c.op, t, 0xff), c.tt);
    EXPECT_EQ(reduceOne<uint8_t>(DType::kBool, c.op, 1, 2), c.tt);
  }
}

// reduceThreeWay computes op(a, b) whichever buffer dst is: min(+0, -0) is
// +0 and min(-0, +0) is -0 (the first operand wins a tie).
TEST(ReduceKernels, ThreeWayKeepsOperandOrderUnderAliasing) {
  for (size_t count : kCounts) {
    const std::vector<float> a(count, 0.0f);
    const std::vector<float> b(count, -0.0f);
    std::vector<float> out(count, 1.0f);
    reduceThreeWay(out.data(), a.data(), b.data(), count, DType::kFloat32,
                   ReduceOp::kMin);
    for (float x : out) {
      EXPECT_FALSE(std::signbit(x)) << count;
    }
    std::vector<float> dst = a;
    reduceThreeWay(dst.data(), dst.data(), b.data(), count, DType::kFloat32,
                   ReduceOp::kMin);
    for (float x : dst) {
      EXPECT_FALSE(std::signbit(x)) << count;
    }
    dst = b;
    reduceThreeWay(dst.data(), a.data(), dst.data(), count, DType::kFloat32,
                   ReduceOp::kMin);
    for (float x : dst) {
      EXPECT_FALSE(std::signbit(x)) << count;
    }
    dst = b;
    reduceThreeWay(dst.data(), dst.data(), a.data(), count, DType::kFloat32,
                   ReduceOp::kMin);
    for (float x : dst) {
      EXPECT_TRUE(std::signbit(x)) << count;
    }
  }
}

// --- divideBy.

template <typename T>
std::vector<T> divided(std::vector<T> data, DType dtype, int64_t divisor) {
  divideBy(data.data(), data.size(), dtype, divisor);
  return data;
}

TEST(ReduceKernels, DivideByFloatingTypes) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> f32 =
      divided<float>({10, -7, 3.5f, inf, 0, 1}, DType::kFloat32, 4);
  EXPECT_EQ(f32, (std::vector<float>{2.5f, -1.75f, 0.875f, inf, 0, 0.25f}));
  EXPECT_TRUE(
      std::isnan(divided<float>({std::nanf("")}, DType::kFloat32, 2)[0]));

  std::vector<double> f64(1000);
  for (size_t i = 0; i < f64.size(); ++i) {
    f64[i] = static_cast<double>(i) - 500.25;
  }
  const std::vector<double> f64Out = divided(f64, DType::kFloat64, 3);
  for (size_t i = 0; i < f64.size(); ++i) {
    EXPECT_EQ(f64Out[i], f64[i] / 3.0) << i;
  }

  // float16 and bfloat16 divide in float and round back, for every pattern.
  std::vector<uint16_t> bits(65536);
  for (size_t i = 0; i < bits.size(); ++i) {
    bits[i] = static_cast<uint16_t>(i);
  }
  const std::vector<uint16_t> f16 = divided(bits, DType::kFloat16, 3);
  const std::vector<uint16_t> bf16 = divided(bits, DType::kBFloat16, 7);
  for (size_t i = 0; i < bits.size(); ++i) {
    const uint16_t h = bits[i];
    EXPECT_TRUE(
        Traits<Half>::same(f16[i], refFloatToHalf(refHalfToFloat(h) / 3.0f)))
        << i;
    EXPECT_TRUE(Traits<BFloat16>::same(
        bf16[i], refFloatToBFloat16(refBFloat16ToFloat(h) / 7.0f)))
        << i;
  }
}

TEST(ReduceKernels, DivideByIntegersTruncates) {
  using I32 = std::numeric_limits<int32_t>;
  using I64 = std::numeric_limits<int64_t>;
  EXPECT_EQ(
      divided<int32_t>({7, -7, 8, -8, 0, I32::min(), I32::max()}, DType::kInt32,
                       2),
      (std::vector<int32_t>{3, -3, 4, -4, 0, I32::min() / 2, I32::max() / 2}));
  EXPECT_EQ(divided<int8_t>({-128, 127, -1, 5}, DType::kInt8, 3),
            (std::vector<int8_t>{-42, 42, 0, 1}));
  EXPECT_EQ(divided<int8_t>({-128, 127}, DType::kInt8, 1000),
            (std::vector<int8_t>{0, 0}));
  EXPECT_EQ(divided<uint8_t>({255, 1, 200}, DType::kUInt8, 2),
            (std::vector<uint8_t>{127, 0, 100}));
  EXPECT_EQ(divided<int64_t>({I64::min(), I64::max(), -5}, DType::kInt64, 4),
            (std::vector<int64_t>{I64::min() / 4, I64::max() / 4, -1}));
  EXPECT_EQ(divided<int64_t>({5}, DType::kInt64, 1), (std::vector<int64_t>{5}));
}

TEST(ReduceKernels, DivideByLeavesBoolsAsTheyAre) {
  EXPECT_EQ(divided<uint8_t>({0, 1, 2, 0xff}, DType::kBool, 4),
            (std::vector<uint8_t>{0, 1, 2, 0xff}));
}

TEST(ReduceKernels, CountZeroTouchesNothing) {
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      if (supports(dtype, op)) {
        reduceInto(nullptr, nullptr, 0, dtype, op);
        reduceThreeWay(nullptr, nullptr, nullptr, 0, dtype, op);
      }
    }
    divideBy(nullptr, 0, dtype, 2);
  }
}

}  // namespace
}  // namespace trellis::collectives::detail
