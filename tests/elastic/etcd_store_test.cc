// EtcdStore against a real etcd (etcd_server.h): the Store contract suite
// (tests/store/store_contract.h), then what is etcd's own: keys under the
// run's prefix, Watch waking waiters, errors that name the endpoint when
// etcd is gone (never a hang), leases that expire and make a node dead.
#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include <gtest/gtest.h>

#include "../store/store_contract.h"
#include "etcd_server.h"
#include <trellis/core/error.h>
#include <trellis/elastic/etcd_store.h>
#include <trellis/elastic/rendezvous.h>

namespace trellis::elastic {
namespace {

using namespace std::chrono_literals;
using testing::EtcdServer;
using Clock = std::chrono::steady_clock;

// One etcd for the contract suite, started on first use and killed (by
// pid) when the binary's tests end.
std::unique_ptr<EtcdServer>& sharedSlot() {
  static std::unique_ptr<EtcdServer> server;
  return server;
}
EtcdServer* sharedEtcd() {
  static const bool started = [] {
    sharedSlot() = std::make_unique<EtcdServer>();
    return sharedSlot()->start();
  }();
  return started ? sharedSlot().get() : nullptr;
}

class KillSharedEtcd : public ::testing::Environment {
 public:
  void TearDown() override { sharedSlot().reset(); }
};
const auto* const kKillSharedEtcd =
    ::testing::AddGlobalTestEnvironment(new KillSharedEtcd);

EtcdStoreOptions optionsFor(const EtcdServer& server, std::string prefix) {
  EtcdStoreOptions o;
  o.port = server.port();
  o.prefix = std::move(prefix);
  o.timeout = 60s;
  return o;
}

// Each backend instance: a fresh prefix in the shared etcd.
class EtcdBackend : public store::Backend {
 public:
  EtcdBackend() {
    static int counter = 0;
    prefix_ = "/trellis-contract/" + std::to_string(::getpid()) + "/" +
              std::to_string(counter++) + "/";
  }
  std::shared_ptr<store::Store> connect() override {
    EtcdServer* server = sharedEtcd();
    if (server == nullptr) {
      throw ConnectionError(Error::connection(
          "the test's etcd (" + std::string(testing::kEtcdBinary) +
          ") did not start"));
    }
    return std::make_shared<EtcdStore>(optionsFor(*server, prefix_));
  }

 private:
  std::string prefix_;
};

}  // namespace
}  // namespace trellis::elastic

namespace trellis::store {
namespace {
// The suite's tests, run with the etcd store.
INSTANTIATE_TEST_SUITE_P(
    Etcd, StoreContractTest,
    ::testing::Values(BackendParam{
        "Etcd",
        [] { return std::make_unique<trellis::elastic::EtcdBackend>(); }}),
    [](const auto& info) { return info.param.name; });
}  // namespace
}  // namespace trellis::store

namespace trellis::elastic {
namespace {

class EtcdStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::haveEtcd()) {
      GTEST_SKIP() << testing::kEtcdBinary << " is not installed";
    }
    ASSERT_TRUE(server_.start())
        << "etcd did not start; its log is in " << server_.dir();
  }
  EtcdServer server_;
};

TEST_F(EtcdStoreTest, RendezvousKeysLiveUnderTheRunsPrefix) {
  EtcdStoreOptions o = optionsFor(server_, "/trellis/rdzv/job7/");
  o.strip = kKeyPrefix;
  EtcdStore job7(o);
  EXPECT_EQ(job7.etcdKey(kRoundKey), "/trellis/rdzv/job7/round");
  EXPECT_EQ(job7.etcdKey(heartbeatKey("n1")), "/trellis/rdzv/job7/hb/n1");
  job7.set(kRoundKey, "seven");
  o.prefix = "/trellis/rdzv/job8/";
  EtcdStore job8(o);
  EXPECT_FALSE(job8.check({kRoundKey}));
  EXPECT_EQ(job8.numKeys(), 0);
  EXPECT_EQ(job7.numKeys(), 1);
  // Seen raw (no strip), the key is where docs/elastic.md says.
  EtcdStore raw(optionsFor(server_, ""));
  EXPECT_EQ(raw.getString("/trellis/rdzv/job7/round"), "seven");
}

TEST_F(EtcdStoreTest, AWaiterWakesOnTheWatchSoonAfterTheSet) {
  EtcdStore a(optionsFor(server_, "/w/"));
  EtcdStore b(optionsFor(server_, "/w/"));
  auto waiter = std::async(std::launch::async, [&] {
    const auto t0 = Clock::now();
    a.wait({"k1", "k2"}, 20s);
    return Clock::now() - t0;
  });
  std::this_thread::sleep_for(200ms);
  b.set("k1", "1");
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(waiter.wait_for(0s), std::future_status::timeout);
  b.set("k2", "2");
  ASSERT_EQ(waiter.wait_for(5s), std::future_status::ready);
  EXPECT_LT(waiter.get(), 3s);
  // A delete does not wake a get; a later put does.
  b.set("gone", "x");
  EXPECT_TRUE(b.deleteKey("gone"));
  a.setTimeout(20s);
  auto getter =
      std::async(std::launch::async, [&] { return a.getString("gone"); });
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(getter.wait_for(0s), std::future_status::timeout);
  b.set("gone", "back");
  ASSERT_EQ(getter.wait_for(5s), std::future_status::ready);
  EXPECT_EQ(getter.get(), "back");
}

// What the rendezvous waits on between moves.
TEST_F(EtcdStoreTest, WaitForChangeReturnsAtOnceOrOnTheNextMove) {
  EtcdStore a(optionsFor(server_, "/c/"));
  EtcdStore b(optionsFor(server_, "/c/"));
  EXPECT_TRUE(a.waitForChange("k", "x", 5s));  // absent is not "x"
  auto t0 = Clock::now();
  EXPECT_FALSE(a.waitForChange("k", "", 200ms));  // still absent
  EXPECT_GE(Clock::now() - t0, 150ms);
  b.set("k", "v");
  EXPECT_TRUE(a.waitForChange("k", "", 5s));
  // A delete wakes it too (a lease that expired).
  auto waiter = std::async(std::launch::async,
                           [&] { return a.waitForChange("k", "v", 20s); });
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(waiter.wait_for(0s), std::future_status::timeout);
  t0 = Clock::now();
  EXPECT_TRUE(b.deleteKey("k"));
  ASSERT_EQ(waiter.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(waiter.get());
  EXPECT_LT(Clock::now() - t0, 3s);
}

TEST_F(EtcdStoreTest, AKilledEtcdIsAnErrorNamingTheEndpointNeverAHang) {
  EtcdStore store(optionsFor(server_, "/trellis/rdzv/job/"));
  store.set("round", "1");
  store.setTimeout(3s);
  // A waiter blocked in a Watch when etcd dies.
  auto waiter = std::async(std::launch::async, [&]() -> std::string {
    try {
      store.wait({"never"}, 20s);
      return "returned";
    } catch (const Exception& e) {
      return e.what();
    }
  });
  std::this_thread::sleep_for(200ms);
  const auto t0 = Clock::now();
  server_.kill();
  ASSERT_EQ(waiter.wait_for(10s), std::future_status::ready);
  const std::string waited = waiter.get();
  EXPECT_NE(waited.find("etcd " + server_.endpoint()), std::string::npos)
      << waited;
  try {
    (void)store.compareSet("round", "1", "2");
    FAIL() << "compareSet on a dead etcd succeeded";
  } catch (const ConnectionError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("etcd " + server_.endpoint() +
                        ": Txn on /trellis/rdzv/job/round: UNAVAILABLE"),
              std::string::npos)
        << what;
  } catch (const TimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("etcd " + server_.endpoint() + ": Txn on"),
              std::string::npos)
        << what;
  }
  EXPECT_LT(Clock::now() - t0, 10s);
}

TEST_F(EtcdStoreTest, AnUnreachableEtcdIsNamedWithinTheConnectTimeout) {
  EtcdStoreOptions o = optionsFor(server_, "/x/");
  o.port = pickFreePort("127.0.0.1");  // nobody listens there
  o.connectTimeout = 500ms;
  const auto t0 = Clock::now();
  try {
    EtcdStore store(o);
    FAIL() << "connected to nothing";
  } catch (const ConnectionError& e) {
    EXPECT_NE(
        std::string(e.what()).find("etcd 127.0.0.1:" + std::to_string(o.port) +
                                   ": cannot connect within 500ms"),
        std::string::npos)
        << e.what();
  }
  EXPECT_LT(Clock::now() - t0, 5s);
}

TEST_F(EtcdStoreTest, AnExpiredLeaseDeletesTheKeyAndTheNodeIsDead) {
  EtcdStore store(optionsFor(server_, "/trellis/rdzv/job/"));
  const int64_t lease = store.grantLease(2s);
  store.setWithLease(heartbeatKey("n1"), "alive", lease);
  store.set(heartbeatKey("n2"), "alive");  // no lease: never expires
  Liveness liveness(2s, LivenessMode::kLease);
  liveness.observe(store, {"n1", "n2"}, RdzvClock::now());
  EXPECT_FALSE(liveness.dead("n1", RdzvClock::now()));
  // Kept alive past its TTL: still there.
  for (int i = 0; i < 3; ++i) {
    std::this_thread::sleep_for(1s);
    EXPECT_GT(store.keepAlive(lease), 0);
  }
  EXPECT_TRUE(store.check({heartbeatKey("n1")}));
  // Left alone: gone within the TTL and etcd's expiry check.
  const auto t0 = Clock::now();
  while (store.check({heartbeatKey("n1")}) && Clock::now() - t0 < 10s) {
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_LT(Clock::now() - t0, 5s);
  liveness.observe(store, {"n1", "n2"}, RdzvClock::now());
  EXPECT_TRUE(liveness.dead("n1", RdzvClock::now()));
  EXPECT_FALSE(liveness.dead("n2", RdzvClock::now()));
  EXPECT_LE(store.keepAlive(lease), 0);
  // Revoking deletes at once.
  const int64_t other = store.grantLease(30s);
  store.setWithLease("k", "v", other);
  store.revokeLease(other);
  EXPECT_FALSE(store.check({"k"}));
}

TEST_F(EtcdStoreTest, GarbageInTheRoundRecordIsAProtocolErrorNamingIt) {
  EtcdStoreOptions o = optionsFor(server_, "/trellis/rdzv/job/");
  o.strip = kKeyPrefix;
  EtcdStore store(o);
  store.set(kRoundKey, std::string_view("round 7\nphase ???\n"));
  try {
    (void)readRoundRecord(store);
    FAIL() << "garbage decoded";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("trellis/rdzv/round"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace trellis::elastic
