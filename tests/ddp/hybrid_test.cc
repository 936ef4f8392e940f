// DDP inside a distributed-autograd context (the hybrid DDP + RPC shape):
// one parameter server "w0" holding an embedding table, two trainers "w1"
// and "w2" that look rows up over RPC, run them through a DDP-wrapped MLP
// (their own two-rank ProcessGroup), run ctx.backward() and step both the
// remote table and the dense part with one DistributedOptimizer. Agents,
// groups and trainers are threads of this process; pipes and collectives
// are real. Every step is checked against one process computing the same.
#include <ATen/ATen.h>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../rpc/agent_group.h"
#include "models.h"
#include <trellis/collectives/process_group.h>
#include <trellis/core/error.h>
#include <trellis/ddp/distributed_data_parallel.h>
#include <trellis/dist_autograd/dist_autograd.h>
#include <trellis/dist_autograd/optimizer.h>
#include <trellis/rpc/rpc.h>
#include <trellis/rref/rref.h>
#include <trellis/store/hash_store.h>

using namespace std::chrono_literals;
namespace rpc = trellis::rpc;
namespace dist = trellis::dist_autograd;

// ---- the server's side -----------------------------------------------------

// EmbeddingBag(sum, sparse gradients) tables by name, on the server.
std::mutex gTablesMu;
std::map<std::string, at::Tensor> gTables;

at::Tensor tableAt(const std::string& name) {
  std::lock_guard<std::mutex> lock(gTablesMu);
  auto it = gTables.find(name);
  if (it == gTables.end()) {
    throw std::out_of_range("no table " + name);
  }
  return it->second;
}
void createTable(std::string name, at::Tensor weight) {
  std::lock_guard<std::mutex> lock(gTablesMu);
  gTables[name] = weight.clone().requires_grad_(true);
}
at::Tensor lookupRows(std::string name, at::Tensor ids, at::Tensor offsets) {
  return std::get<0>(at::embedding_bag(tableAt(name), ids, offsets,
                                       /*scale_grad_by_freq=*/false,
                                       /*mode=*/0, /*sparse=*/true));
}
std::vector<rpc::RRef<at::Tensor>> tableParameters(std::string name) {
  return dist::localParameters({tableAt(name)});
}
at::Tensor scaled(at::Tensor x, double k) { return x * k; }

TRELLIS_REMOTE_FUNCTION(createTable);
TRELLIS_REMOTE_FUNCTION(lookupRows);
TRELLIS_REMOTE_FUNCTION(tableParameters);
TRELLIS_REMOTE_FUNCTION(scaled);

namespace trellis::ddp {
namespace {

using collectives::ProcessGroup;
using testing::Mlp;

constexpr double kTol = 1e-9;
constexpr int kSteps = 3;
constexpr int64_t kRows = 12;  // table rows
constexpr int64_t kBags = 4;   // per trainer and step

// Deterministic inputs of trainer `t` (0 or 1) at `step`: bags of 2 ids
// each, and targets.
struct Batch {
  at::Tensor ids, offsets, y;
};
Batch batchOf(int t, int step) {
  Batch b;
  b.ids = (at::arange(2 * kBags, at::kLong) * (3 + t) + step * 5 + t) % kRows;
  b.offsets = at::arange(0, 2 * kBags, 2, at::kLong);
  b.y = at::linspace(-1 + 0.1 * t, 1 - 0.2 * step, kBags * 4, at::kDouble)
            .reshape({kBags, 4});
  return b;
}

// An Mlp in double whose parameters depend on `seed` only.
Mlp makeMlp(double seed, bool withBranch = false) {
  Mlp m(withBranch);
  m->to(at::kDouble);
  at::NoGradGuard noGrad;
  double k = seed;
  for (auto& p : m->parameters()) {
    p.copy_(at::sin(at::arange(p.numel(), at::kDouble) * 0.37 + k)
                .reshape(p.sizes()) *
            0.3);
    k += 1;
  }
  return m;
}

struct Hybrid : ::testing::Test {
  rpc::testing::AgentGroup agents{3, rpc::testing::callsBoundedBy(30s)};
  std::shared_ptr<store::HashStore> store =
      std::make_shared<store::HashStore>();
  const at::Tensor table0 =
      at::linspace(-0.5, 0.7, kRows * 8, at::kDouble).reshape({kRows, 8});

  void SetUp() override {
    rpc::CurrentAgentScope scope(&agents[1]);
    rpc::rpcSync<createTable>("w0", std::string("t"), table0);
  }

  std::shared_ptr<ProcessGroup> groupOf(int t) {
    collectives::ProcessGroupOptions options;
    options.timeout = 30s;
    options.watchdogMode = collectives::WatchdogMode::kFail;
    return ProcessGroup::create("cpu", store, t, 2, options);
  }

  // Runs fn(t) for trainers t = 0, 1 on agents w1, w2; a failure names the
  // trainer.
  void runTrainers(const std::function<void(int)>& fn) {
    std::vector<std::string> failures(2);
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) {
      threads.emplace_back([&, t] {
        rpc::CurrentAgentScope scope(&agents[t + 1]);
        try {
          fn(t);
        } catch (const std::exception& e) {
          failures[static_cast<size_t>(t)] = e.what();
        }
      });
    }
    for (auto& th : threads) {
      th.join();
    }
    for (int t = 0; t < 2; ++t) {
      EXPECT_EQ(failures[static_cast<size_t>(t)], "") << "trainer " << t;
    }
  }
};

TEST_F(Hybrid, DenseDdpAndRemoteTableStepTogetherAsOneProcessWould) {
  // values[t][step]: trainer t's dense parameters after that step.
  std::vector<std::vector<std::vector<at::Tensor>>> values(2);
  runTrainers([&](int t) {
    auto pg = groupOf(t);
    Mlp mlp = makeMlp(1.0 + t);  // rank 0's values win at construction
    DistributedDataParallel model(mlp, pg);
    auto params = rpc::rpcSync<tableParameters>("w0", std::string("t"));
    auto dense = dist::localParameters(mlp->parameters());
    params.insert(params.end(), dense.begin(), dense.end());
    dist::DistributedOptimizer opt(dist::SGD{.lr = 0.2}, params, 30s);
    for (int step = 0; step < kSteps; ++step) {
      const Batch b = batchOf(t, step);
      {
        dist::Context ctx;
        at::Tensor rows =
            rpc::rpcSync<lookupRows>("w0", std::string("t"), b.ids, b.offsets);
        at::Tensor loss = at::mse_loss(model(rows), b.y);
        ctx.backward({loss});
        // The averaged gradients are in the context, not in .grad.
        dist::GradientMap grads = ctx.gradients();
        for (const auto& p : mlp->parameters()) {
          EXPECT_FALSE(p.grad().defined());
          EXPECT_TRUE(grads.contains(p));
        }
        // Both backward passes before either step: the reference applies
        // both trainers' table gradients to the same values.
        pg->barrier().wait();
        opt.step(ctx);
      }
      pg->barrier().wait();
      std::vector<at::Tensor> now;
      for (const auto& p : mlp->parameters()) {
        now.push_back(p.detach().clone());
      }
      values[static_cast<size_t>(t)].push_back(std::move(now));
    }
  });

  // One process: the table takes the sum of both trainers' gradients (each
  // trainer steps it with its own), the dense part their average (DDP).
  at::Tensor table = table0.clone().requires_grad_(true);
  Mlp ref = makeMlp(1.0);
  for (int step = 0; step < kSteps; ++step) {
    std::vector<at::Tensor> losses;
    for (int t = 0; t < 2; ++t) {
      const Batch b = batchOf(t, step);
      at::Tensor rows = std::get<0>(
          at::embedding_bag(table, b.ids, b.offsets, false, 0, false));
      losses.push_back(at::mse_loss(ref(rows), b.y));
    }
    auto denseGrads = torch::autograd::grad({(losses[0] + losses[1]) / 2},
                                            ref->parameters(), {}, true);
    auto tableGrad = torch::autograd::grad({losses[0] + losses[1]}, {table});
    {
      at::NoGradGuard noGrad;
      auto ps = ref->parameters();
      for (size_t i = 0; i < ps.size(); ++i) {
        ps[i].sub_(denseGrads[i] * 0.2);
      }
      table.sub_(tableGrad[0] * 0.2);
    }
    auto ps = ref->parameters();
    for (int t = 0; t < 2; ++t) {
      const auto& got = values[static_cast<size_t>(t)];
      ASSERT_EQ(got.size(), static_cast<size_t>(kSteps));
      for (size_t i = 0; i < ps.size(); ++i) {
        EXPECT_LE((got[static_cast<size_t>(step)][i] - ps[i])
                      .abs()
                      .max()
                      .item<double>(),
                  kTol)
            << "trainer " << t << ", step " << step << ", parameter " << i;
      }
    }
  }
  EXPECT_LE((tableAt("t").detach() - table.detach()).abs().max().item<double>(),
            kTol);
  // The steps moved it.
  EXPECT_GT((tableAt("t").detach() - table0).abs().max().item<double>(), 1e-3);
}

// findUnusedParameters in a context: a branch one trainer takes and the
// other does not; both get the same averaged gradients in their contexts,
// and the branch's gradient is the taker's divided by the world size.
TEST_F(Hybrid, UnusedParametersInAContextGetTheGroupsAverage) {
  std::vector<std::vector<at::Tensor>> grads(2);
  runTrainers([&](int t) {
    auto pg = groupOf(t);
    Mlp mlp = makeMlp(3.0, /*withBranch=*/true);
    DistributedDataParallel model(mlp, pg, {.findUnusedParameters = true});
    const Batch b = batchOf(t, 0);
    dist::Context ctx;
    at::Tensor rows =
        rpc::rpcSync<lookupRows>("w0", std::string("t"), b.ids, b.offsets);
    ctx.backward({at::mse_loss(model(rows, /*useBranch=*/t == 0), b.y)});
    dist::GradientMap g = ctx.gradients();
    for (const auto& p : mlp->parameters()) {
      grads[static_cast<size_t>(t)].push_back(g.find(p));
    }
  });
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) {
    ASSERT_TRUE(grads[0][i].defined()) << i;
    ASSERT_TRUE(grads[1][i].defined()) << i;
    EXPECT_TRUE(grads[0][i].equal(grads[1][i])) << "parameter " << i;
  }
  // The reference for the branch's weight: trainer 0's gradient / 2.
  Mlp ref = makeMlp(3.0, true);
  const Batch b = batchOf(0, 0);
  at::Tensor rows =
      std::get<0>(at::embedding_bag(table0, b.ids, b.offsets, false, 0, false));
  at::mse_loss(ref(rows, true), b.y).backward();
  const auto names = ref->named_parameters();
  size_t i = 0;
  for (const auto& item : names) {
    if (item.key() == "branch.weight") {
      EXPECT_LE(
          (grads[0][i] - item.value().grad() / 2).abs().max().item<double>(),
          kTol);
    }
    ++i;
  }
}

// The DDP module's output also sent to another worker and back: its
// parameters then get gradients in two engine runs here (one from the
// loss, one when the gradient returns over RPC), which DDP refuses, naming
// the cause, instead of reducing part of a gradient.
TEST_F(Hybrid, ParametersReachedByTwoEngineRunsAreRefused) {
  rpc::CurrentAgentScope scope(&agents[1]);
  collectives::ProcessGroupOptions options;
  options.timeout = 30s;
  options.watchdogMode = collectives::WatchdogMode::kFail;
  auto pg = ProcessGroup::create("cpu", std::make_shared<store::HashStore>(), 0,
                                 1, options);
  Mlp mlp = makeMlp(5.0);
  DistributedDataParallel model(mlp, pg);
  const Batch b = batchOf(0, 0);
  dist::Context ctx;
  at::Tensor rows =
      rpc::rpcSync<lookupRows>("w0", std::string("t"), b.ids, b.offsets);
  at::Tensor out = model(rows);
  at::Tensor back = rpc::rpcSync<scaled>("w0", out, 2.0);
  at::Tensor loss = at::mse_loss(out, b.y) + at::mse_loss(back, b.y);
  try {
    ctx.backward({loss});
    FAIL() << "backward succeeded";
  } catch (const Exception& e) {
    EXPECT_NE(std::string(e.what()).find("got gradients twice"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("send its inputs over RPC"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace trellis::ddp
