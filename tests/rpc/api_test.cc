// The user-facing API's edges: the timeout model, ShutdownOptions, what a
// remote failure looks like to the caller.
#include <ATen/ATen.h>
#include <chrono>
#include <string>

#include <gtest/gtest.h>

#include "agent_group.h"
#include <trellis/core/error.h>
#include <trellis/rpc/rpc.h>

namespace {

namespace rpc = trellis::rpc;
using Group = rpc::testing::AgentGroup;
using namespace std::chrono_literals;

int64_t addPair(int64_t a, int64_t b) { return a + b; }
int64_t findRow(int64_t row) {
  throw trellis::NotFoundError(
      trellis::Error::notFound("no row " + std::to_string(row)));
}
at::Tensor selfProduct(at::Tensor a) { return at::matmul(a, a); }
// A message longer than an envelope carries (a dump of a big tensor).
int64_t failsAtLength(int64_t n) {
  throw std::runtime_error(
      "bad batch: " + std::string(static_cast<size_t>(n), 'x') + " end");
}
// A message that is not UTF-8 (a Latin-1 file name, raw bytes).
int64_t failsInLatin1(int64_t) {
  throw std::runtime_error("no such file: caf\xe9.bin");
}

}  // namespace

TRELLIS_REMOTE_FUNCTION(addPair);
TRELLIS_REMOTE_FUNCTION(findRow);
TRELLIS_REMOTE_FUNCTION(selfProduct);
TRELLIS_REMOTE_FUNCTION(failsInLatin1);
TRELLIS_REMOTE_FUNCTION(failsAtLength);

namespace {

TEST(RpcApi, ANegativeCallTimeoutIsTheCallersError) {
  Group g(2);
  rpc::CurrentAgentScope scope(&g[0]);
  try {
    rpc::rpcSync<addPair>({"w1", -1s}, 1, 2);
    FAIL() << "a negative timeout was accepted";
  } catch (const trellis::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("rpc timeout must be >= 0"),
              std::string::npos)
        << e.what();
  }
  auto f = rpc::rpcAsync<addPair>({"w1", -5ms}, 1, 2);
  EXPECT_THROW(f.wait(10s), trellis::InvalidArgumentError);
  EXPECT_EQ(g[0].stats().messagesSent, 0u);  // nothing left the worker
  // Unset: the default (60 s); zero: none. Both reach the callee.
  EXPECT_EQ(rpc::rpcSync<addPair>("w1", 1, 2), 3);
  EXPECT_EQ(rpc::rpcSync<addPair>({"w1", 0s}, 2, 2), 4);
}

TEST(RpcApi, RemoteErrorKeepsTheRemoteCodeAndOnlyTheFirstLine) {
  Group g(2);
  rpc::CurrentAgentScope scope(&g[0]);
  try {
    rpc::rpcSync<findRow>("w1", 7);
    FAIL() << "no exception";
  } catch (const trellis::RemoteError& e) {
    EXPECT_EQ(e.code(), trellis::Code::kNotFound);
    EXPECT_EQ(std::string(e.what()),
              "NOT_FOUND: on worker 'w1' in findRow (trellis::NotFoundError): "
              "no row 7");
  }
  try {
    rpc::rpcSync<selfProduct>("w1", at::ones({2, 3}));
    FAIL() << "no exception";
  } catch (const trellis::RemoteError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.code(), trellis::Code::kUnknown);
    EXPECT_NE(what.find("(c10::Error)"), std::string::npos) << what;
    EXPECT_NE(what.find("cannot be multiplied"), std::string::npos) << what;
    // libtorch's what() has its C++ backtrace ("frame #0: ...") and a
    // source place after "Exception raised from".
    EXPECT_EQ(what.find("frame #"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

TEST(RpcApi, AnErrorMessageThatIsNotUtf8ComesBackAndThePipeStays) {
  Group g(2);
  rpc::CurrentAgentScope scope(&g[0]);
  try {
    rpc::rpcSync<failsInLatin1>("w1", 1);
    FAIL() << "no exception";
  } catch (const trellis::RemoteError& e) {
    EXPECT_NE(std::string(e.what()).find("no such file: caf"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(rpc::rpcSync<addPair>("w1", 1, 2), 3);
}

TEST(RpcApi, AnErrorMessageTooLongForTheEnvelopeComesBackCut) {
  Group g(2);
  rpc::CurrentAgentScope scope(&g[0]);
  for (int64_t n : {int64_t{1000}, int64_t{200000}}) {
    try {
      rpc::rpcSync<failsAtLength>("w1", n);
      FAIL() << "no exception";
    } catch (const trellis::RemoteError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("bad batch: xxx"), std::string::npos);
      EXPECT_LE(what.size(), size_t{70000});
      if (n == 1000) {
        EXPECT_NE(what.find("xx end"), std::string::npos);
      } else {
        EXPECT_NE(what.find("bytes, the rest cut]"), std::string::npos)
            << what.substr(0, 200);
      }
    }
    EXPECT_EQ(rpc::rpcSync<addPair>("w1", 1, 2), 3);
  }
}

TEST(RpcApi, WhatHasNoSourcePlace) {
  const trellis::Error e = trellis::Error::timeout("store get(k) timed out");
  EXPECT_EQ(e.what(), "DEADLINE_EXCEEDED: store get(k) timed out");
  EXPECT_NE(e.where().find("api_test.cc:"), std::string::npos) << e.where();
}

TEST(RpcApi, ARefusedShutdownChangesNothing) {
  Group g(2);
  EXPECT_THROW(g[0].shutdown({.drainTimeout = -1s}),
               trellis::InvalidArgumentError);
  EXPECT_THROW(g[0].shutdown({.graceful = true, .arrivalTimeout = -1ms}),
               trellis::InvalidArgumentError);
  EXPECT_FALSE(g[0].isShutDown());
  rpc::CurrentAgentScope scope(&g[0]);
  EXPECT_EQ(rpc::rpcSync<addPair>("w1", 20, 22), 42);
  g.shutdownAll(true);
  EXPECT_TRUE(g[0].isShutDown());
}

TEST(RpcApi, ProcessAgentSurvivesARefusedShutdown) {
  rpc::RpcOptions o;
  o.store = std::make_shared<trellis::store::HashStore>();
  o.localAddress = "127.0.0.1";
  rpc::init("solo", 0, 1, o);
  EXPECT_THROW(rpc::shutdown({.drainTimeout = -1s}),
               trellis::InvalidArgumentError);
  EXPECT_EQ(rpc::rpcSync<addPair>("solo", 1, 1), 2);
  rpc::shutdown({.drainTimeout = 10s});
  EXPECT_THROW(rpc::getWorkerInfo(), trellis::FailedPreconditionError);
}

}  // namespace
