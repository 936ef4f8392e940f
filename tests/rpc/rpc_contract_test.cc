// The RPC contract, run over every transport / channel combination the
// agent can be restricted to (RpcOptions::transports / channels): sync and
// async calls, remote errors with their origin and code, timeouts naming
// callee and function, tensors (large ones take the channel's out-of-band
// path), a peer that closes, and both kinds of shutdown. Several agents in
// one process (agent_group.h); agent_test.cc has the agent's other cases.
//
// A backend that is not viable on this machine (cma needs Yama's
// ptrace_scope at 0 or 1) is skipped with the reason. The cma case allows
// no other channel, so if cma could not carry the tensors the calls would
// fail rather than silently fall back to basic.

#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "agent_group.h"
#include <trellis/core/error.h>
#include <trellis/rpc/rpc.h>
#include <trellis/transport/channel.h>
#include <trellis/transport/cma/factory.h>
#include <trellis/transport/shm/factory.h>
#include <trellis/transport/transport.h>

using namespace std::chrono_literals;
using trellis::Duration;
using trellis::Future;
namespace rpc = trellis::rpc;

// ---- a gate the callee's function waits at ---------------------------------

// The callee's function enters, says so, and waits (bounded) until the
// test opens the gate: "the call is running" and "the call has not
// finished" are facts, not guesses from a sleep.
class Gate {
 public:
  void reset() {
    std::lock_guard<std::mutex> lock(mu_);
    entered_ = 0;
    open_ = false;
  }
  // Callee side. False if the test never opened it within `limit`.
  bool pass(Duration limit) {
    std::unique_lock<std::mutex> lock(mu_);
    ++entered_;
    cv_.notify_all();
    return cv_.wait_for(lock, limit, [&] { return open_; });
  }
  bool waitEntered(int n, Duration limit) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, limit, [&] { return entered_ >= n; });
  }
  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int entered_ = 0;
  bool open_ = false;
};
Gate gGate;

// Declared after the agents in a test: opens the gate on every way out,
// before the agents' shutdown waits for a function held there.
struct OpenGateOnExit {
  ~OpenGateOnExit() { gGate.open(); }
};

// ---- functions the tests call -----------------------------------------------

int64_t addInts(int64_t a, int64_t b) { return a + b; }
std::string greet(const std::string& who) { return "hello " + who; }
void doNothing() {}
std::map<std::string, std::vector<int32_t>> echoMap(
    std::map<std::string, std::vector<int32_t>> m) {
  return m;
}
std::optional<std::tuple<int32_t, std::string>> maybePair(bool some) {
  if (!some) {
    return std::nullopt;
  }
  return std::make_tuple(7, std::string("seven"));
}
at::Tensor addOneTensor(const at::Tensor& t) { return t.add(1); }
at::Tensor echoTensor(const at::Tensor& t) { return t; }
int64_t throwsOutOfRange(int64_t n) {
  throw std::out_of_range("index " + std::to_string(n) + " is out of range");
}
int64_t throwsNotFound(int64_t n) {
  trellis::throwError(
      trellis::Error::notFound("row " + std::to_string(n) + " not found"));
}
std::string whoAmI() { return rpc::getWorkerInfo().name; }
int64_t sleepMs(int64_t ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
// Returns `v` once the test opens gGate (at most 20 s later).
int64_t gated(int64_t v) { return gGate.pass(20s) ? v : -1; }

TRELLIS_REMOTE_FUNCTION(addInts);
TRELLIS_REMOTE_FUNCTION(greet);
TRELLIS_REMOTE_FUNCTION(doNothing);
TRELLIS_REMOTE_FUNCTION(echoMap);
TRELLIS_REMOTE_FUNCTION(maybePair);
TRELLIS_REMOTE_FUNCTION(addOneTensor);
TRELLIS_REMOTE_FUNCTION(echoTensor);
TRELLIS_REMOTE_FUNCTION(throwsOutOfRange);
TRELLIS_REMOTE_FUNCTION(throwsNotFound);
TRELLIS_REMOTE_FUNCTION(whoAmI);
TRELLIS_REMOTE_FUNCTION(sleepMs);
TRELLIS_REMOTE_FUNCTION(gated);

namespace {

using Group = rpc::testing::AgentGroup;
using rpc::testing::waitUntil;

struct Backend {
  std::string name;
  std::vector<std::string> transports;
  std::vector<std::string> channels;
  bool shm() const {
    return std::find(transports.begin(), transports.end(), "shm") !=
           transports.end();
  }
};

// Whether this process maps a shm transport segment (a memfd named
// "trellis-shm", transport/shm/segment.cc): the pipes really moved to
// shared memory, so an shm case cannot pass over uv alone.
bool mapsShmSegment() {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/memfd:trellis-shm ") != std::string::npos) {
      return true;
    }
  }
  return false;
}

void PrintTo(const Backend& b, std::ostream* os) { *os << b.name; }

class RpcContractTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    gGate.reset();
    for (const auto& t : GetParam().transports) {
      if (t == "shm") {
        if (auto e = trellis::transport::shm::create()->viable(); !e.ok()) {
          GTEST_SKIP() << "shm transport not viable here: " << e.what();
        }
      }
    }
    for (const auto& c : GetParam().channels) {
      if (c == "cma") {
        if (auto e = trellis::transport::cma::create()->viable(); !e.ok()) {
          GTEST_SKIP() << "cma channel not viable here: " << e.what();
        }
        // cma takes no tensor by default (the ring is faster here): the
        // large tensors below must take its out-of-band path.
        ::setenv("TRELLIS_CMA_THRESHOLD", "262144", 1);
      }
    }
  }
  void TearDown() override {
    ::unsetenv("TRELLIS_CMA_THRESHOLD");
    gGate.open();
  }

  // Agents restricted to this backend; every call bounded by `timeout` so a
  // hang fails with a message.
  rpc::RpcOptions options(Duration timeout = 30s) const {
    rpc::RpcOptions o = rpc::testing::callsBoundedBy(timeout);
    o.transports = GetParam().transports;
    o.channels = GetParam().channels;
    return o;
  }
};

TEST_P(RpcContractTest, SyncCallsWithEveryKindOfArgument) {
  Group g(2, options());
  rpc::CurrentAgentScope scope(&g[0]);
  EXPECT_EQ(rpc::rpcSync<addInts>("w1", 2, 40), 42);
  EXPECT_EQ(rpc::rpcSync<greet>(1, std::string("trellis")), "hello trellis");
  rpc::rpcSync<doNothing>("w1");
  std::map<std::string, std::vector<int32_t>> m{{"a", {1, 2}}, {"b", {}}};
  EXPECT_EQ(rpc::rpcSync<echoMap>("w1", m), m);
  auto some = rpc::rpcSync<maybePair>("w1", true);
  ASSERT_TRUE(some.has_value());
  EXPECT_EQ(std::get<1>(*some), "seven");
  EXPECT_FALSE(rpc::rpcSync<maybePair>("w1", false).has_value());
  EXPECT_EQ(rpc::rpcSync<whoAmI>("w1"), "w1");
  EXPECT_EQ(rpc::rpcSync<whoAmI>("w0"), "w0");  // a call to itself
  EXPECT_EQ(mapsShmSegment(), GetParam().shm())
      << "transports restricted to what this case names";
}

TEST_P(RpcContractTest, AsyncCallsCompleteInAnyOrder) {
  Group g(3, options());
  OpenGateOnExit opener;
  rpc::CurrentAgentScope scope(&g[0]);
  // The first call is held on w1 while the later ones complete.
  Future<int64_t> held = rpc::rpcAsync<gated>("w1", int64_t{-7});
  ASSERT_TRUE(gGate.waitEntered(1, 10s)) << "w1 never ran gated()";
  std::vector<Future<int64_t>> fs;
  for (int64_t i = 0; i < 50; ++i) {
    fs.push_back(rpc::rpcAsync<addInts>(i % 2 == 0 ? "w1" : "w2", i, 1));
  }
  for (int64_t i = 0; i < 50; ++i) {
    EXPECT_EQ(fs[i].wait(30s), i + 1);
  }
  EXPECT_FALSE(held.waitFor(0ms)) << "completed before the gate opened";
  gGate.open();
  EXPECT_EQ(held.wait(30s), -7);
}

TEST_P(RpcContractTest, RemoteErrorsKeepOriginAndCode) {
  Group g(2, options());
  rpc::CurrentAgentScope scope(&g[0]);
  try {
    rpc::rpcSync<throwsOutOfRange>("w1", 5);
    FAIL() << "no exception";
  } catch (const trellis::RemoteError& e) {
    const auto* o = e.error().remoteOrigin();
    ASSERT_NE(o, nullptr);
    EXPECT_EQ(o->worker, "w1");
    EXPECT_EQ(o->function, "throwsOutOfRange");
    EXPECT_EQ(o->exceptionType, "std::out_of_range");
    EXPECT_NE(e.error().message().find("index 5 is out of range"),
              std::string::npos);
  }
  // A Trellis error keeps the code it was raised with (docs/errors.md).
  try {
    rpc::rpcSync<throwsNotFound>("w1", 3);
    FAIL() << "no exception";
  } catch (const trellis::RemoteError& e) {
    EXPECT_EQ(e.error().code(), trellis::Code::kNotFound) << e.what();
    EXPECT_EQ(e.origin().function, "throwsNotFound");
    EXPECT_NE(std::string(e.what()).find("row 3 not found"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(rpc::rpcSync<addInts>("w1", 1, 1), 2);  // w1 goes on serving
}

// The timeout fires while the callee is provably still running (held at
// the gate); its reply, once let go, is counted as late and dropped.
TEST_P(RpcContractTest, TimeoutNamesCalleeAndFunctionAndDropsLateReply) {
  Group g(2, options());
  OpenGateOnExit opener;
  rpc::CurrentAgentScope scope(&g[0]);
  const auto start = std::chrono::steady_clock::now();
  try {
    rpc::rpcSync<gated>({"w1", 100ms}, int64_t{1});
    FAIL() << "no timeout";
  } catch (const trellis::TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("gated"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("w1"), std::string::npos) << e.what();
  }
  // Honoured: not before the timeout.
  EXPECT_GE(std::chrono::steady_clock::now() - start, 100ms);
  ASSERT_TRUE(gGate.waitEntered(1, 10s));
  EXPECT_EQ(g[0].stats().lateReplies, 0u);
  gGate.open();
  EXPECT_TRUE(waitUntil([&] { return g[0].stats().lateReplies == 1; }));
  EXPECT_EQ(rpc::rpcSync<addInts>("w1", 1, 2), 3);
}

TEST_P(RpcContractTest, TensorsRoundTripSmallStridedAndLarge) {
  Group g(2, options());
  rpc::CurrentAgentScope scope(&g[0]);
  at::Tensor t = at::ones({3, 4}).t();  // non-contiguous: strides kept
  at::Tensor r = rpc::rpcSync<addOneTensor>("w1", t);
  EXPECT_TRUE(r.equal(t.add(1)));
  EXPECT_EQ(r.strides(), t.strides());
  // 16 MiB: above every channel's out-of-band threshold (cma: the 256 KiB
  // SetUp sets).
  at::Tensor big = at::arange(int64_t{4} << 20).to(at::kFloat);
  at::Tensor rb = rpc::rpcSync<addOneTensor>("w1", big);
  EXPECT_TRUE(rb.equal(big.add(1)));
  // Received into a pooled buffer aligned for 2 MiB huge pages (docs/rpc.md,
  // "Threads"), which is what lets the kernel back it with them.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(rb.data_ptr()) % (size_t{2} << 20), 0u);
}

// Received tensors of pooled sizes (1 MiB and up, docs/rpc.md "Threads")
// held alive together never share memory: 48 echoes in flight at once, of
// three sizes that share size classes, each with its own fill, all kept
// until every one is checked; then again, so that the second round reuses
// the buffers the first gave back.
TEST_P(RpcContractTest, ReceivedTensorsHeldAtOnceNeverShareABuffer) {
  Group g(2, options());
  rpc::CurrentAgentScope scope(&g[0]);
  const std::vector<int64_t> sizes = {
      int64_t{1} << 20, (int64_t{1} << 20) + 4096, int64_t{3} << 20};
  for (int round = 0; round < 2; ++round) {
    std::vector<at::Tensor> sent;
    std::vector<Future<at::Tensor>> replies;
    for (int i = 0; i < 48; ++i) {
      sent.push_back(at::full({sizes[i % sizes.size()]}, (i * 7 + round) % 251,
                              at::kByte));
      replies.push_back(rpc::rpcAsync<echoTensor>("w1", sent.back()));
    }
    std::vector<at::Tensor> got;
    for (auto& f : replies) {
      got.push_back(f.wait(60s));
    }
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(got[i].equal(sent[i])) << "round " << round << ", echo " << i;
      for (size_t j = 0; j < i; ++j) {
        EXPECT_NE(got[i].data_ptr(), got[j].data_ptr());
      }
    }
  }
}

// w1 closes while w0's call to it runs: that call fails with a
// ConnectionError naming w1, and calls to w2 go on meanwhile.
TEST_P(RpcContractTest, PeerThatClosesFailsItsCallsWhileOthersGoOn) {
  Group g(3, options());
  OpenGateOnExit opener;
  rpc::CurrentAgentScope scope(&g[0]);
  EXPECT_EQ(rpc::rpcSync<addInts>("w2", 1, 2), 3);
  Future<int64_t> f = rpc::rpcAsync<gated>("w1", int64_t{1});
  ASSERT_TRUE(gGate.waitEntered(1, 10s)) << "w1 never ran gated()";
  // shutdown() closes w1's pipes, then waits for its worker thread, which
  // the gate holds until the end of the test: run it aside.
  std::thread closer([&] { g[1].shutdown({.graceful = false}); });
  try {
    f.wait(20s);
    ADD_FAILURE() << "the call to a closed peer returned";
  } catch (const trellis::ConnectionError& e) {
    EXPECT_NE(std::string(e.what()).find("w1"), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong type: " << e.what();
  }
  for (int64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(rpc::rpcSync<addInts>("w2", i, 1), i + 1);
  }
  EXPECT_THROW(rpc::rpcSync<addInts>("w1", 1, 1), trellis::ConnectionError);
  gGate.open();
  closer.join();
}

TEST_P(RpcContractTest, GracefulShutdownDrainsCallsInFlight) {
  Group g(3, options());
  std::vector<Future<int64_t>> fs;
  {
    rpc::CurrentAgentScope scope(&g[0]);
    for (int i = 0; i < 20; ++i) {
      fs.push_back(rpc::rpcAsync<sleepMs>("w1", int64_t{20}));
    }
  }
  g.shutdownAll(true);
  for (auto& f : fs) {
    // Already complete: shutdown returned only once nothing was in flight.
    ASSERT_TRUE(f.waitFor(0ms));
    EXPECT_EQ(f.wait(1s), 20);
  }
}

TEST_P(RpcContractTest, ShutdownNowFailsPendingCallsWithCancelled) {
  Group g(2, options());
  OpenGateOnExit opener;
  Future<int64_t> f;
  {
    rpc::CurrentAgentScope scope(&g[0]);
    f = rpc::rpcAsync<gated>("w1", int64_t{1});
  }
  ASSERT_TRUE(gGate.waitEntered(1, 10s)) << "w1 never ran gated()";
  g[0].shutdown({.graceful = false});
  EXPECT_THROW(f.wait(5s), trellis::CancelledError);
  rpc::CurrentAgentScope scope(&g[0]);
  EXPECT_THROW(rpc::rpcSync<addInts>("w1", 1, 2), trellis::CancelledError);
  gGate.open();
}

INSTANTIATE_TEST_SUITE_P(
    Transports, RpcContractTest,
    ::testing::Values(Backend{"uv", {"uv"}, {"basic"}},
                      Backend{"shm_basic", {"uv", "shm"}, {"basic"}},
                      Backend{"shm_cma", {"uv", "shm"}, {"cma"}}),
    [](const ::testing::TestParamInfo<Backend>& info) {
      return info.param.name;
    });

}  // namespace
