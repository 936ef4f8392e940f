#pragma once
// The Store contract suite (store.h), for every backend: a test binary
// includes this, defines Backends and instantiates StoreContractTest with
// them (store_contract_test.cc: the stores of store/; the etcd store's
// test in tests/elastic).
#include <atomic>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "store_test_util.h"
#include <trellis/core/error.h>
#include <trellis/store/store.h>

namespace trellis::store {
namespace {

using namespace std::chrono_literals;
using testing::TempPath;
using testing::timed;

// A backing store and a way to open more handles ("clients") onto it.
class Backend {
 public:
  virtual ~Backend() = default;
  // A new handle onto the same store (another client / another object).
  virtual std::shared_ptr<Store> connect() = 0;
};

struct BackendParam {
  std::string name;
  std::function<std::unique_ptr<Backend>()> make;
};
// Test logs print the backend's name, not the parameter's bytes.
void PrintTo(const BackendParam& p, std::ostream* os) { *os << p.name; }

class StoreContractTest : public ::testing::TestWithParam<BackendParam> {
 protected:
  void SetUp() override {
    backend_ = GetParam().make();
    store_ = backend_->connect();
  }
  std::shared_ptr<Store> client() { return backend_->connect(); }

  std::unique_ptr<Backend> backend_;
  std::shared_ptr<Store> store_;
};

std::string str(const Bytes& b) { return std::string(b.begin(), b.end()); }

TEST_P(StoreContractTest, SetThenGetReturnsTheValue) {
  store_->set("alpha", "one");
  EXPECT_EQ(store_->getString("alpha"), "one");
  store_->set("alpha", "two");
  EXPECT_EQ(store_->getString("alpha"), "two");
  const Bytes binary = {0, 1, 0, 255, 128};
  store_->set("bin", binary);
  EXPECT_EQ(store_->get("bin"), binary);
  store_->set("empty", "");
  EXPECT_TRUE(store_->get("empty").empty());
  // Another handle sees the same data.
  EXPECT_EQ(client()->getString("alpha"), "two");
}

TEST_P(StoreContractTest, GetOfAMissingKeyTimesOutNamingIt) {
  store_->setTimeout(150ms);
  try {
    store_->get("never-set");
    FAIL() << "get should have timed out";
  } catch (const TimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("never-set"), std::string::npos) << what;
    EXPECT_NE(what.find("150ms"), std::string::npos) << what;
  }
}

TEST_P(StoreContractTest, WaitTimesOutNamingTheKeysAndTimeout) {
  store_->set("present", "x");
  try {
    store_->wait({"present", "absent-key"}, 120ms);
    FAIL() << "wait should have timed out";
  } catch (const TimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("absent-key"), std::string::npos) << what;
    EXPECT_NE(what.find("120ms"), std::string::npos) << what;
  }
  // The default timeout applies to wait(keys).
  store_->setTimeout(100ms);
  EXPECT_THROW(store_->wait({"absent-key"}), TimeoutError);
  EXPECT_NO_THROW(store_->wait({"present"}));
}

TEST_P(StoreContractTest, NegativeTimeoutIsInvalid) {
  EXPECT_THROW(store_->setTimeout(-1ms), InvalidArgumentError);
  EXPECT_THROW(store_->wait({"k"}, -5ms), InvalidArgumentError);
}

TEST_P(StoreContractTest, AddStartsAtZeroAndStoresDecimalText) {
  EXPECT_EQ(store_->add("counter", 3), 3);
  EXPECT_EQ(store_->add("counter", -5), -2);
  EXPECT_EQ(store_->getString("counter"), "-2");
  EXPECT_EQ(store_->add("counter", 0), -2);
  store_->set("text", "hello");
  EXPECT_THROW(store_->add("text", 1), InvalidArgumentError);
  store_->set("big", std::to_string(INT64_MAX));
  EXPECT_THROW(store_->add("big", 1), InvalidArgumentError);
  EXPECT_EQ(store_->getString("big"), std::to_string(INT64_MAX));
}

TEST_P(StoreContractTest, CompareSetFollowsC10dSemantics) {
  // Absent, expected empty: sets.
  EXPECT_EQ(store_->compareSet("cas", "", "first"), "first");
  EXPECT_EQ(store_->getString("cas"), "first");
  // Matches: swaps.
  EXPECT_EQ(store_->compareSet("cas", "first", "second"), "second");
  // Does not match: unchanged, returns the current value.
  EXPECT_EQ(store_->compareSet("cas", "first", "third"), "second");
  EXPECT_EQ(store_->getString("cas"), "second");
  // Absent, expected not empty: returns expected, stores nothing.
  EXPECT_EQ(store_->compareSet("nokey", "want", "new"), "want");
  EXPECT_FALSE(store_->check({"nokey"}));
}

TEST_P(StoreContractTest, CheckDeleteAndNumKeys) {
  const int64_t before = store_->numKeys();
  EXPECT_FALSE(store_->check({"a"}));
  store_->set("a", "1");
  store_->set("b", "2");
  EXPECT_TRUE(store_->check({"a"}));
  EXPECT_TRUE(store_->check({"a", "b"}));
  EXPECT_FALSE(store_->check({"a", "c"}));
  EXPECT_TRUE(store_->check({}));
  EXPECT_EQ(store_->numKeys(), before + 2);
  EXPECT_TRUE(store_->deleteKey("a"));
  EXPECT_FALSE(store_->deleteKey("a"));
  EXPECT_FALSE(store_->check({"a"}));
  EXPECT_EQ(store_->numKeys(), before + 1);
}

TEST_P(StoreContractTest, MultiSetAndMultiGet) {
  store_->multiSet({"m1", "m2", "m3"}, {Bytes{'x'}, Bytes{}, Bytes{'z', 'z'}});
  const auto values = store_->multiGet({"m3", "m1", "m2"});
  ASSERT_EQ(values.size(), 3u);
  EXPECT_EQ(str(values[0]), "zz");
  EXPECT_EQ(str(values[1]), "x");
  EXPECT_TRUE(values[2].empty());
  EXPECT_THROW(store_->multiSet({"a", "b"}, {Bytes{'1'}}),
               InvalidArgumentError);
  store_->setTimeout(100ms);
  EXPECT_THROW(store_->multiGet({"m1", "missing"}), TimeoutError);
}

TEST_P(StoreContractTest, WaiterWakesWhenAnotherClientSets) {
  auto other = client();
  std::atomic<bool> woke{false};
  // Far from its 30 s timeout: the waiter must return soon after the set.
  const auto elapsed = timed([&] {
    std::thread setter([&] {
      std::this_thread::sleep_for(50ms);
      other->set("ready", "go");
    });
    store_->wait({"ready"}, 30s);
    woke = true;
    setter.join();
  });
  EXPECT_TRUE(woke);
  EXPECT_LT(elapsed, 10s);
  EXPECT_EQ(store_->getString("ready"), "go");
}

TEST_P(StoreContractTest, GetBlocksUntilAddCreatesTheKey) {
  auto other = client();
  std::thread adder([&] {
    std::this_thread::sleep_for(50ms);
    other->add("late", 7);
  });
  store_->setTimeout(30s);
  std::string v;
  const auto elapsed = timed([&] { v = store_->getString("late"); });
  adder.join();
  EXPECT_EQ(v, "7");
  EXPECT_LT(elapsed, 10s);
}

TEST_P(StoreContractTest, WaitWithZeroTimeoutMeansNone) {
  // A wait that fell back to this short default would throw within 100 ms.
  store_->setTimeout(100ms);
  auto other = client();
  // The waiter runs aside, holding its own reference to the store, so a
  // wait that never returns fails this test instead of hanging it.
  std::shared_ptr<Store> waiter = store_;
  auto outcome = std::make_shared<std::promise<std::string>>();
  std::future<std::string> result = outcome->get_future();
  std::thread t([waiter, outcome] {
    std::string what = "returned";
    try {
      waiter->wait({"z"}, 0ms);
    } catch (const std::exception& e) {
      what = std::string("threw: ") + e.what();
    }
    outcome->set_value(what);
  });
  // Negative check: give a wait that wrongly used the 100 ms default three
  // times that to throw. Still pending is the only correct state.
  const bool early = result.wait_for(300ms) == std::future_status::ready;
  other->set("z", "1");
  const bool back = result.wait_for(10s) == std::future_status::ready;
  if (!back) {
    // Hung: the thread owns `waiter` and the promise; leave it rather
    // than hang (it ends with the test binary).
    t.detach();
    FAIL() << "wait({\"z\"}, 0ms) did not return within 10 s of the set";
  }
  t.join();
  const std::string got = result.get();
  EXPECT_FALSE(early) << "wait with 0 = no timeout ended before the set: "
                      << got;
  EXPECT_EQ(got, "returned");
  EXPECT_TRUE(store_->check({"z"}));
}

TEST_P(StoreContractTest, ConcurrentAddsFromManyClientsAreAtomic) {
  constexpr int kClients = 6;
  constexpr int kAdds = 40;
  std::vector<std::thread> threads;
  std::vector<std::shared_ptr<Store>> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(client());
  }
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      for (int j = 0; j < kAdds; ++j) {
        clients[i]->add("shared", 1);
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  EXPECT_EQ(store_->getString("shared"), std::to_string(kClients * kAdds));
}

TEST_P(StoreContractTest, OneHandleIsSafeFromManyThreads) {
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      for (int j = 0; j < 25; ++j) {
        store_->add("t", 1);
        store_->set("t" + std::to_string(i), std::to_string(j));
        EXPECT_EQ(store_->getString("t" + std::to_string(i)),
                  std::to_string(j));
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  EXPECT_EQ(store_->getString("t"), "100");
}

}  // namespace
}  // namespace trellis::store
