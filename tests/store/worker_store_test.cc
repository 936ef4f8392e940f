// store/worker_store.h: who serves the workers' store, and the key prefix
// under the launcher's store (TORCHELASTIC_USE_AGENT_STORE=True), on
// 127.0.0.1 with real TCPStore servers and clients.

#include <chrono>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "../rpc/worker_job.h"
#include <trellis/core/auth.h>
#include <trellis/core/error.h>
#include <trellis/core/worker_env.h>
#include <trellis/store/prefix_store.h>
#include <trellis/store/tcp_store.h>
#include <trellis/store/worker_store.h>

namespace trellis::store {
namespace {

using namespace std::chrono_literals;

const auth::JobToken kToken =
    auth::JobToken::fromString("worker-store-test-token-0123456789abcdef");

WorkerStoreOptions options() {
  WorkerStoreOptions o;
  o.jobToken = kToken;
  o.timeout = 5s;
  o.connectTimeout = 2s;
  return o;
}

TEST(WorkerStore, RankZeroServesWithoutTheLaunchersStore) {
  // A port no other test process takes meanwhile (worker_job.h).
  trellis::rpc::testing::PortReservation port;
  MasterEndpoint m;
  m.addr = "127.0.0.1";
  m.port = static_cast<uint16_t>(port.port());
  WorkerStore rank0 = connectWorkerStore(m, 0, options());
  ASSERT_NE(rank0.server, nullptr);
  WorkerStore rank1 = connectWorkerStore(m, 1, options());
  EXPECT_EQ(rank1.server, nullptr);
  rank1.store->set("k", std::string_view("v"));
  EXPECT_EQ(rank0.store->getString("k"), "v");  // no prefix
  EXPECT_NE(rank0.description.find("the rendezvous store at 127.0.0.1:"),
            std::string::npos);
}

TEST(WorkerStore, TheLaunchersStoreIsUsedByEveryRankUnderThePrefix) {
  TCPStoreServerOptions so;
  so.jobToken = kToken;
  TCPStoreServer launcher(so);
  MasterEndpoint m;
  m.addr = "127.0.0.1";
  m.port = launcher.port();
  m.agentStore = true;
  m.keyPrefix = "/worker/attempt_1/round_4";
  WorkerStore rank0 = connectWorkerStore(m, 0, options());
  EXPECT_EQ(rank0.server, nullptr);  // rank 0 serves nothing
  ASSERT_NE(dynamic_cast<PrefixStore*>(rank0.store.get()), nullptr);
  rank0.store->set("k", std::string_view("v"));
  TCPStoreOptions raw;
  raw.port = launcher.port();
  raw.jobToken = kToken;
  raw.timeout = 5s;
  TCPStore unprefixed(raw);
  EXPECT_EQ(unprefixed.getString("/worker/attempt_1/round_4/k"), "v");
  EXPECT_FALSE(unprefixed.check({"k"}));
  EXPECT_NE(rank0.description.find("TORCHELASTIC_USE_AGENT_STORE=True, keys "
                                   "under /worker/attempt_1/round_4"),
            std::string::npos)
      << rank0.description;
}

TEST(WorkerStore, ErrorsKeepTheirTypeAndSayWhichStore) {
  // Reserved, and nobody listens on it.
  trellis::rpc::testing::PortReservation port;
  MasterEndpoint m;
  m.addr = "127.0.0.1";
  m.port = static_cast<uint16_t>(port.port());
  m.agentStore = true;
  m.keyPrefix = "/worker/attempt_0";
  WorkerStoreOptions o = options();
  o.connectTimeout = 300ms;
  try {
    (void)connectWorkerStore(m, 0, o);
    ADD_FAILURE() << "connected to nothing";
  } catch (const ConnectionError& e) {
    const std::string msg = e.error().message();
    EXPECT_NE(msg.find("the launcher's store at 127.0.0.1:"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),
              std::string::npos)
        << msg;
  }
  EXPECT_THROW((void)connectWorkerStore(MasterEndpoint{}, 0, o),
               InvalidArgumentError);
  // A wrong token is an AuthError, still naming the store.
  TCPStoreServerOptions so;
  so.jobToken = kToken;
  TCPStoreServer launcher(so);
  m.port = launcher.port();
  o.jobToken = auth::JobToken::fromString("another-token-0123456789abcdef-xyz");
  try {
    (void)connectWorkerStore(m, 1, o);
    ADD_FAILURE() << "a wrong token was accepted";
  } catch (const AuthError& e) {
    EXPECT_NE(e.error().message().find("the launcher's store"),
              std::string::npos)
        << e.error().message();
  }
}

}  // namespace
}  // namespace trellis::store
