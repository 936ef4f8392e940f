#pragma once
// Element-wise reduction kernels of the collectives layer: the cpu backend
// folds each received chunk into its buffer with reduceInto (or
// reduceThreeWay, for algorithms that reduce out of place) and finishes kAvg
// with divideBy. No libtorch: these build fast and are fuzzable alone.
//
// Contract shared by every function here:
//  - Buffers hold `count` elements of `dtype`, each aligned to its element
//    size; count 0 touches nothing (the pointers may then be null).
//  - The caller checks supports(dtype, op) first (an unsupported pair, like
//    an out-of-range enum value, is a bug: it aborts via TRELLIS_CHECK).
//  - The dtype/op dispatch happens once per call; the inner loops are plain
//    loops the compiler vectorises, float16/bfloat16 go through float in
//    blocks. No allocation, no locks, no state: any thread may call them on
//    disjoint buffers concurrently.
//
// Semantics follow torch.distributed:
//  - kAvg reduces as kSum; the caller divides once at the end (divideBy).
//  - Floating min/max propagate NaN: if either input is NaN the result is.
//  - Integer sum/product wrap around (two's complement), never trap.
//  - float16/bfloat16 are computed in float and rounded back to nearest,
//    ties to even (overflow gives inf, NaN stays NaN).
//  - Bool (one byte per element; any nonzero byte reads as true, results are
//    written as 0 or 1): kSum and kMax are or, kProduct and kMin are and,
//    kBand and, kBor or, kBxor xor.

#include <cstddef>
#include <cstdint>

#include <trellis/collectives/dtype.h>
#include <trellis/collectives/types.h>

namespace trellis::collectives::detail {

// False for kBand/kBor/kBxor on floating types and for values outside
// either enum; true otherwise.
bool supports(DType dtype, ReduceOp op);

// dst[i] = op(dst[i], src[i]) for i < count. src must not overlap dst.
void reduceInto(void* dst, const void* src, size_t count, DType dtype,
                ReduceOp op);

// dst[i] = op(a[i], b[i]) for i < count. dst may be exactly a or exactly b
// (not a partial overlap); otherwise it overlaps neither. a and b may be the
// same buffer only if dst is a different one.
void reduceThreeWay(void* dst, const void* a, const void* b, size_t count,
                    DType dtype, ReduceOp op);

// data[i] /= divisor, the end of kAvg (divisor: the number of contributions,
// > 0). Floating types divide (float16/bfloat16 in float, rounded back);
// integers use truncating division, as torch's integer avg. Bool is left
// as it is: an average of bools has no torch meaning (kAvg on bool reduces
// as a logical or).
void divideBy(void* data, size_t count, DType dtype, int64_t divisor);

}  // namespace trellis::collectives::detail
