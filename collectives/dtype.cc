#include <trellis/collectives/dtype.h>

namespace trellis::collectives::detail {

size_t elementSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat64:
      return 8;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kBool:
      return 1;
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

std::string_view toString(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt8:
      return "int8";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kBool:
      return "bool";
  }
  return "unknown";
}

std::optional<DType> dtypeFromWire(uint8_t value) {
  if (value > static_cast<uint8_t>(DType::kBool)) {
    return std::nullopt;
  }
  return static_cast<DType>(value);
}

}  // namespace trellis::collectives::detail
