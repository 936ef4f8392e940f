#pragma once
// Element types the collectives layer moves and reduces, without libtorch:
// the cpu backend's hot path and its fuzz targets build on this alone. The
// torch-facing code maps at::ScalarType to DType at the edge.
//
// Not installed (namespace detail). Thread-safe: free functions, no state.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace trellis::collectives::detail {

// The values travel in collective headers (a wire format): never renumber,
// only append. float16 is IEEE binary16, bfloat16 the upper half of an IEEE
// binary32; both are stored as uint16_t bit patterns. kBool is one byte per
// element; 0 is false and any other byte is read as true.
enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt8 = 4,
  kUInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kBool = 8,
};

// Bytes per element; 0 for a value outside the enum (a caller bug: values
// from the network go through dtypeFromWire first).
size_t elementSize(DType dtype);

// "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32",
// "int64", "bool"; "unknown" for a value outside the enum.
std::string_view toString(DType dtype);

// The DType a wire byte names, or nullopt when it names none (the byte comes
// from a peer, so an unknown value is an input error, not a bug).
std::optional<DType> dtypeFromWire(uint8_t value);

// float32, float64, float16 and bfloat16.
constexpr bool isFloatingPoint(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat64 ||
         dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

}  // namespace trellis::collectives::detail
