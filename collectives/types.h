#pragma once
// Small value types of the collectives layer (docs/collectives.md).
#include <cstdint>
#include <string_view>

namespace trellis::collectives {

// How allreduce, reduce and reduceScatter combine the ranks' elements, with
// torch.distributed's meaning. kAvg sums and then divides by the number of
// contributing ranks (integers: truncating division, as torch). kBand, kBor
// and kBxor are for integer and bool tensors only. On bool tensors kSum and
// kMax are a logical or, kProduct and kMin a logical and.
enum class ReduceOp : uint8_t {
  kSum = 0,
  kAvg = 1,
  kProduct = 2,
  kMin = 3,
  kMax = 4,
  kBand = 5,
  kBor = 6,
  kBxor = 7,
};

// "sum", "avg", ...; "unknown" for a value outside the enum.
std::string_view toString(ReduceOp op);

}  // namespace trellis::collectives
