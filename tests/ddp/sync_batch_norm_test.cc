// SyncBatchNorm: ranks as threads of this process, each with its own
// ProcessGroup (cpu backend) over one HashStore, checked against one
// torch::nn::BatchNorm on the concatenated (global) batch.
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ranks.h"
#include <trellis/collectives/process_group.h>
#include <trellis/core/error.h>
#include <trellis/ddp/distributed_data_parallel.h>
#include <trellis/ddp/join.h>
#include <trellis/ddp/sync_batch_norm.h>
#include <trellis/store/hash_store.h>

namespace trellis::ddp {
namespace {

using namespace std::chrono_literals;
using collectives::ProcessGroup;
using testing::runRanks;

constexpr double kTol = 1e-5;

double maxDiff(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined() || !b.defined()) {
    return a.defined() == b.defined() ? 0 : INFINITY;
  }
  EXPECT_EQ(a.sizes(), b.sizes());
  return (a.to(torch::kDouble) - b.to(torch::kDouble))
      .abs()
      .max()
      .item<double>();
}

// ---- Equality with BatchNorm on the global batch ----

struct Shape {
  std::string name;
  std::vector<int64_t> tail;  // after (N, C)
};
void PrintTo(const Shape& s, std::ostream* os) { *os << s.name; }

class GlobalBatch : public ::testing::TestWithParam<Shape> {};

// Three ranks with 5, 2 and 3 rows, two training iterations (momentum
// and the cumulative average both), then eval: outputs, the input's
// gradients, the sum over ranks of the weight's and bias's gradients, and
// the running statistics all equal BatchNorm's on the 10 rows.
TEST_P(GlobalBatch, MatchesBatchNormOnTheConcatenatedBatch) {
  at::set_num_threads(1);
  const Shape& shape = GetParam();
  constexpr int kRanks = 3;
  const int64_t rows[kRanks] = {5, 2, 3};
  constexpr int64_t kC = 4;
  for (const std::optional<double> momentum :
       {std::optional<double>(0.1), std::optional<double>()}) {
    torch::manual_seed(3);
    std::vector<std::vector<torch::Tensor>> xs(2), gs(2);
    for (int it = 0; it < 2; ++it) {
      for (int r = 0; r < kRanks; ++r) {
        std::vector<int64_t> sz{rows[r], kC};
        sz.insert(sz.end(), shape.tail.begin(), shape.tail.end());
        xs[it].push_back(torch::randn(sz) * 3 + 1.5);
        gs[it].push_back(torch::randn(sz));
      }
    }
    const auto w0 = torch::rand({kC}) + 0.5;
    const auto b0 = torch::randn({kC});

    // Reference: BatchNorm1d for (N, C) and (N, C, L), 2d for (N, C, H, W).
    torch::nn::BatchNormOptions bnOptions(kC);
    bnOptions.momentum(momentum ? c10::optional<double>(*momentum)
                                : c10::optional<double>());
    std::shared_ptr<torch::nn::Module> ref;
    std::function<torch::Tensor(const torch::Tensor&)> refForward;
    if (shape.tail.size() == 2) {
      auto bn = std::make_shared<torch::nn::BatchNorm2dImpl>(bnOptions);
      ref = bn;
      refForward = [bn](const torch::Tensor& x) { return bn->forward(x); };
    } else {
      auto bn = std::make_shared<torch::nn::BatchNorm1dImpl>(bnOptions);
      ref = bn;
      refForward = [bn](const torch::Tensor& x) { return bn->forward(x); };
    }
    {
      torch::NoGradGuard noGrad;
      ref->named_parameters()["weight"].copy_(w0);
      ref->named_parameters()["bias"].copy_(b0);
    }
    std::vector<torch::Tensor> refOut, refGradX, refGradW, refGradB;
    for (int it = 0; it < 2; ++it) {
      auto x = torch::cat(xs[it]).requires_grad_(true);
      for (auto& p : ref->parameters()) {
        p.mutable_grad() = torch::Tensor();
      }
      auto y = refForward(x);
      (y * torch::cat(gs[it])).sum().backward();
      refOut.push_back(y.detach());
      refGradX.push_back(x.grad());
      refGradW.push_back(ref->named_parameters()["weight"].grad().clone());
      refGradB.push_back(ref->named_parameters()["bias"].grad().clone());
    }
    ref->eval();
    const auto evalX = torch::randn(xs[0][0].sizes());
    const auto refEval = refForward(evalX).detach();
    const auto refMean = ref->named_buffers()["running_mean"].clone();
    const auto refVar = ref->named_buffers()["running_var"].clone();

    std::vector<std::vector<torch::Tensor>> gradW(2), gradB(2);
    for (int it = 0; it < 2; ++it) {
      gradW[it].resize(kRanks);
      gradB[it].resize(kRanks);
    }
    runRanks(kRanks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      SyncBatchNorm bn(
          SyncBatchNormOptions(kC).momentum(momentum).processGroup(pg));
      {
        torch::NoGradGuard noGrad;
        bn->weight.copy_(w0);
        bn->bias.copy_(b0);
      }
      int64_t offset = 0;
      for (int r = 0; r < rank; ++r) {
        offset += rows[r];
      }
      for (int it = 0; it < 2; ++it) {
        bn->zero_grad();
        auto x = xs[it][rank].clone().requires_grad_(true);
        auto y = bn(x);
        (y * gs[it][rank]).sum().backward();
        EXPECT_LE(maxDiff(y, refOut[it].narrow(0, offset, rows[rank])), kTol)
            << "output, rank " << rank << " iteration " << it;
        EXPECT_LE(maxDiff(x.grad(), refGradX[it].narrow(0, offset, rows[rank])),
                  kTol)
            << "input gradient, rank " << rank << " iteration " << it;
        gradW[it][rank] = bn->weight.grad().clone();
        gradB[it][rank] = bn->bias.grad().clone();
      }
      EXPECT_LE(maxDiff(bn->running_mean, refMean), kTol) << "rank " << rank;
      EXPECT_LE(maxDiff(bn->running_var, refVar), kTol) << "rank " << rank;
      EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 2);
      bn->eval();
      EXPECT_LE(maxDiff(bn(evalX), refEval), kTol) << "eval, rank " << rank;
    });
    for (int it = 0; it < 2; ++it) {
      EXPECT_LE(
          maxDiff(gradW[it][0] + gradW[it][1] + gradW[it][2], refGradW[it]),
          kTol)
          << "weight gradient, iteration " << it;
      EXPECT_LE(
          maxDiff(gradB[it][0] + gradB[it][1] + gradB[it][2], refGradB[it]),
          kTol)
          << "bias gradient, iteration " << it;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(SyncBatchNorm, GlobalBatch,
                         ::testing::Values(Shape{"nc", {}}, Shape{"ncl", {6}},
                                           Shape{"nchw", {3, 5}}),
                         [](const auto& info) { return info.param.name; });

// A rank with an empty batch contributes nothing; the others normalize
// over theirs.
TEST(SyncBatchNorm, ARankWithAnEmptyBatchCountsZero) {
  at::set_num_threads(1);
  torch::manual_seed(5);
  const auto x = torch::randn({6, 3});
  torch::nn::BatchNorm1d ref(3);
  const auto expected = ref(x).detach();
  runRanks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    SyncBatchNorm bn(SyncBatchNormOptions(3).processGroup(pg));
    auto y = bn(rank == 0 ? x : torch::zeros({0, 3}));
    if (rank == 0) {
      EXPECT_LE(maxDiff(y, expected), kTol);
    }
    EXPECT_LE(maxDiff(bn->running_mean, ref->running_mean), kTol);
    EXPECT_LE(maxDiff(bn->running_var, ref->running_var), kTol);
  });
}

// Eval mode issues no collective: rank 0 runs eval forwards that rank 1
// never matches, then both allreduce one number; an allreduce left over
// from eval would pair with it and fail (or sum wrong).
TEST(SyncBatchNorm, EvalModeIssuesNoCollective) {
  at::set_num_threads(1);
  runRanks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    SyncBatchNorm bn(SyncBatchNormOptions(4).processGroup(pg));
    bn->eval();
    if (rank == 0) {
      for (int i = 0; i < 3; ++i) {
        auto y = bn(torch::randn({5, 4, 2, 2}));
        y.sum().backward();
      }
    }
    auto one = torch::ones({1});
    pg->allreduce(one).wait();
    EXPECT_EQ(one.item<float>(), 2);
  });
  // No group at all is fine in eval, not in training.
  SyncBatchNorm alone(4);
  alone->eval();
  EXPECT_NO_THROW(alone(torch::randn({2, 4})));
  alone->train();
  try {
    alone(torch::randn({2, 4}));
    ADD_FAILURE() << "a training forward without a group did not throw";
  } catch (const FailedPreconditionError& e) {
    EXPECT_NE(std::string(e.what()).find("process group"), std::string::npos)
        << e.what();
  }
}

TEST(SyncBatchNorm, BadInputsAreClearErrors) {
  SyncBatchNorm bn(SyncBatchNormOptions(4));  // checked before any group use
  const auto expectError = [&](const torch::Tensor& x,
                               const std::string& what) {
    try {
      bn(x);
      ADD_FAILURE() << "no error for " << x.sizes();
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos)
          << e.what();
    }
  };
  expectError(torch::randn({2, 3}), "has 3 channels");
  expectError(torch::randn({2, 3}), "numFeatures 4");
  expectError(torch::randn({2, 5, 6, 7}), "has 5 channels");
  expectError(torch::randn({4}), "got a 1-D input");
  expectError(torch::randn({2, 4, 1, 1, 1}), "got a 5-D input");
  expectError(torch::ones({2, 4}, torch::kLong), "floating-point");
  try {
    SyncBatchNorm zero(0);
    ADD_FAILURE() << "numFeatures 0 accepted";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("numFeatures"), std::string::npos);
  }
  // One value per channel in the global batch: an error on every rank.
  std::vector<std::string> errors(2);
  runRanks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    SyncBatchNorm one(SyncBatchNormOptions(2).processGroup(pg));
    try {
      one(rank == 0 ? torch::randn({1, 2}) : torch::zeros({0, 2}));
    } catch (const InvalidArgumentError& e) {
      errors[rank] = e.what();
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("more than 1 value per channel"), std::string::npos) << e;
  }
}

// ---- convertSyncBatchNorm ----

// A module holding a Sequential in a member: the Sequential is rebuilt in
// place, so the member still reaches the new layers.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    body = register_module(
        "body",
        torch::nn::Sequential(
            torch::nn::Linear(5, 5),
            torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(5).eps(1e-3))));
  }
  torch::Tensor forward(torch::Tensor x) { return body->forward(x); }
  torch::nn::Sequential body{nullptr};
};
TORCH_MODULE(Block);

TEST(SyncBatchNorm, ConvertSwapsBatchNormsAndKeepsTheirState) {
  at::set_num_threads(1);
  torch::manual_seed(9);
  torch::nn::Sequential net(torch::nn::Linear(6, 5), torch::nn::BatchNorm1d(5),
                            torch::nn::Functional(torch::relu), Block());
  torch::nn::ModuleList list(torch::nn::BatchNorm2d(3), torch::nn::ReLU());
  // Trained-looking state.
  for (int i = 0; i < 3; ++i) {
    net->forward(torch::randn({8, 6}));
    list[0]->as<torch::nn::BatchNorm2d>()->forward(torch::randn({4, 3, 2, 2}));
  }
  {
    torch::NoGradGuard noGrad;
    for (auto& p : net->parameters()) {
      p.add_(torch::randn(p.sizes()) * 0.1);
    }
  }
  net->eval();
  const auto x = torch::randn({4, 6});
  const auto before = net->forward(x).detach();
  const auto params = net->named_parameters();
  const auto buffers = net->named_buffers();
  std::vector<std::string> paramNames, bufferNames;
  for (const auto& p : params) {
    paramNames.push_back(p.key());
  }
  for (const auto& b : buffers) {
    bufferNames.push_back(b.key());
  }
  std::vector<torch::Tensor> bufferValues;
  for (const auto& b : buffers) {
    bufferValues.push_back(b.value().clone());
  }

  auto out = convertSyncBatchNorm(net.ptr(), nullptr);
  EXPECT_EQ(out.get(), net.ptr().get());
  EXPECT_TRUE(net[1]->as<SyncBatchNormImpl>() != nullptr);
  auto* inner = net[3]->as<Block>()->body->ptr(1)->as<SyncBatchNormImpl>();
  ASSERT_TRUE(inner != nullptr);
  EXPECT_EQ(inner->options.eps(), 1e-3);
  // A ModuleList is rebuilt in place too.
  const auto listWeight = list[0]->as<torch::nn::BatchNorm2d>()->weight;
  convertSyncBatchNorm(list.ptr(), nullptr);
  ASSERT_TRUE(list[0]->as<SyncBatchNormImpl>() != nullptr);
  EXPECT_TRUE(list[0]->as<SyncBatchNormImpl>()->weight.is_same(listWeight));
  EXPECT_TRUE(list[1]->as<torch::nn::ReLUImpl>() != nullptr);
  EXPECT_FALSE(net[1]->is_training());
  // Same names, same tensors (shared, as torch's convert does).
  const auto params2 = net->named_parameters();
  const auto buffers2 = net->named_buffers();
  std::vector<std::string> paramNames2, bufferNames2;
  for (const auto& p : params2) {
    paramNames2.push_back(p.key());
    EXPECT_TRUE(p.value().is_same(params[p.key()])) << p.key();
  }
  for (const auto& b : buffers2) {
    bufferNames2.push_back(b.key());
  }
  EXPECT_EQ(paramNames2, paramNames);
  EXPECT_EQ(bufferNames2, bufferNames);
  size_t i = 0;
  for (const auto& b : buffers2) {
    EXPECT_TRUE(torch::equal(b.value(), bufferValues[i++])) << b.key();
  }
  EXPECT_LE(maxDiff(net->forward(x), before), 0);

  // A batch norm itself becomes a SyncBatchNorm.
  auto bn2 = std::make_shared<torch::nn::BatchNorm2dImpl>(7);
  auto converted = convertSyncBatchNorm(bn2, nullptr);
  ASSERT_TRUE(std::dynamic_pointer_cast<SyncBatchNormImpl>(converted));
  EXPECT_TRUE(
      std::dynamic_pointer_cast<SyncBatchNormImpl>(converted)->weight.is_same(
          bn2->weight));
}

struct HeldImpl : torch::nn::Module {
  HeldImpl() {
    fc = register_module("fc", torch::nn::Linear(3, 3));
    bn = register_module("bn", torch::nn::BatchNorm1d(3));
  }
  torch::Tensor forward(torch::Tensor x) { return bn(fc(x)); }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Held);

// A member holder cannot be rebound: refused, naming the path, and the
// module is left as it was.
TEST(SyncBatchNorm, ConvertRefusesABatchNormHeldByAMember) {
  torch::nn::Sequential net(torch::nn::BatchNorm1d(3), Held());
  try {
    convertSyncBatchNorm(net.ptr(), nullptr);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("'1.bn'"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(net[0]->as<torch::nn::BatchNorm1dImpl>() != nullptr);
}

// ---- Join: uneven inputs ----

constexpr int kJoinRanks = 3;
constexpr int kJoinBatches[kJoinRanks] = {4, 2, 1};
constexpr int kJoinMaxBatches = 4;

// conv -> batch norm 2d -> relu -> linear -> batch norm 1d -> relu ->
// linear: two layers, so a joined rank replays four allreduces in order.
torch::nn::Sequential joinNet() {
  return torch::nn::Sequential(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 3, 3)),
      torch::nn::BatchNorm2d(3), torch::nn::Functional(torch::relu),
      torch::nn::Flatten(), torch::nn::Linear(3 * 4 * 4, 8),
      torch::nn::BatchNorm1d(8), torch::nn::Functional(torch::relu),
      torch::nn::Linear(8, 2));
}

struct JoinData {
  std::vector<std::vector<torch::Tensor>> x, y;  // [rank][iteration]
};

// Uneven batch sizes too: rank r's batches have 3 + r rows.
JoinData joinData() {
  torch::manual_seed(21);
  JoinData d;
  for (int r = 0; r < kJoinRanks; ++r) {
    d.x.emplace_back();
    d.y.emplace_back();
    for (int it = 0; it < kJoinBatches[r]; ++it) {
      d.x[r].push_back(torch::randn({3 + r, 1, 6, 6}));
      d.y[r].push_back(torch::randn({3 + r, 2}));
    }
  }
  return d;
}

std::vector<torch::Tensor> stateOf(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) {
    out.push_back(p.detach().clone());
  }
  for (const auto& b : m.buffers()) {
    out.push_back(b.clone());
  }
  return out;
}

double maxDiff(const std::vector<torch::Tensor>& a,
               const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    m = std::max(m, maxDiff(a[i], b[i]));
  }
  return m;
}

// DDP (divideByInitialWorldSize) and SyncBatchNorm under one Join: each
// iteration is BatchNorm over the batches of the ranks still training,
// and the loss the sum of theirs over 3.
TEST(SyncBatchNorm, JoinWithDdpAndUnevenInputsMatchesOneProcess) {
  at::set_num_threads(1);
  const JoinData d = joinData();
  torch::manual_seed(100);
  auto reference = joinNet();
  torch::optim::SGD refOpt(reference->parameters(),
                           torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int it = 0; it < kJoinMaxBatches; ++it) {
    std::vector<torch::Tensor> xs, ys;
    for (int r = 0; r < kJoinRanks; ++r) {
      if (it < kJoinBatches[r]) {
        xs.push_back(d.x[r][it]);
        ys.push_back(d.y[r][it]);
      }
    }
    refOpt.zero_grad();
    auto out = reference->forward(torch::cat(xs));
    torch::Tensor loss;
    int64_t at = 0;
    for (const auto& y : ys) {
      auto l = torch::mse_loss(out.narrow(0, at, y.size(0)), y);
      at += y.size(0);
      loss = loss.defined() ? loss + l : l;
    }
    (loss / kJoinRanks).backward();
    refOpt.step();
  }
  const auto expected = stateOf(*reference);

  std::vector<torch::nn::Sequential> nets;
  for (int r = 0; r < kJoinRanks; ++r) {
    torch::manual_seed(100 + r);  // only rank 0 starts like the reference
    nets.push_back(joinNet());
  }
  std::vector<std::vector<torch::Tensor>> finals(kJoinRanks);
  const auto start = std::chrono::steady_clock::now();
  runRanks(kJoinRanks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    auto bnGroup = pg->newGroup({0, 1, 2});
    auto net = nets[rank];
    convertSyncBatchNorm(net.ptr(), bnGroup);
    DistributedDataParallel model(net, pg);
    SyncBatchNormJoinable bns(*net);
    EXPECT_EQ(bns.size(), 2u);
    torch::optim::SGD opt(net->parameters(),
                          torch::optim::SGDOptions(0.1).momentum(0.9));
    Join join({&model, &bns});
    for (int it = 0; it < kJoinBatches[rank]; ++it) {
      opt.zero_grad();
      torch::mse_loss(model(d.x[rank][it]), d.y[rank][it]).backward();
      opt.step();
    }
    join.finish();
    finals[rank] = stateOf(*net);
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
  for (int r = 0; r < kJoinRanks; ++r) {
    EXPECT_LE(maxDiff(finals[r], expected), kTol) << "rank " << r;
    EXPECT_EQ(maxDiff(finals[r], finals[0]), 0) << "rank " << r;
  }
}

// SyncBatchNorm alone in a Join: its statistics allreduce is where the
// ranks still training notify; outputs are BatchNorm's over each
// iteration's active batches, and the running statistics end as its, on
// every rank (the last joiner's). With {3, 1, 0} batches, rank 2 joins
// before any iteration of its own and shadows from the layers alone.
class JoinAlone : public ::testing::TestWithParam<std::vector<int>> {};

TEST_P(JoinAlone, MatchesOneProcess) {
  at::set_num_threads(1);
  const std::vector<int> batches = GetParam();
  const int maxBatches = *std::max_element(batches.begin(), batches.end());
  torch::manual_seed(4);
  std::vector<std::vector<torch::Tensor>> xs(kJoinRanks);
  for (int r = 0; r < kJoinRanks; ++r) {
    for (int it = 0; it < batches[r]; ++it) {
      xs[r].push_back(torch::randn({2 + r, 5, 3}));
    }
  }
  torch::nn::BatchNorm1d ref(5);
  std::vector<std::vector<torch::Tensor>> refOut(maxBatches);
  for (int it = 0; it < maxBatches; ++it) {
    std::vector<torch::Tensor> batch;
    for (int r = 0; r < kJoinRanks; ++r) {
      if (it < batches[r]) {
        batch.push_back(xs[r][it]);
      }
    }
    auto y = ref(torch::cat(batch)).detach();
    int64_t at = 0;
    for (const auto& b : batch) {
      refOut[it].push_back(y.narrow(0, at, b.size(0)));
      at += b.size(0);
    }
  }
  runRanks(kJoinRanks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    SyncBatchNorm bn(SyncBatchNormOptions(5).processGroup(pg));
    SyncBatchNormJoinable joinable(*bn);
    Join join({&joinable});
    for (int it = 0; it < batches[rank]; ++it) {
      auto x = xs[rank][it].clone().requires_grad_(true);
      auto y = bn(x);
      y.pow(2).sum().backward();
      EXPECT_LE(maxDiff(y, refOut[it][rank]), kTol)
          << "rank " << rank << " iteration " << it;
    }
    join.finish();
    EXPECT_LE(maxDiff(bn->running_mean, ref->running_mean), kTol)
        << "rank " << rank;
    EXPECT_LE(maxDiff(bn->running_var, ref->running_var), kTol)
        << "rank " << rank;
    EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), maxBatches);
  });
}

INSTANTIATE_TEST_SUITE_P(SyncBatchNorm, JoinAlone,
                         ::testing::Values(std::vector<int>{4, 2, 1},
                                           std::vector<int>{3, 1, 0}),
                         [](const auto& info) {
                           std::string name = "batches";
                           for (int b : info.param) {
                             name += "_" + std::to_string(b);
                           }
                           return name;
                         });

TEST(SyncBatchNorm, JoinableRefusesModulesWithoutLayersOrTwoCovers) {
  torch::nn::Linear fc(2, 2);
  EXPECT_THROW(SyncBatchNormJoinable{*fc}, InvalidArgumentError);
  SyncBatchNorm bn(2);
  EXPECT_THROW(SyncBatchNormJoinable{*bn}, InvalidArgumentError);  // no group
}

}  // namespace
}  // namespace trellis::ddp
