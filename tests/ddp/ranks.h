#pragma once
// Ranks as threads of one process for the DDP tests (header only): each
// with its own ProcessGroup (cpu backend) over one HashStore.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <trellis/collectives/process_group.h>
#include <trellis/store/hash_store.h>

namespace trellis::ddp::testing {

// Runs fn(rank, group) on n threads; an exception on any rank fails the
// test naming the rank. Groups time out after 60 s and fail their works
// (watchdog fail mode) rather than end the process the ranks share.
inline void runRanks(
    int n,
    const std::function<void(int, std::shared_ptr<collectives::ProcessGroup>)>&
        fn) {
  auto store = std::make_shared<store::HashStore>();
  collectives::ProcessGroupOptions options;
  options.timeout = std::chrono::seconds(60);
  options.watchdogMode = collectives::WatchdogMode::kFail;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, collectives::ProcessGroup::create("cpu", store, r, n, options));
      } catch (const std::exception& e) {
        failures[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(failures[static_cast<size_t>(r)], "") << "rank " << r;
  }
}

}  // namespace trellis::ddp::testing
