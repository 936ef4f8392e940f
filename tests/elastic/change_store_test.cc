// ChangeStore (elastic/change_store.h): waits for a key's value to change,
// over a real TCPStoreServer on loopback with one client per "node".
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include <trellis/core/auth.h>
#include <trellis/elastic/change_store.h>
#include <trellis/store/tcp_store.h>

namespace {

using namespace std::chrono_literals;
using trellis::elastic::ChangeStore;
using Clock = std::chrono::steady_clock;

class ChangeStoreTest : public ::testing::Test {
 protected:
  ChangeStoreTest() {
    trellis::store::TCPStoreServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.jobToken = token_;
    server_ = std::make_unique<trellis::store::TCPStoreServer>(std::move(o));
  }

  std::unique_ptr<ChangeStore> node() {
    trellis::store::TCPStoreOptions o;
    o.host = "127.0.0.1";
    o.port = server_->port();
    o.timeout = 30s;
    o.jobToken = token_;
    return std::make_unique<ChangeStore>(
        std::make_unique<trellis::store::TCPStore>(std::move(o)));
  }

  trellis::auth::JobToken token_ = trellis::auth::JobToken::generate();
  std::unique_ptr<trellis::store::TCPStoreServer> server_;
};

// Waits in a thread; returns (changed, how long it took).
std::future<std::pair<bool, Clock::duration>> waitAsync(
    ChangeStore& s, const std::string& key, const std::string& seen,
    std::chrono::milliseconds bound) {
  return std::async(std::launch::async, [&s, key, seen, bound] {
    const auto t0 = Clock::now();
    const bool changed = s.waitForChange(key, seen, bound);
    return std::make_pair(changed, Clock::now() - t0);
  });
}

TEST_F(ChangeStoreTest, AWriteByAnotherNodeEndsTheWaitBeforeItsBound) {
  auto a = node();
  auto b = node();
  a->set("record", std::string_view("v1"));
  auto w = waitAsync(*a, "record", "v1", 20s);
  std::this_thread::sleep_for(100ms);  // let it reach its wait
  EXPECT_EQ(b->compareSet("record", "v1", "v2"), "v2");
  ASSERT_EQ(w.wait_for(10s), std::future_status::ready);
  const auto [changed, took] = w.get();
  EXPECT_TRUE(changed);
  EXPECT_LT(took, 10s);
  EXPECT_EQ(a->getString("record"), "v2");
}

TEST_F(ChangeStoreTest, CountersAndAbsentKeysWakeWaitersToo) {
  auto a = node();
  auto b = node();
  (void)a->add("done", 1);
  auto w = waitAsync(*a, "done", "1", 20s);
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(b->add("done", 1), 2);
  ASSERT_EQ(w.wait_for(10s), std::future_status::ready);
  EXPECT_TRUE(w.get().first);

  auto m = waitAsync(*a, "master", "", 20s);  // absent until set
  std::this_thread::sleep_for(100ms);
  b->set("master", std::string_view("10.0.0.1 29500"));
  ASSERT_EQ(m.wait_for(10s), std::future_status::ready);
  EXPECT_TRUE(m.get().first);
}

TEST_F(ChangeStoreTest,
       NoChangeWaitsOutTheBoundAndAChangeMadeBeforeReturnsAtOnce) {
  auto a = node();
  auto b = node();
  a->set("record", std::string_view("v1"));
  const auto t0 = Clock::now();
  EXPECT_FALSE(a->waitForChange("record", "v1", 200ms));
  EXPECT_GE(Clock::now() - t0, 200ms);
  // A failed compareSet and an add of 0 change nothing and wake no one.
  EXPECT_EQ(b->compareSet("record", "other", "v9"), "v1");
  (void)b->add("done", 0);
  EXPECT_FALSE(a->waitForChange("record", "v1", 100ms));
  // The value moved before the wait began: no waiting at all.
  b->set("record", std::string_view("v2"));
  const auto t1 = Clock::now();
  EXPECT_TRUE(a->waitForChange("record", "v1", 20s));
  EXPECT_LT(Clock::now() - t1, 5s);
}

// Writes through a plain handle (an agent without ticks) still end the
// wait at its bound, and the tick keys a key leaves behind stay bounded.
TEST_F(ChangeStoreTest, TicksAreBoundedAndPlainWritersCostOnlyTheBound) {
  auto a = node();
  for (int i = 0; i < 3 * ChangeStore::kKeptTicks; ++i) {
    a->set("record", std::string_view(std::to_string(i)));
  }
  const int64_t n = 3 * ChangeStore::kKeptTicks;
  EXPECT_EQ(a->add(ChangeStore::changesKey("record"), 0), n);
  EXPECT_TRUE(a->check({ChangeStore::tickKey("record", n)}));
  EXPECT_TRUE(a->check(
      {ChangeStore::tickKey("record", n - ChangeStore::kKeptTicks + 1)}));
  EXPECT_FALSE(
      a->check({ChangeStore::tickKey("record", n - ChangeStore::kKeptTicks)}));
  EXPECT_FALSE(a->check({ChangeStore::tickKey("record", 1)}));
  // record + its count + kKeptTicks ticks.
  EXPECT_EQ(a->numKeys(), 2 + ChangeStore::kKeptTicks);

  trellis::store::TCPStoreOptions o;
  o.host = "127.0.0.1";
  o.port = server_->port();
  o.timeout = 30s;
  o.jobToken = token_;
  trellis::store::TCPStore plain(std::move(o));
  const std::string last = std::to_string(n - 1);
  auto w = waitAsync(*a, "record", last, 300ms);
  std::this_thread::sleep_for(50ms);
  plain.set("record", std::string_view("untracked"));
  ASSERT_EQ(w.wait_for(10s), std::future_status::ready);
  EXPECT_FALSE(w.get().first);  // not woken: its bound ended the wait
  EXPECT_TRUE(a->waitForChange("record", last, 100ms));  // and it moved
}

// Garbage where a change count should be (any client with the job token
// can write it) turns that key's ticks off, and nothing else: writes
// succeed, waits end at their bound.
TEST_F(ChangeStoreTest, AGarbledChangeCountFallsBackToTheBound) {
  auto a = node();
  auto b = node();
  a->set(ChangeStore::changesKey("record"), std::string_view("not a number"));
  b->set("record", std::string_view("v1"));
  EXPECT_EQ(b->compareSet("record", "v1", "v2"), "v2");
  const auto t0 = Clock::now();
  EXPECT_FALSE(a->waitForChange("record", "v2", 150ms));
  EXPECT_GE(Clock::now() - t0, 150ms);
  EXPECT_TRUE(a->waitForChange("record", "v1", 150ms));
}

}  // namespace
