#pragma once
// Ranks as threads of one process (header only), for the collectives and
// DDP tests: each thread creates its own cpu-backend ProcessGroup over one
// store and runs the test body as that rank.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <trellis/collectives/process_group.h>
#include <trellis/store/hash_store.h>

namespace trellis::collectives::testing {

// Runs fn(rank, group) on n threads and returns what each rank threw
// (creating its group included), "" for a rank that threw nothing. Unless
// `options` say otherwise, groups time out after 60 s and fail their works
// (watchdog fail mode) rather than end the process the ranks share. A null
// `store` is a fresh HashStore.
inline std::vector<std::string> runThreadRanksCollectingFailures(
    int n, const std::function<void(int, std::shared_ptr<ProcessGroup>)>& fn,
    ProcessGroupOptions options = {},
    std::shared_ptr<store::Store> store = nullptr) {
  if (!store) {
    store = std::make_shared<store::HashStore>();
  }
  if (!options.timeout) {
    options.timeout = std::chrono::seconds(60);
  }
  if (!options.watchdogMode) {
    options.watchdogMode = WatchdogMode::kFail;
  }
  std::vector<std::thread> threads;
  std::vector<std::string> failures(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, ProcessGroup::create("cpu", store, r, n, options));
      } catch (const std::exception& e) {
        failures[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  return failures;
}

// The same, where an exception on any rank fails the test naming the rank.
inline void runThreadRanks(
    int n, const std::function<void(int, std::shared_ptr<ProcessGroup>)>& fn,
    ProcessGroupOptions options = {},
    std::shared_ptr<store::Store> store = nullptr) {
  const auto failures = runThreadRanksCollectingFailures(
      n, fn, std::move(options), std::move(store));
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(failures[static_cast<size_t>(r)], "") << "rank " << r;
  }
}

}  // namespace trellis::collectives::testing
