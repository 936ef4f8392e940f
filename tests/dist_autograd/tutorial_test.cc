// PyTorch's parameter-server tutorial layout (docs/pytorch_tutorial.md):
// the model lives on a server ("w0") and its forward runs there, through
// RPC, inside each trainer's distributed-autograd context; the trainers
// ("w1", "w2", "w3") each run forward, backward and a DistributedOptimizer
// step on the server's parameters, concurrently. The server's Linear
// layers save their weights for backward, so a step of one trainer must
// not land between another trainer's forward and its backward on the
// server (issue 15). Agents in one process, real pipes.

#include <ATen/ATen.h>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "../rpc/agent_group.h"
#include <trellis/core/error.h>
#include <trellis/dist_autograd/dist_autograd.h>
#include <trellis/dist_autograd/optimizer.h>
#include <trellis/rpc/rpc.h>
#include <trellis/rref/rref.h>

using namespace std::chrono_literals;
using trellis::Duration;
namespace rpc = trellis::rpc;
namespace dist = trellis::dist_autograd;

// ---- the tutorial's server
// ---------------------------------------------------

// Linear(4, 16) -> ReLU -> Linear(16, 2), in double. Both Linear layers
// save their weight for backward (addmm), as torch's do.
struct TutorialServer {
  torch::nn::Sequential model;

  TutorialServer() {
    torch::manual_seed(7);
    model = torch::nn::Sequential(torch::nn::Linear(4, 16), torch::nn::ReLU(),
                                  torch::nn::Linear(16, 2));
    model->to(at::kDouble);
  }
  at::Tensor forward(at::Tensor x) { return model->forward(x); }
  std::vector<rpc::RRef<at::Tensor>> parameterRRefs() {
    return dist::localParameters(model->parameters());
  }
};

// One server per key, built on first use and shared by every trainer
// (torch's get_parameter_server); the key is the test's name.
std::mutex gServersMu;
std::map<std::string, std::shared_ptr<TutorialServer>> gServers;
std::shared_ptr<TutorialServer> getServer(std::string key) {
  std::lock_guard<std::mutex> lock(gServersMu);
  auto& s = gServers[key];
  if (s == nullptr) {
    s = std::make_shared<TutorialServer>();
  }
  return s;
}
void dropServer(std::string key) {
  std::lock_guard<std::mutex> lock(gServersMu);
  gServers.erase(key);
}

TRELLIS_REMOTE_FUNCTION(getServer);
TRELLIS_REMOTE_FUNCTION(dropServer);
TRELLIS_REMOTE_METHODS(TutorialServer, forward, parameterRRefs);

// An embedding table (sum-mode bags, no per-sample weights: libtorch's
// EmbeddingBagBackward0 keeps no copy of the weight). The same lookup is
// registered twice, once step-safe.
struct EmbeddingServer {
  at::Tensor weight = at::linspace(-1.0, 1.0, 20 * 3, at::kDouble)
                          .reshape({20, 3})
                          .requires_grad_(true);
  at::Tensor lookup(at::Tensor ids, at::Tensor offsets) {
    return std::get<0>(at::embedding_bag(weight, ids, offsets));
  }
  at::Tensor lookupGated(at::Tensor ids, at::Tensor offsets) {
    return lookup(std::move(ids), std::move(offsets));
  }
  at::Tensor values() { return weight.detach().clone(); }
  std::vector<rpc::RRef<at::Tensor>> parameterRRefs() {
    return dist::localParameters({weight});
  }
};
std::map<std::string, std::shared_ptr<EmbeddingServer>> gTables;
std::shared_ptr<EmbeddingServer> getTable(std::string key) {
  std::lock_guard<std::mutex> lock(gServersMu);
  auto& s = gTables[key];
  if (s == nullptr) {
    s = std::make_shared<EmbeddingServer>();
  }
  return s;
}
void dropTable(std::string key) {
  std::lock_guard<std::mutex> lock(gServersMu);
  gTables.erase(key);
}

TRELLIS_REMOTE_FUNCTION(getTable);
TRELLIS_REMOTE_FUNCTION(dropTable);
TRELLIS_REMOTE_METHODS(EmbeddingServer, lookup, lookupGated, values,
                       parameterRRefs);
TRELLIS_REMOTE_STEP_SAFE(EmbeddingServer::lookup);

namespace {

std::string testName() {
  return ::testing::UnitTest::GetInstance()->current_test_info()->name();
}

// Every call (backward's messages included) bounded at 30 s.
struct Group : rpc::testing::AgentGroup {
  explicit Group(int n) : AgentGroup(n, rpc::testing::callsBoundedBy(30s)) {}
};

// The same regression task for every trainer, each with its own batch.
struct Batch {
  at::Tensor x, y;
};
Batch batch(int trainer) {
  at::Tensor x = at::linspace(-1.0 + 0.1 * trainer, 1.0 - 0.05 * trainer, 8 * 4,
                              at::kDouble)
                     .reshape({8, 4});
  at::Tensor w = at::linspace(-0.5, 0.7, 4 * 2, at::kDouble).reshape({4, 2});
  return {x, x.mm(w).sin()};
}

at::Tensor lossOf(const at::Tensor& out, const Batch& b) {
  return (out - b.y).pow(2).mean();
}

std::string contextName(uint64_t id) {
  return "context " + std::to_string(id >> 48) + ":" +
         std::to_string(id & ((uint64_t{1} << 48) - 1));
}

struct SpecCase {
  std::string name;
  dist::OptimizerSpec spec;
};
void PrintTo(const SpecCase& c, std::ostream* os) { *os << c.name; }

// Sets a flag and lets other threads wait for it (bounded).
class Flag {
 public:
  void set() { on_.store(true); }
  bool isSet() const { return on_.load(); }
  // True when it was set within `limit`.
  bool waitFor(Duration limit = 20s) const {
    return rpc::testing::waitUntil([&] { return on_.load(); }, limit);
  }

 private:
  std::atomic<bool> on_{false};
};

// ---- two trainers, deliberately interleaved, then free-running ------------

class DistAutogradTutorial : public ::testing::TestWithParam<SpecCase> {};

// Each scripted round: A runs forward and backward; B runs its forward;
// A steps; only then (or after 500 ms, when A's step is held back) B runs
// its backward and steps. Without the owner serialising the step against
// B's backward, A's step changes the weights B's graph saved, and B's
// backward fails with "modified by an inplace operation". Then both train
// freely, concurrently. Every iteration must succeed and both losses fall.
TEST_P(DistAutogradTutorial, TwoTrainersInterleavedTrainWithoutError) {
  Group g(3);
  const std::string key = testName();
  constexpr int kScripted = 4;
  constexpr int kFree = 40;

  struct Trainer {
    int rank;
    Batch data;
    std::vector<double> losses;
    std::string failure;
    rpc::RRef<TutorialServer> server;
    std::unique_ptr<dist::DistributedOptimizer> opt;
  };
  std::vector<Trainer> trainers(2);
  for (int i = 0; i < 2; ++i) {
    Trainer& t = trainers[i];
    t.rank = i + 1;
    t.data = batch(t.rank);
    rpc::CurrentAgentScope scope(&g[t.rank]);
    t.server = rpc::remote<getServer>("w0", key);
    t.opt = std::make_unique<dist::DistributedOptimizer>(
        GetParam().spec, t.server.rpcSync<&TutorialServer::parameterRRefs>(),
        30s);
  }

  struct Round {
    Flag aBackward, bForward, aStepIssued, aStepReturned, bDone;
    bool aStepWaitedForB = false;
  };
  std::vector<Round> rounds(kScripted);

  auto run = [&](int which) {
    Trainer& t = trainers[which];
    rpc::CurrentAgentScope scope(&g[t.rank]);
    auto fail = [&](const std::string& why) {
      if (t.failure.empty()) {
        t.failure = why;
      }
    };
    try {
      for (int r = 0; r < kScripted; ++r) {
        Round& round = rounds[r];
        dist::Context ctx;
        if (which == 0) {  // A
          at::Tensor loss = lossOf(
              t.server.rpcSync<&TutorialServer::forward>(t.data.x), t.data);
          t.losses.push_back(loss.item<double>());
          ctx.backward({loss});
          round.aBackward.set();
          if (!round.bForward.waitFor()) {
            return fail("round " + std::to_string(r) + ": B's forward");
          }
          round.aStepIssued.set();
          t.opt->step(ctx);
          round.aStepReturned.set();
          if (!round.bDone.waitFor()) {
            return fail("round " + std::to_string(r) + ": B's step");
          }
        } else {  // B
          if (!round.aBackward.waitFor()) {
            return fail("round " + std::to_string(r) + ": A's backward");
          }
          at::Tensor loss = lossOf(
              t.server.rpcSync<&TutorialServer::forward>(t.data.x), t.data);
          t.losses.push_back(loss.item<double>());
          round.bForward.set();
          if (!round.aStepIssued.waitFor()) {
            return fail("round " + std::to_string(r) + ": A's step");
          }
          // Give A's step time to reach the server and, if nothing holds
          // it, to finish before this backward.
          round.aStepWaitedForB = !round.aStepReturned.waitFor(500ms);
          ctx.backward({loss});
          t.opt->step(ctx);
          round.bDone.set();
          if (!round.aStepReturned.waitFor()) {
            return fail("round " + std::to_string(r) + ": A's step returned");
          }
        }
      }
      for (int i = 0; i < kFree; ++i) {
        dist::Context ctx;
        at::Tensor loss = lossOf(
            t.server.rpcSync<&TutorialServer::forward>(t.data.x), t.data);
        t.losses.push_back(loss.item<double>());
        ctx.backward({loss});
        t.opt->step(ctx);
      }
    } catch (const std::exception& e) {
      fail(e.what());
      // Unblock the other trainer's scripted waits.
      for (auto& round : rounds) {
        round.aBackward.set();
        round.bForward.set();
        round.aStepIssued.set();
        round.aStepReturned.set();
        round.bDone.set();
      }
    }
  };
  std::thread a(run, 0), b(run, 1);
  a.join();
  b.join();

  for (const auto& t : trainers) {
    EXPECT_EQ(t.failure, "") << "trainer w" << t.rank;
    EXPECT_EQ(t.losses.size(), size_t{kScripted + kFree}) << "w" << t.rank;
    if (t.losses.empty()) {
      continue;
    }
    EXPECT_LT(t.losses.back(), 0.5 * t.losses.front())
        << "w" << t.rank << ": " << t.losses.front() << " -> "
        << t.losses.back();
  }
  // The step of A was held until B's backward had run, in every round.
  for (int r = 0; r < kScripted; ++r) {
    EXPECT_TRUE(rounds[r].aStepWaitedForB) << "round " << r;
  }
  trainers.clear();
  rpc::CurrentAgentScope scope(&g[1]);
  rpc::rpcSync<dropServer>("w0", key);
}

INSTANTIATE_TEST_SUITE_P(
    Optimizers, DistAutogradTutorial,
    ::testing::Values(SpecCase{"Adagrad", dist::Adagrad{.lr = 0.05}},
                      SpecCase{"Adam", dist::Adam{.lr = 0.02}}),
    [](const ::testing::TestParamInfo<SpecCase>& info) {
      return info.param.name;
    });

// ---- a forward without backward blocks steps for a bounded time
// --------------

// Trainer A runs a forward on the server and stops there (no backward, its
// context alive). Trainer B's step then waits for A's context: it fails
// with a TimeoutError naming that context, within its timeout. While a
// step of B waits, releasing A's context lets it through at once.
TEST(DistAutogradStepGate, StepWaitIsBoundedAndNamesTheReader) {
  Group g(3);
  const std::string key = testName();
  rpc::RRef<TutorialServer> serverA, serverB;
  {
    rpc::CurrentAgentScope scope(&g[1]);
    serverA = rpc::remote<getServer>("w0", key);
  }
  rpc::CurrentAgentScope scopeB(&g[2]);
  serverB = rpc::remote<getServer>("w0", key);
  dist::DistributedOptimizer opt(
      dist::Adagrad{.lr = 0.05},
      serverB.rpcSync<&TutorialServer::parameterRRefs>(), 1s);
  const Batch data = batch(2);

  // A: a context with a forward on the server and no backward, alive
  // until `releaseA` (its own thread, as a Context is used by one thread).
  Flag aReady, releaseA;
  uint64_t idA = 0;
  std::string aFailure;
  std::thread a([&] {
    rpc::CurrentAgentScope scope(&g[1]);
    try {
      dist::Context ctx;
      idA = ctx.id();
      (void)serverA.rpcSync<&TutorialServer::forward>(batch(1).x);
      aReady.set();
      if (!releaseA.waitFor(30s)) {
        aFailure = "never released";
      }
    } catch (const std::exception& e) {
      aFailure = e.what();
    }
    aReady.set();
  });
  // Whatever fails below, A's thread ends and is joined.
  struct JoinA {
    Flag& release;
    std::thread& thread;
    ~JoinA() {
      release.set();
      if (thread.joinable()) {
        thread.join();
      }
    }
  } joinA{releaseA, a};
  EXPECT_TRUE(aReady.waitFor());
  EXPECT_EQ(aFailure, "");

  {
    dist::Context ctx;
    at::Tensor loss =
        lossOf(serverB.rpcSync<&TutorialServer::forward>(data.x), data);
    ctx.backward({loss});
    const auto start = std::chrono::steady_clock::now();
    try {
      opt.step(ctx);
      ADD_FAILURE() << "the step did not wait for " << contextName(idA);
    } catch (const trellis::TimeoutError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(contextName(idA)), std::string::npos) << what;
      EXPECT_NE(what.find("'w0'"), std::string::npos) << what;
    }
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_GE(took, 500ms);
    EXPECT_LT(took, 5s);
  }

  // A step with time to spare, released by the end of A's context.
  dist::DistributedOptimizer patient(
      dist::Adagrad{.lr = 0.05},
      serverB.rpcSync<&TutorialServer::parameterRRefs>(), 20s);
  dist::Context ctx;
  at::Tensor loss =
      lossOf(serverB.rpcSync<&TutorialServer::forward>(data.x), data);
  ctx.backward({loss});
  Flag stepped;
  std::string stepFailure;
  std::thread stepper([&] {
    rpc::CurrentAgentScope scope(&g[2]);
    try {
      patient.step(ctx.id());
    } catch (const std::exception& e) {
      stepFailure = e.what();
    }
    stepped.set();
  });
  EXPECT_FALSE(stepped.waitFor(300ms)) << "the step did not wait";
  const auto released = std::chrono::steady_clock::now();
  releaseA.set();  // ~Context releases it on the server
  if (a.joinable()) {
    a.join();
  }
  EXPECT_TRUE(stepped.waitFor(10s));
  EXPECT_LT(std::chrono::steady_clock::now() - released, 5s);
  stepper.join();
  EXPECT_EQ(stepFailure, "");
  EXPECT_EQ(aFailure, "");
  rpc::rpcSync<dropServer>("w0", key);
}

// ---- a step-safe function's reply does not hold steps back ----------------

// Trainer A looks rows up on the server (its context alive, no backward
// yet); trainer B looks up, runs backward and steps on the same table.
// With the lookup registered TRELLIS_REMOTE_STEP_SAFE, B's step goes
// through at once; A's backward afterwards passes libtorch's version check
// (the lookup saved no weight) and A's step applies its own gradient on
// top of B's. Registered without it, the same step of B waits for A's
// context and fails at its timeout naming it, having changed nothing.
TEST(DistAutogradStepGate, StepSafeRepliesDoNotHoldSteps) {
  Group g(3);
  const std::string key = testName();
  rpc::RRef<EmbeddingServer> tableA, tableB;
  {
    rpc::CurrentAgentScope scope(&g[1]);
    tableA = rpc::remote<getTable>("w0", key);
  }
  rpc::CurrentAgentScope scopeB(&g[2]);
  tableB = rpc::remote<getTable>("w0", key);
  const at::Tensor ids = at::tensor({1, 4, 4, 7, 2}, at::kLong);
  const at::Tensor offsets = at::tensor({0, 2}, at::kLong);
  // d(sum of the bags)/d(weight): how often each row was looked up.
  const at::Tensor counts =
      at::bincount(ids, {}, 20).to(at::kDouble).unsqueeze(1).expand({20, 3});
  for (const bool stepSafe : {true, false}) {
    SCOPED_TRACE(stepSafe ? "step-safe lookup" : "gated lookup");
    const auto lookup = [&](rpc::RRef<EmbeddingServer>& table) {
      return stepSafe
                 ? table.rpcSync<&EmbeddingServer::lookup>(ids, offsets)
                 : table.rpcSync<&EmbeddingServer::lookupGated>(ids, offsets);
    };
    const at::Tensor before = tableB.rpcSync<&EmbeddingServer::values>();
    Flag aLooked, aGo, aDone;
    std::atomic<uint64_t> idA{0};
    std::string aFailure;
    std::thread a([&] {
      rpc::CurrentAgentScope scope(&g[1]);
      try {
        dist::DistributedOptimizer optA(
            dist::SGD{.lr = 0.1},
            tableA.rpcSync<&EmbeddingServer::parameterRRefs>(), 10s);
        dist::Context ctx;
        idA = ctx.id();
        const at::Tensor bags = lookup(tableA);
        aLooked.set();
        if (!aGo.waitFor(30s)) {
          aFailure = "never told to go on";
        } else {
          ctx.backward({bags.sum()});
          optA.step(ctx);
        }
      } catch (const std::exception& e) {
        aFailure = e.what();
      }
      aLooked.set();
      aDone.set();
    });
    struct JoinA {
      Flag& go;
      std::thread& thread;
      ~JoinA() {
        go.set();
        if (thread.joinable()) {
          thread.join();
        }
      }
    } joinA{aGo, a};
    ASSERT_TRUE(aLooked.waitFor());
    ASSERT_EQ(aFailure, "");

    dist::DistributedOptimizer optB(
        dist::SGD{.lr = 0.1},
        tableB.rpcSync<&EmbeddingServer::parameterRRefs>(), 1s);
    {
      dist::Context ctx;
      ctx.backward({lookup(tableB).sum()});
      const auto start = std::chrono::steady_clock::now();
      if (stepSafe) {
        optB.step(ctx);
        EXPECT_LT(std::chrono::steady_clock::now() - start, 500ms)
            << "the step waited for A's lookup";
      } else {
        try {
          optB.step(ctx);
          ADD_FAILURE() << "the step did not wait for A's gated lookup";
        } catch (const trellis::TimeoutError& e) {
          EXPECT_NE(std::string(e.what()).find(contextName(idA)),
                    std::string::npos)
              << e.what();
        }
      }
    }
    aGo.set();
    ASSERT_TRUE(aDone.waitFor());
    a.join();
    EXPECT_EQ(aFailure, "");
    const at::Tensor after = tableB.rpcSync<&EmbeddingServer::values>();
    const double steps = stepSafe ? 2 : 1;  // B's gated step changed nothing
    EXPECT_TRUE(at::allclose(after, before - 0.1 * steps * counts, 0, 1e-12))
        << after - before;
  }
  rpc::rpcSync<dropTable>("w0", key);
}

// ---- what a waiting step holds and what it does not ------------------------

// A (forward done, backward pending) blocks B's step. While B's step
// waits: A's backward (protocol messages) runs, and so does another
// request of A's context; a forward of a third trainer C in a new context
// is held (and answered once B's step is through), and one with a short
// timeout fails with a TimeoutError instead of running.
TEST(DistAutogradStepGate, ProtocolMessagesPassAWaitingStepNewRequestsWait) {
  Group g(4);
  const std::string key = testName();
  auto serverOn = [&](int rank) {
    rpc::CurrentAgentScope scope(&g[rank]);
    return rpc::remote<getServer>("w0", key);
  };
  auto serverA = serverOn(1), serverB = serverOn(2), serverC = serverOn(3);
  std::unique_ptr<dist::DistributedOptimizer> optB;
  {
    rpc::CurrentAgentScope scope(&g[2]);
    optB = std::make_unique<dist::DistributedOptimizer>(
        dist::Adam{.lr = 0.01},
        serverB.rpcSync<&TutorialServer::parameterRRefs>(), 20s);
  }

  Flag aForward, bStepDone, aGo, aDone;
  std::string aFailure, bFailure;
  std::thread a([&] {
    rpc::CurrentAgentScope scope(&g[1]);
    try {
      dist::Context ctx;
      const Batch d = batch(1);
      at::Tensor loss =
          lossOf(serverA.rpcSync<&TutorialServer::forward>(d.x), d);
      aForward.set();
      if (!aGo.waitFor()) {
        aFailure = "no go";
        return;
      }
      // A second request of the same context is not held either.
      at::Tensor loss2 =
          lossOf(serverA.rpcSync<&TutorialServer::forward>(d.x), d);
      ctx.backward({loss + loss2});
    } catch (const std::exception& e) {
      aFailure = e.what();
    }
    aDone.set();
  });
  EXPECT_TRUE(aForward.waitFor());

  std::thread b([&] {
    rpc::CurrentAgentScope scope(&g[2]);
    try {
      dist::Context ctx;
      const Batch d = batch(2);
      ctx.backward({lossOf(serverB.rpcSync<&TutorialServer::forward>(d.x), d)});
      optB->step(ctx);
    } catch (const std::exception& e) {
      bFailure = e.what();
    }
    bStepDone.set();
  });
  EXPECT_FALSE(bStepDone.waitFor(300ms)) << bFailure;

  // C: a new context while B's step waits. One forward with a short
  // timeout fails; another one is held until B's step is through.
  std::string cFailure;
  bool cHeld = false;
  bool bWaitedForA = false;
  std::thread c([&] {
    rpc::CurrentAgentScope scope(&g[3]);
    const Batch d = batch(3);
    try {
      dist::Context ctx;
      (void)serverC.withTimeout(300ms).rpcSync<&TutorialServer::forward>(d.x);
      cFailure = "the short forward was not held";
    } catch (const trellis::TimeoutError&) {
    } catch (const std::exception& e) {
      cFailure = e.what();
    }
    try {
      dist::Context ctx;
      auto f = serverC.rpcAsync<&TutorialServer::forward>(d.x);
      // Unheld, a forward answers in milliseconds.
      cHeld = !f.waitFor(300ms);
      bWaitedForA = !bStepDone.isSet();
      aGo.set();  // now let A's backward release B's step
      (void)f.wait(20s);
    } catch (const std::exception& e) {
      cFailure = e.what();
    }
  });
  c.join();
  a.join();
  b.join();
  EXPECT_EQ(aFailure, "");
  EXPECT_EQ(bFailure, "");
  EXPECT_EQ(cFailure, "");
  EXPECT_TRUE(cHeld);
  EXPECT_TRUE(bWaitedForA) << "B's step did not wait for A's backward";
  optB.reset();
  rpc::CurrentAgentScope scope(&g[1]);
  rpc::rpcSync<dropServer>("w0", key);
}

}  // namespace
