#pragma once
// Ranks as threads of one process for the DDP tests: the collectives
// tests' helper (tests/collectives/thread_ranks.h) under the DDP tests'
// namespace.
#include "../collectives/thread_ranks.h"

namespace trellis::ddp::testing {

using collectives::testing::runThreadRanks;

// Runs fn(rank, group) on n threads, one cpu-backend group each.
inline void runRanks(
    int n,
    const std::function<void(int, std::shared_ptr<collectives::ProcessGroup>)>&
        fn) {
  runThreadRanks(n, fn);
}

}  // namespace trellis::ddp::testing
