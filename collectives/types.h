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

namespace trellis::collectives {

// What the watchdog does once it found a group stuck (an op past its
// timeout) or broken (docs/collectives.md, "Watchdog"). Either way it
// first names the culprit, writes the flight recorder and fails every
// pending op of the group.
enum class WatchdogMode : uint8_t {
  // Then ends the process with exit code kWatchdogExitCode, so that
  // elastic-run restarts the group: torch.distributed's default for NCCL.
  kExit = 0,
  // Only fails the ops; the process goes on and decides (a new group can
  // be created).
  kFail = 1,
};

// The exit code of a process ended by the watchdog (EX_TEMPFAIL: retry),
// and of one whose watchdog itself was stuck.
constexpr int kWatchdogExitCode = 75;
constexpr int kWatchdogStuckExitCode = 76;

}  // namespace trellis::collectives
