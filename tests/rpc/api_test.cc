// The user-facing API's edges: the timeout model, ShutdownOptions, what a
// remote failure looks like to the caller.
#include <ATen/ATen.h>
#include <ATen/ops/full.h>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "agent_group.h"
#include <trellis/core/error.h>
#include <trellis/rpc/rpc.h>
#include <trellis/store/hash_store.h>
#include <trellis/transport/context.h>

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

// Results and arguments of a chosen size: a large lookup, a dumped table.
std::string bytesOfLength(int64_t n) {
  return std::string(static_cast<size_t>(n), 'b');
}
int64_t lengthOf(std::string s) { return static_cast<int64_t>(s.size()); }
// `n` tensors of `elems` floats each, the i-th all i.
std::vector<at::Tensor> manyTensors(int64_t n, int64_t elems) {
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(at::full({elems}, static_cast<double>(i)));
  }
  return out;
}
int64_t countTensors(std::vector<at::Tensor> ts) {
  return static_cast<int64_t>(ts.size());
}
// Keeps a call in flight on its pipe for `ms`.
int64_t sleepThenEcho(int64_t ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}

}  // namespace

TRELLIS_REMOTE_FUNCTION(addPair);
TRELLIS_REMOTE_FUNCTION(bytesOfLength);
TRELLIS_REMOTE_FUNCTION(lengthOf);
TRELLIS_REMOTE_FUNCTION(manyTensors);
TRELLIS_REMOTE_FUNCTION(countTensors);
TRELLIS_REMOTE_FUNCTION(sleepThenEcho);
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

// A caller that accepts less than a callee returns got its pipe closed,
// and every other call on it failed with a ConnectionError that did not
// say why: now the callee answers that call with the error, and only it.
TEST(RpcApi, AResultTooBigForTheCallerComesBackAsAnErrorAndThePipeStays) {
  Group g(2, rpc::testing::callsBoundedBy(30s), [](int rank, auto& o) {
    if (rank == 0) {
      o.maxMessageBytes = size_t{64} << 10;
    }
  });
  EXPECT_EQ(g[1].workerInfo(0).maxMessageBytes, size_t{64} << 10);
  EXPECT_EQ(g[0].workerInfo(1).maxMessageBytes,
            rpc::RpcOptions{}.maxMessageBytes);
  rpc::CurrentAgentScope scope(&g[0]);
  auto inFlight = rpc::rpcAsync<sleepThenEcho>("w1", 300);
  try {
    rpc::rpcSync<bytesOfLength>("w1", int64_t{1} << 20);
    FAIL() << "no exception";
  } catch (const trellis::RemoteError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.code(), trellis::Code::kResourceExhausted) << what;
    EXPECT_NE(what.find("on worker 'w1' in bytesOfLength"), std::string::npos)
        << what;
    EXPECT_NE(what.find("the result of 'bytesOfLength' does not fit one "
                        "message: the encoding is 1048"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("more than the 65536 that worker 'w0' (rank 0) "
                        "accepts (its RpcOptions::maxMessageBytes)"),
              std::string::npos)
        << what;
  }
  EXPECT_EQ(inFlight.wait(10s), 300);
  EXPECT_EQ(rpc::rpcSync<bytesOfLength>("w1", 60000).size(), 60000u);
  // The limit is on what w0 receives, not on what it sends.
  EXPECT_EQ(rpc::rpcSync<lengthOf>("w1", std::string(1 << 20, 'a')), 1 << 20);
}

TEST(RpcApi, ArgumentsTooBigForTheCalleeFailTheCallBeforeItIsSent) {
  Group g(2, rpc::testing::callsBoundedBy(30s), [](int rank, auto& o) {
    if (rank == 1) {
      o.maxMessageBytes = size_t{64} << 10;
    }
  });
  rpc::CurrentAgentScope scope(&g[0]);
  auto inFlight = rpc::rpcAsync<sleepThenEcho>("w1", 300);
  const uint64_t sent = g[0].stats().messagesSent;
  try {
    rpc::rpcSync<lengthOf>("w1", std::string(1 << 20, 'a'));
    FAIL() << "no exception";
  } catch (const trellis::ResourceExhaustedError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rpc of 'lengthOf' to worker 'w1' (rank 1): the "
                        "arguments do not fit one message: the encoding is "),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("more than the 65536 that worker 'w1' (rank 1) "
                        "accepts"),
              std::string::npos)
        << what;
  }
  EXPECT_EQ(g[0].stats().messagesSent, sent);
  EXPECT_EQ(inFlight.wait(10s), 300);
  EXPECT_EQ(rpc::rpcSync<lengthOf>("w1", std::string(60000, 'a')), 60000);
  // Tensors do not count, also those small enough to travel inside the
  // bytes: 64 KiB of them make a payload above w1's 64 KiB, which w1
  // accepts.
  const auto perMessage = static_cast<int64_t>(
      rpc::Encoder::kInlineBytesPerMessage / rpc::Encoder::kInlineTensorBytes);
  const auto small = manyTensors(
      perMessage, static_cast<int64_t>(rpc::Encoder::kInlineTensorBytes / 4));
  EXPECT_EQ(rpc::rpcSync<countTensors>("w1", small), perMessage);
}

TEST(RpcApi, MoreTensorsThanAMessageCarriesFailThatCallOnly) {
  Group g(2, rpc::testing::callsBoundedBy(30s));
  rpc::CurrentAgentScope scope(&g[0]);
  const size_t most = trellis::transport::Limits{}.maxTensorsPerMessage;
  const auto n = static_cast<int64_t>(most + 1);
  // Too big to travel inside the argument bytes: each is a transport
  // tensor of its own, which the limit counts.
  const auto apart =
      static_cast<int64_t>(rpc::Encoder::kInlineTensorBytes / 4 + 1);
  auto inFlight = rpc::rpcAsync<sleepThenEcho>("w1", 300);
  try {
    rpc::rpcSync<manyTensors>("w1", n, apart);
    FAIL() << "no exception";
  } catch (const trellis::RemoteError& e) {
    EXPECT_EQ(e.code(), trellis::Code::kResourceExhausted);
    EXPECT_NE(std::string(e.what()).find(
                  "does not fit one message: " + std::to_string(n) +
                  " tensors, more than one message carries (" +
                  std::to_string(most) + ")"),
              std::string::npos)
        << e.what();
  }
  std::vector<at::Tensor> args = manyTensors(n, apart);
  EXPECT_THROW(rpc::rpcSync<countTensors>("w1", args),
               trellis::ResourceExhaustedError);
  EXPECT_EQ(inFlight.wait(10s), 300);
  const auto fits =
      rpc::rpcSync<manyTensors>("w1", static_cast<int64_t>(most), apart);
  ASSERT_EQ(fits.size(), most);
  EXPECT_EQ(fits.back()[apart - 1].item<float>(), static_cast<float>(most - 1));
  args.pop_back();
  EXPECT_EQ(rpc::rpcSync<countTensors>("w1", args), static_cast<int64_t>(most));
  // One-element tensors travel inside the bytes (up to
  // Encoder::kInlineBytesPerMessage of them): as many again fit.
  const auto small = rpc::rpcSync<manyTensors>("w1", n, 1);
  ASSERT_EQ(small.size(), static_cast<size_t>(n));
  EXPECT_EQ(small.back().item<float>(), static_cast<float>(most));
  EXPECT_EQ(rpc::rpcSync<countTensors>("w1", manyTensors(n, 1)), n);
}

TEST(RpcApi, AMalformedRendezvousEntryFailsStartNamingTheRank) {
  rpc::RpcOptions o;
  o.maxMessageBytes = 0;
  EXPECT_THROW(rpc::Agent::start("w0", 0, 1, o), trellis::InvalidArgumentError);
  for (const std::string entry :
       {"w1\nuv://127.0.0.1:1", "w1\nuv://127.0.0.1:1\n-5",
        "w1\nuv://127.0.0.1:1\n12x", "w1\nuv://127.0.0.1:1\n0"}) {
    auto store = std::make_shared<trellis::store::HashStore>();
    store->set("trellis/rpc/worker/1",
               std::vector<uint8_t>(entry.begin(), entry.end()));
    rpc::RpcOptions options;
    options.store = store;
    options.localAddress = "127.0.0.1";
    options.initTimeout = 10s;
    try {
      rpc::Agent::start("w0", 0, 2, options);
      FAIL() << "started with the entry " << entry;
    } catch (const trellis::ProtocolError& e) {
      EXPECT_NE(
          std::string(e.what()).find("malformed rendezvous entry for rank 1"),
          std::string::npos)
          << e.what();
    }
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
