// DistributedDataParallel: ranks as threads of this process, each with its
// own ProcessGroup (cpu backend) over one HashStore, checked against one
// process training on the whole batch; and two tests with real processes
// (ddp_worker). Every rank's model starts from a different seed, so the
// construction broadcast is checked by every comparison.
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../rpc/worker_job.h"
#include "compare.h"
#include "models.h"
#include "ranks.h"
#include <trellis/collectives/process_group.h>
#include <trellis/core/error.h>
#include <trellis/ddp/distributed_data_parallel.h>
#include <trellis/ddp/join.h>
#include <trellis/ddp/reducer.h>  // assignBuckets (internal)
#include <trellis/store/hash_store.h>

namespace trellis::ddp {
namespace {

using namespace std::chrono_literals;
using collectives::ProcessGroup;
using testing::Cnn;
using testing::gradsOf;
using testing::maxDiff;
using testing::Mlp;
using testing::Reordered;
using testing::runRanks;
using testing::valuesOf;

constexpr double kTol = 1e-6;
constexpr int64_t kBatch = 12;  // divisible by 2 and 3 ranks

torch::Tensor shard(const torch::Tensor& t, int rank, int n) {
  const int64_t rows = t.size(0) / n;
  return t.narrow(0, rank * rows, rows);
}

torch::optim::SGD sgd(const std::vector<torch::Tensor>& params) {
  return torch::optim::SGD(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

struct Case {
  std::string name;
  int ranks;
  Options options;
  bool cnn = false;
  // Sets every .grad to none before each backward, as libtorch 2.x's
  // zero_grad() does by default (1.13's zeroes in place).
  bool gradsToNone = false;
  // Before each backward, every matrix's .grad is a transposed zero tensor
  // (autograd accumulates into it and keeps its strides): DDP reduces a
  // copy in its bucket, not the gradient in place.
  bool transposedGrads = false;
  // Before each backward, the .grads are disjoint parts of one buffer of
  // the program's (reduced in place, each on its own).
  bool gradsInOneBuffer = false;
};

// gtest prints a parameter by name, not as bytes.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class GradientEquality : public ::testing::TestWithParam<Case> {};

// Four SGD steps (momentum): every rank's averaged gradients and then its
// parameters match one process on the whole batch after every step, the
// bucket rebuild after the first included.
template <typename Net>
void trainAndCompare(const Case& c, const torch::Tensor& x,
                     const torch::Tensor& y) {
  constexpr int kIters = 4;
  torch::manual_seed(100);
  Net reference;
  auto refOpt = sgd(reference->parameters());
  std::vector<std::vector<torch::Tensor>> refGrads, refParams;
  for (int it = 0; it < kIters; ++it) {
    refOpt.zero_grad();
    torch::mse_loss(reference(x), y).backward();
    refGrads.push_back(gradsOf(*reference));
    refOpt.step();
    refParams.push_back(valuesOf(*reference));
  }
  std::vector<Net> nets;
  for (int r = 0; r < c.ranks; ++r) {
    torch::manual_seed(100 + r);  // only rank 0 starts like the reference
    nets.emplace_back();
  }
  runRanks(c.ranks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Net net = nets[rank];
    DistributedDataParallel model(net, pg, c.options);
    auto opt = sgd(net->parameters());
    const auto xs = shard(x, rank, c.ranks);
    const auto ys = shard(y, rank, c.ranks);
    for (int it = 0; it < kIters; ++it) {
      opt.zero_grad();
      if (c.gradsToNone) {
        for (auto& p : net->parameters()) {
          p.mutable_grad() = torch::Tensor();
        }
      }
      if (c.transposedGrads) {
        for (auto& p : net->parameters()) {
          // Column-major; set_, not t(): 1.13's zero_grad() detaches it.
          const auto zeros = torch::zeros({p.numel()});
          p.mutable_grad() = torch::empty({0}).set_(
              zeros.storage(), 0, p.sizes(),
              p.dim() == 2 ? std::vector<int64_t>{1, p.size(0)}
                           : p.strides().vec());
        }
      }
      if (c.gradsInOneBuffer) {
        int64_t total = 0;
        for (const auto& p : net->parameters()) {
          total += p.numel();
        }
        const auto buffer = torch::zeros({total});
        int64_t at = 0;
        for (auto& p : net->parameters()) {
          // Not an autograd view: 1.13's zero_grad() detaches every .grad.
          p.mutable_grad() = torch::empty({0}).set_(
              buffer.storage(), buffer.storage_offset() + at, p.sizes());
          at += p.numel();
        }
      }
      torch::mse_loss(model(xs), ys).backward();
      EXPECT_LE(maxDiff(gradsOf(*net), refGrads[it]), kTol)
          << "rank " << rank << " iteration " << it;
      opt.step();
      EXPECT_LE(maxDiff(valuesOf(*net), refParams[it]), kTol)
          << "rank " << rank << " iteration " << it;
    }
    // gradientAsBucketView: the grads live in the buckets (one storage per
    // bucket); otherwise each has its own.
    const auto params = net->parameters();
    const auto buckets = model.bucketParameterNames();
    size_t inBuckets = 0;
    for (const auto& b : buckets) {
      inBuckets += b.size();
    }
    EXPECT_EQ(inBuckets, params.size());
    // The program's own .grad tensors are the ones that hold the averages
    // (DDP reduced them in place or copied into them), layout kept.
    std::set<const void*> storages;
    for (const auto& p : params) {
      storages.insert(p.grad().storage().data());
      if (c.transposedGrads && p.dim() == 2) {
        EXPECT_FALSE(p.grad().is_contiguous()) << "rank " << rank;
      }
    }
    EXPECT_EQ(storages.size(), c.gradsInOneBuffer               ? 1
                               : c.options.gradientAsBucketView ? buckets.size()
                                                                : params.size())
        << "rank " << rank;
  });
}

TEST_P(GradientEquality, MatchesOneProcessOnTheWholeBatch) {
  at::set_num_threads(1);
  const Case& c = GetParam();
  torch::manual_seed(7);
  if (c.cnn) {
    const auto x = torch::randn({kBatch, 1, 8, 8});
    const auto y = torch::randn({kBatch, 4});
    trainAndCompare<Cnn>(c, x, y);
  } else {
    const auto x = torch::randn({kBatch, 8});
    const auto y = torch::randn({kBatch, 4});
    trainAndCompare<Mlp>(c, x, y);
  }
}

// Tiny caps: one parameter per bucket (the MLP's largest is 1 KiB), or a
// few per bucket.
INSTANTIATE_TEST_SUITE_P(
    Ddp, GradientEquality,
    ::testing::Values(Case{"TwoRanks", 2, {}}, Case{"ThreeRanks", 3, {}},
                      Case{"TwoRanksView", 2, {.gradientAsBucketView = true}},
                      Case{"ThreeRanksViewGradsToNone",
                           3,
                           {.gradientAsBucketView = true},
                           false,
                           true},
                      Case{"TwoRanksOneParamPerBucket",
                           2,
                           {.bucketCapMb = 1e-6, .firstBucketCapMb = 1e-6}},
                      Case{"ThreeRanksOneParamPerBucketView",
                           3,
                           {.bucketCapMb = 1e-6,
                            .firstBucketCapMb = 1e-6,
                            .gradientAsBucketView = true}},
                      Case{"ThreeRanksSmallBuckets",
                           3,
                           {.bucketCapMb = 0.001, .firstBucketCapMb = 0.0002}},
                      Case{"TwoRanksCnn", 2, {}, true},
                      Case{.name = "ThreeRanksTransposedGrads",
                           .ranks = 3,
                           .options = {},
                           .transposedGrads = true},
                      Case{.name = "TwoRanksGradsInOneBuffer",
                           .ranks = 2,
                           .options = {.bucketCapMb = 0.001,
                                       .firstBucketCapMb = 0.0002},
                           .gradsInOneBuffer = true},
                      Case{"ThreeRanksCnnSmallBucketsView",
                           3,
                           {.bucketCapMb = 0.0005,
                            .firstBucketCapMb = 0.0001,
                            .gradientAsBucketView = true},
                           true}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(Ddp, AssignBucketsByCapAndDtype) {
  // Sizes in bytes: float32 params of 100, 100, 300 and 40 elements, one
  // float64 of 10; order 4 3 2 1 0 (reverse registration).
  std::vector<at::Tensor> params = {torch::zeros({100}), torch::zeros({100}),
                                    torch::zeros({300}), torch::zeros({40}),
                                    torch::zeros({10}, torch::kDouble)};
  const auto buckets = detail::assignBuckets(params, {4, 3, 2, 1, 0},
                                             /*firstCapBytes=*/200,
                                             /*capBytes=*/800);
  // float32: {3, 2} passes the first cap (1360 B), {1, 0} reaches the
  // second (800 B); float64 {4} stays open to the end but leads the order.
  const std::vector<std::vector<size_t>> want = {{4}, {3, 2}, {1, 0}};
  EXPECT_EQ(buckets, want);
}

// The buckets are rebuilt once, after the first backward, in the order the
// gradients became ready (rank 0's), identically on every rank.
TEST(Ddp, BucketsRebuiltInGradientReadyOrder) {
  at::set_num_threads(1);
  std::vector<Reordered> nets(2);
  std::vector<std::vector<std::vector<std::string>>> before(2), after(2),
      later(2);
  runRanks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    DistributedDataParallel model(
        nets[rank], pg, {.bucketCapMb = 1e-6, .firstBucketCapMb = 1e-6});
    const auto x = torch::randn({4, 8});
    before[rank] = model.bucketParameterNames();
    model(x).sum().backward();
    model(x).sum().backward();  // rebuilt at this forward
    after[rank] = model.bucketParameterNames();
    model(x).sum().backward();
    later[rank] = model.bucketParameterNames();
  });
  // Registration: out.weight out.bias in.weight in.bias; reversed.
  ASSERT_EQ(before[0].size(), 4u);
  EXPECT_EQ(before[0][0], std::vector<std::string>{"in.bias"});
  ASSERT_EQ(after[0].size(), 4u);
  // The last layer's gradients are ready first.
  EXPECT_EQ(after[0][0][0].substr(0, 4), "out.") << after[0][0][0];
  EXPECT_EQ(after[0][3][0].substr(0, 3), "in.") << after[0][3][0];
  EXPECT_EQ(after[0], after[1]);
  EXPECT_EQ(later[0], after[0]);  // once only
}

// Runs `onBackward` in its backward: placed on forward's input, its
// backward is the last node of the pass, after every parameter's gradient
// but the first layer's. CPU backward runs on the thread that called it,
// so a thread_local carries the callback per rank.
thread_local std::function<void()> onBackward;
struct Probe : torch::autograd::Function<Probe> {
  static torch::Tensor forward(torch::autograd::AutogradContext*,
                               torch::Tensor x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    onBackward();
    return g;
  }
};

// The last layer's bucket is averaged while backward still runs: seen from
// inside backward (the probe), its .grad (a bucket view) reaches the
// whole-batch gradient. Were buckets only sent at the end of backward,
// the probe would wait out its bound.
TEST(Ddp, AllreduceOverlapsBackward) {
  at::set_num_threads(1);
  torch::manual_seed(7);
  const auto x = torch::randn({kBatch, 8});
  const auto y = torch::randn({kBatch, 4});
  torch::manual_seed(100);
  Mlp reference;
  torch::mse_loss(reference(x), y).backward();
  const auto want = reference->fc3->weight.grad().clone();
  std::vector<Mlp> nets;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(100 + r);
    nets.emplace_back();
  }
  std::vector<double> seenInBackward(2, INFINITY);
  runRanks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Mlp net = nets[rank];
    DistributedDataParallel model(net, pg,
                                  {.bucketCapMb = 1e-6,
                                   .firstBucketCapMb = 1e-6,
                                   .gradientAsBucketView = true});
    onBackward = [&] {
      const auto end = std::chrono::steady_clock::now() + 10s;
      double diff = INFINITY;
      while (std::chrono::steady_clock::now() < end) {
        diff = (net->fc3->weight.grad() - want).abs().max().item<double>();
        if (diff <= kTol) {
          break;
        }
        std::this_thread::sleep_for(1ms);
      }
      seenInBackward[rank] = diff;
    };
    auto in = shard(x, rank, 2).clone().requires_grad_(true);
    torch::mse_loss(model(Probe::apply(in)), shard(y, rank, 2)).backward();
    onBackward = nullptr;
    EXPECT_LE(maxDiff({net->fc3->weight.grad()}, {want}), kTol);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_LE(seenInBackward[r], kTol) << "rank " << r;
  }
}

// A backward that fails midway (after some buckets went) never reaches its
// end-of-backward step: the next forward says so, on every rank, instead
// of going on with the ranks' collectives possibly out of step.
TEST(Ddp, ABackwardThatFailedMidwayFailsTheNextForward) {
  at::set_num_threads(1);
  std::vector<Mlp> nets(2);
  std::vector<std::string> backwardErrors(2), forwardErrors(2);
  runRanks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    DistributedDataParallel model(
        nets[rank], pg, {.bucketCapMb = 1e-6, .firstBucketCapMb = 1e-6});
    const auto x = torch::randn({4, 8});
    onBackward = [] { throw std::runtime_error("probe failed"); };
    try {
      model(Probe::apply(x.clone().requires_grad_(true))).sum().backward();
    } catch (const std::exception& e) {
      backwardErrors[rank] = e.what();
    }
    onBackward = nullptr;
    try {
      (void)model(x);
    } catch (const FailedPreconditionError& e) {
      forwardErrors[rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(backwardErrors[r].find("probe failed"), std::string::npos)
        << backwardErrors[r];
    EXPECT_NE(forwardErrors[r].find("ended before its gradient reduction "
                                    "finished"),
              std::string::npos)
        << "rank " << r << ": " << forwardErrors[r];
  }
}

// noSync for k steps, then a synced step: the averaged sum of all
// micro-batches' gradients, as one process accumulating over them.
class NoSync : public ::testing::TestWithParam<bool> {};

TEST_P(NoSync, AccumulatesLocallyThenReducesTheSum) {
  at::set_num_threads(1);
  constexpr int kRanks = 2;
  constexpr int kMicro = 4;  // 3 under noSync, 1 synced
  torch::manual_seed(7);
  std::vector<torch::Tensor> xs, ys;
  for (int k = 0; k < kMicro; ++k) {
    xs.push_back(torch::randn({kBatch, 8}));
    ys.push_back(torch::randn({kBatch, 4}));
  }
  torch::manual_seed(100);
  Mlp reference;
  for (int k = 0; k < kMicro; ++k) {
    torch::mse_loss(reference(xs[k]), ys[k]).backward();
  }
  const auto want = gradsOf(*reference);
  std::vector<Mlp> nets;
  for (int r = 0; r < kRanks; ++r) {
    torch::manual_seed(100 + r);
    nets.emplace_back();
  }
  runRanks(kRanks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    DistributedDataParallel model(nets[rank], pg,
                                  {.bucketCapMb = 0.001,
                                   .firstBucketCapMb = 0.0002,
                                   .gradientAsBucketView = GetParam()});
    std::vector<torch::Tensor> local;
    {
      auto guard = model.noSync();
      for (int k = 0; k < kMicro - 1; ++k) {
        torch::mse_loss(model(shard(xs[k], rank, kRanks)),
                        shard(ys[k], rank, kRanks))
            .backward();
      }
      local = gradsOf(*nets[rank]);
    }
    torch::mse_loss(model(shard(xs[kMicro - 1], rank, kRanks)),
                    shard(ys[kMicro - 1], rank, kRanks))
        .backward();
    EXPECT_LE(maxDiff(gradsOf(*nets[rank]), want), kTol) << "rank " << rank;
    // Under noSync each rank only had its own shards' sum, far from the
    // average.
    EXPECT_GT(maxDiff(local, want), 1e-3)
        << "rank " << rank << ": reduced under noSync";
  });
}

INSTANTIATE_TEST_SUITE_P(Ddp, NoSync, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "View" : "Copy";
                         });

// Without findUnusedParameters, a parameter without a gradient fails the
// backward on every rank, naming it, whichever rank skipped it; the next
// iteration works.
// Two small parameters whose .grad is one tensor of the program's, in a
// bucket behind a large one: autograd adds both gradients into it. Reduced
// in place as two tensors, that memory would be in one rank's part of a
// block twice and reduced twice; DDP reduces copies of both instead, and
// the shared tensor ends as one process's on the whole batch.
struct TwinsImpl : torch::nn::Module {
  TwinsImpl() {
    big = register_parameter("big", torch::randn({200, 200}));
    a = register_parameter("a", torch::randn({10, 10}));
    b = register_parameter("b", torch::randn({10, 10}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::matmul(x, a + b) +
           torch::matmul(x, big.narrow(0, 0, 10).narrow(1, 0, 10));
  }
  torch::Tensor big, a, b;
};
TORCH_MODULE(Twins);

TEST(Ddp, ParametersSharingOneGradTensorAreReducedOnce) {
  constexpr int kRanks = 2;
  torch::manual_seed(7);
  const auto x = torch::randn({kBatch, 10});
  const auto y = torch::randn({kBatch, 10});
  const auto shareGrad = [](Twins& net) {
    net->big.mutable_grad() = torch::zeros({200, 200});
    net->a.mutable_grad() = torch::zeros({10, 10});
    net->b.mutable_grad() = net->a.grad();
  };
  torch::manual_seed(100);
  Twins reference;
  shareGrad(reference);
  torch::mse_loss(reference(x), y).backward();
  const auto want = gradsOf(*reference);
  std::vector<Twins> nets;
  for (int r = 0; r < kRanks; ++r) {
    torch::manual_seed(100 + r);
    nets.emplace_back();
  }
  runRanks(kRanks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Twins net = nets[rank];
    DistributedDataParallel model(net, pg);
    shareGrad(net);
    torch::mse_loss(model(shard(x, rank, kRanks)), shard(y, rank, kRanks))
        .backward();
    EXPECT_TRUE(net->a.grad().is_same(net->b.grad())) << "rank " << rank;
    EXPECT_LE(maxDiff(gradsOf(*net), want), kTol) << "rank " << rank;
  });
}

TEST(Ddp, UnusedParameterErrorNamesThemOnEveryRank) {
  at::set_num_threads(1);
  for (int skipper : {-1, 1}) {  // -1: every rank skips the branch
    SCOPED_TRACE("skipper " + std::to_string(skipper));
    std::vector<Mlp> nets;
    for (int r = 0; r < 2; ++r) {
      nets.emplace_back(/*withBranch=*/true);
    }
    std::vector<std::string> errors(2);
    runRanks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      DistributedDataParallel model(
          nets[rank], pg, {.bucketCapMb = 1e-6, .firstBucketCapMb = 1e-6});
      const auto x = torch::randn({4, 8});
      const bool skip = skipper < 0 || rank == skipper;
      try {
        model(x, !skip).sum().backward();
      } catch (const FailedPreconditionError& e) {
        errors[rank] = e.what();
      }
      // Using every parameter again works, and agrees across ranks.
      model(x, true).sum().backward();
    });
    const std::string ranks = skipper < 0 ? "(2 of 2 ranks)" : "(1 of 2 ranks)";
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(errors[r].find("branch.weight " + ranks), std::string::npos)
          << "rank " << r << ": " << errors[r];
      EXPECT_NE(errors[r].find("branch.bias " + ranks), std::string::npos)
          << errors[r];
      EXPECT_EQ(errors[r].find("fc1"), std::string::npos) << errors[r];
      EXPECT_NE(errors[r].find("findUnusedParameters"), std::string::npos)
          << errors[r];
    }
    EXPECT_EQ(errors[0], errors[1]);
  }
}

// findUnusedParameters: a branch taken on some ranks only (or none)
// matches one process where exactly those rows take it; a branch no rank
// took keeps no gradient.
TEST(Ddp, FindUnusedParametersMatchesReference) {
  at::set_num_threads(1);
  constexpr int kRanks = 3;
  torch::manual_seed(7);
  const auto x = torch::randn({kBatch, 8});
  const auto y = torch::randn({kBatch, 4});
  for (auto [taker, staticGraph] :
       {std::pair{-1, false}, std::pair{1, false}, std::pair{1, true}}) {
    // taker -1: no rank takes the branch.
    SCOPED_TRACE("taker " + std::to_string(taker) +
                 (staticGraph ? ", staticGraph" : ""));
    torch::manual_seed(100);
    Mlp reference(/*withBranch=*/true);
    std::vector<torch::Tensor> outs;
    for (int r = 0; r < kRanks; ++r) {
      outs.push_back(reference(shard(x, r, kRanks), r == taker));
    }
    torch::mse_loss(torch::cat(outs), y).backward();
    const auto want = gradsOf(*reference);
    std::vector<Mlp> nets;
    for (int r = 0; r < kRanks; ++r) {
      torch::manual_seed(100 + r);
      nets.emplace_back(/*withBranch=*/true);
    }
    runRanks(kRanks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      DistributedDataParallel model(nets[rank], pg,
                                    {.bucketCapMb = 1e-6,
                                     .firstBucketCapMb = 1e-6,
                                     .findUnusedParameters = true,
                                     .staticGraph = staticGraph});
      for (int it = 0; it < 3; ++it) {  // before and after the rebuild
        for (auto& p : nets[rank]->parameters()) {
          p.mutable_grad() = torch::Tensor();
        }
        torch::mse_loss(model(shard(x, rank, kRanks), rank == taker),
                        shard(y, rank, kRanks))
            .backward();
        EXPECT_LE(maxDiff(gradsOf(*nets[rank]), want), kTol)
            << "rank " << rank << " iteration " << it;
      }
      if (taker < 0) {
        EXPECT_FALSE(nets[rank]->branch->weight.grad().defined());
      }
    });
  }
}

// staticGraph walks the graph at the first forward only: a branch that no
// rank took then, taken later, is an error naming it on every rank (a walk
// at that forward would have found it used).
TEST(Ddp, StaticGraphWalksOnceAndNamesAParameterTheGraphGained) {
  at::set_num_threads(1);
  constexpr int kRanks = 2;
  torch::manual_seed(7);
  const auto x = torch::randn({kBatch, 8});
  const auto y = torch::randn({kBatch, 4});
  std::vector<std::string> errors(kRanks);
  runRanks(kRanks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    torch::manual_seed(100);
    Mlp net(/*withBranch=*/true);
    DistributedDataParallel model(
        net, pg, {.findUnusedParameters = true, .staticGraph = true});
    for (int it = 0; it < 2; ++it) {
      torch::mse_loss(model(shard(x, rank, kRanks), false),
                      shard(y, rank, kRanks))
          .backward();
    }
    try {
      torch::mse_loss(model(shard(x, rank, kRanks), rank == 1),
                      shard(y, rank, kRanks))
          .backward();
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  });
  // The rank that took the branch fails at once; the other one's backward
  // waits for the first's bucket reduction, which fails with the group.
  EXPECT_NE(errors[1].find("'branch."), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("staticGraph"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0], "");
}

// Modules that differ fail construction on every rank, naming the first
// difference and which ranks have what.
TEST(Ddp, MismatchedModelsFailOnEveryRank) {
  at::set_num_threads(1);
  struct Variant {
    std::function<std::shared_ptr<torch::nn::Module>(int)> make;
    std::string expect;
  };
  const std::vector<Variant> variants = {
      {[](int rank) -> std::shared_ptr<torch::nn::Module> {
         auto m = std::make_shared<torch::nn::Module>();
         m->register_module("fc1", torch::nn::Linear(8, 16));
         m->register_module("fc2", torch::nn::Linear(rank == 2 ? 12 : 16, 16));
         return m;
       },
       "entry #2 of their parameters and buffers: ranks 0, 1 have parameter "
       "fc2.weight float32[16, 16]; rank 2 has parameter fc2.weight "
       "float32[16, 12]"},
      {[](int rank) -> std::shared_ptr<torch::nn::Module> {
         auto m = std::make_shared<torch::nn::Module>();
         m->register_module("fc1", torch::nn::Linear(8, 16));
         if (rank == 1) {
           m->register_module("extra", torch::nn::Linear(2, 2));
         }
         return m;
       },
       "entry #2 of their parameters and buffers: ranks 0, 2 have nothing "
       "(fewer parameters and buffers); rank 1 has parameter extra.weight "
       "float32[2, 2]"},
  };
  for (const auto& v : variants) {
    std::vector<std::string> errors(3);
    runRanks(3, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      try {
        DistributedDataParallel<torch::nn::Module> model(v.make(rank), pg);
      } catch (const InvalidArgumentError& e) {
        errors[rank] = e.what();
      }
    });
    for (int r = 0; r < 3; ++r) {
      EXPECT_NE(errors[r].find(v.expect), std::string::npos)
          << "rank " << r << ": " << errors[r];
    }
  }
}

// A module with a buffer (a running mean, say) that each rank changes.
struct WithBufferImpl : torch::nn::Module {
  WithBufferImpl() {
    fc = register_module("fc", torch::nn::Linear(2, 2));
    scale = register_buffer("scale", torch::ones({2}));
  }
  torch::Tensor forward(torch::Tensor x) { return fc(x) * scale; }
  torch::nn::Linear fc{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(WithBuffer);

TEST(Ddp, BuffersFollowRankZeroBeforeEachForward) {
  at::set_num_threads(1);
  for (bool broadcastBuffers : {true, false}) {
    std::vector<WithBuffer> nets(2);
    std::vector<float> seen(2);
    runRanks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      WithBuffer net = nets[rank];
      {
        torch::NoGradGuard g;
        net->scale.fill_(10 + rank);  // before construction
      }
      DistributedDataParallel model(net, pg,
                                    {.broadcastBuffers = broadcastBuffers});
      EXPECT_EQ(net->scale[0].item<float>(), 10) << "rank " << rank;
      {
        torch::NoGradGuard g;
        net->scale.fill_(20 + rank);
      }
      model(torch::ones({1, 2})).sum().backward();
      seen[rank] = net->scale[0].item<float>();
    });
    EXPECT_EQ(seen[0], 20);
    EXPECT_EQ(seen[1], broadcastBuffers ? 20 : 21);
  }
}

// Every rank of `job` exits 0 within 30 s; a rank that does not shows its
// stderr (a sanitizer's report ends a process with its own exit code).
void expectAllExitedZero(rpc::testing::Job& job) {
  const auto statuses = job.waitAll(30s);
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(rpc::testing::exitedZero(statuses[r]))
        << "rank " << r << " status " << statuses[r] << ":\n"
        << job.stderrOf(static_cast<int>(r));
  }
}

// Real processes over a TCPStore on loopback: a 2-rank training loop ends
// with every rank's parameters equal to one process on the whole batch.
TEST(DdpProcess, TwoProcessesTrainLikeOneOnTheWholeBatch) {
  at::set_num_threads(1);
  rpc::testing::Job job(DDP_WORKER_PATH, "train", 2);
  torch::manual_seed(7);
  const auto x = torch::randn({12, 8});
  const auto y = torch::randn({12, 4});
  torch::manual_seed(100);
  Mlp reference;
  auto opt = sgd(reference->parameters());
  for (int it = 0; it < 5; ++it) {
    opt.zero_grad();
    torch::mse_loss(reference(x), y).backward();
    opt.step();
  }
  std::vector<float> want;
  for (const auto& p : reference->parameters()) {
    auto flat = p.detach().reshape({-1});
    for (int64_t k = 0; k < flat.numel(); ++k) {
      want.push_back(flat[k].item<float>());
    }
  }
  for (int r = 0; r < 2; ++r) {
    const std::string line =
        rpc::testing::lineStartingWith(job[r], "params", 60000);
    ASSERT_FALSE(line.empty()) << "rank " << r << ":\n" << job.stderrOf(r);
    std::istringstream in(line.substr(6));
    std::vector<float> got;
    for (std::string tok; in >> tok;) {
      got.push_back(std::strtof(tok.c_str(), nullptr));
    }
    ASSERT_EQ(got.size(), want.size()) << "rank " << r;
    double diff = 0;
    for (size_t k = 0; k < got.size(); ++k) {
      diff = std::max(diff, static_cast<double>(std::abs(got[k] - want[k])));
    }
    EXPECT_LE(diff, kTol) << "rank " << r;
  }
  expectAllExitedZero(job);
}

TEST(DdpProcess, UnusedParameterErrorOnEveryProcess) {
  rpc::testing::Job job(DDP_WORKER_PATH, "unused", 2);
  for (int r = 0; r < 2; ++r) {
    const std::string line =
        rpc::testing::lineStartingWith(job[r], "error: ", 60000);
    EXPECT_NE(line.find("branch.weight (1 of 2 ranks), branch.bias (1 of 2 "
                        "ranks)"),
              std::string::npos)
        << "rank " << r << ": " << line << "\n"
        << job.stderrOf(r);
  }
  expectAllExitedZero(job);
}

// A rank SIGKILLed in the middle of a step (after its forward, before its
// backward): the others, waiting in their backward's allreduce, fail within
// 2 s with an error naming it, although the group's timeout is 60 s.
TEST(DdpProcess, ARankKilledMidStepFailsTheOthersNamingIt) {
  rpc::testing::Job job(DDP_WORKER_PATH, "killed", 3);
  ASSERT_FALSE(
      rpc::testing::lineStartingWith(job[2], "mid-step", 60000).empty())
      << job.stderrOf(2);
  // The others are a few steps in and block in rank 2's allreduce.
  std::this_thread::sleep_for(200ms);
  const auto killedAt = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(job[2].pid, SIGKILL), 0);
  for (int r = 0; r < 2; ++r) {
    const std::string line =
        rpc::testing::lineStartingWith(job[r], "error: ", 10000);
    const auto after = std::chrono::steady_clock::now() - killedAt;
    EXPECT_LT(after, 2s) << "rank " << r;
    EXPECT_NE(line.find("rank 2"), std::string::npos)
        << "rank " << r << ": " << line << "\n"
        << job.stderrOf(r);
  }
}

// ---- Join: uneven inputs ----

// Three ranks with 10, 7 and 3 batches of 4 rows.
constexpr int kJoinRanks = 3;
constexpr int kJoinBatches[kJoinRanks] = {10, 7, 3};
constexpr int kJoinMaxBatches = 10;

// An MLP with a buffer, so that a joined rank also shadows forward's
// buffer broadcast; sized so that tiny caps make several buckets.
struct JoinNetImpl : torch::nn::Module {
  JoinNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
    scale = register_buffer("scale", torch::ones({4}));
  }
  torch::Tensor forward(torch::Tensor x) {
    return fc2(torch::relu(fc1(x))) * scale;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(JoinNet);

struct JoinData {
  // [rank][iteration]
  std::vector<std::vector<torch::Tensor>> x, y;
};

JoinData joinData() {
  torch::manual_seed(11);
  JoinData d;
  for (int r = 0; r < kJoinRanks; ++r) {
    d.x.emplace_back();
    d.y.emplace_back();
    for (int it = 0; it < kJoinBatches[r]; ++it) {
      d.x[r].push_back(torch::randn({4, 8}));
      d.y[r].push_back(torch::randn({4, 4}));
    }
  }
  return d;
}

// One process with Join's semantics: iteration `it` averages the local
// gradients of the ranks that still have a batch, over 3 ranks
// (divideByInitialWorldSize) or over those ranks.
std::vector<torch::Tensor> joinReference(const JoinData& d,
                                         bool divideByInitialWorldSize) {
  torch::manual_seed(100);
  JoinNet reference;
  auto opt = sgd(reference->parameters());
  for (int it = 0; it < kJoinMaxBatches; ++it) {
    opt.zero_grad();
    torch::Tensor loss;
    int active = 0;
    for (int r = 0; r < kJoinRanks; ++r) {
      if (it < kJoinBatches[r]) {
        auto l = torch::mse_loss(reference(d.x[r][it]), d.y[r][it]);
        loss = loss.defined() ? loss + l : l;
        ++active;
      }
    }
    (loss / (divideByInitialWorldSize ? kJoinRanks : active)).backward();
    opt.step();
  }
  return valuesOf(*reference);
}

struct JoinCase {
  std::string name;
  Options options;
  bool divideByInitialWorldSize;
  // Registered when set: a joined rank shadows through it.
  std::function<CommHook()> hook = nullptr;
};
void PrintTo(const JoinCase& c, std::ostream* os) { *os << c.name; }

class JoinUneven : public ::testing::TestWithParam<JoinCase> {};

TEST_P(JoinUneven, FinishesAndEndsEqualToOneProcess) {
  at::set_num_threads(1);
  const JoinCase& c = GetParam();
  const JoinData d = joinData();
  const auto expected = joinReference(d, c.divideByInitialWorldSize);
  std::vector<JoinNet> nets;
  for (int r = 0; r < kJoinRanks; ++r) {
    torch::manual_seed(100 + r);  // only rank 0 starts like the reference
    nets.emplace_back();
  }
  std::vector<std::vector<torch::Tensor>> finals(kJoinRanks);
  const auto start = std::chrono::steady_clock::now();
  runRanks(kJoinRanks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    JoinNet net = nets[rank];
    DistributedDataParallel model(net, pg, c.options);
    if (c.hook) {
      model.registerCommHook(c.hook());
    }
    auto opt = sgd(net->parameters());
    Join join({&model},
              {.divideByInitialWorldSize = c.divideByInitialWorldSize});
    for (int it = 0; it < kJoinBatches[rank]; ++it) {
      opt.zero_grad();
      torch::mse_loss(model(d.x[rank][it]), d.y[rank][it]).backward();
      opt.step();
    }
    join.finish();
    finals[rank] = valuesOf(*net);
  });
  // Far below the group's 60 s timeout: nobody waited one out.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
  for (int r = 0; r < kJoinRanks; ++r) {
    EXPECT_LE(maxDiff(finals[r], expected), 1e-5) << "rank " << r;
    EXPECT_EQ(maxDiff(finals[r], finals[0]), 0) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ddp, JoinUneven,
    ::testing::Values(
        JoinCase{"initial_world_size", {}, true},
        JoinCase{"active_ranks", {}, false},
        JoinCase{"several_buckets_as_views",
                 {.bucketCapMb = 0.0005,
                  .firstBucketCapMb = 0.0001,
                  .gradientAsBucketView = true},
                 true},
        JoinCase{"several_buckets_active_ranks",
                 {.bucketCapMb = 0.0005, .firstBucketCapMb = 0.0001},
                 false},
        // A joined rank shadows the buckets through the hook.
        JoinCase{"allreduce_hook",
                 {.bucketCapMb = 0.0005, .firstBucketCapMb = 0.0001},
                 false,
                 hooks::allreduce}),
    [](const auto& info) { return info.param.name; });

TEST(Ddp, JoinThrowOnEarlyTerminationRaisesOnEveryRank) {
  at::set_num_threads(1);
  const JoinData d = joinData();
  std::vector<JoinNet> nets(kJoinRanks);
  std::vector<std::string> errors(kJoinRanks);
  std::vector<int> stoppedAt(kJoinRanks, -1);
  runRanks(kJoinRanks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    JoinNet net = nets[rank];
    DistributedDataParallel model(net, pg);
    auto opt = sgd(net->parameters());
    Join join({&model}, {.throwOnEarlyTermination = true});
    int it = 0;
    try {
      for (; it < kJoinBatches[rank]; ++it) {
        opt.zero_grad();
        torch::mse_loss(model(d.x[rank][it]), d.y[rank][it]).backward();
        opt.step();
      }
      join.finish();
    } catch (const FailedPreconditionError& e) {
      errors[rank] = e.what();
      stoppedAt[rank] = it;
    }
  });
  for (int r = 0; r < kJoinRanks; ++r) {
    EXPECT_NE(errors[r].find("throwOnEarlyTermination"), std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_EQ(errors[r], errors[0]) << "rank " << r;
    // Every rank stops at the iteration the shortest shard ends.
    EXPECT_EQ(stoppedAt[r], 3) << "rank " << r;
  }
}

// Under an enabled Join a forward that does not reduce (noSync) is refused
// before any collective, on every rank; a disabled Join lets it through.
TEST(Ddp, JoinRefusesForwardsThatDoNotReduceUnlessDisabled) {
  at::set_num_threads(1);
  for (bool enable : {true, false}) {
    std::vector<Mlp> nets(2);
    std::vector<std::string> errors(2);
    runRanks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
      Mlp net = nets[rank];
      DistributedDataParallel model(net, pg);
      Join join({&model}, {.enable = enable});
      try {
        auto guard = model.noSync();
        model(torch::ones({2, 8})).sum().backward();
      } catch (const FailedPreconditionError& e) {
        errors[rank] = e.what();
      }
      join.finish();
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(errors[r].find("noSync") != std::string::npos, enable)
          << "rank " << r << ": " << errors[r];
    }
  }
}

// A user's own per-iteration collective: the sum of every rank's loss and
// batch count, allreduced each iteration. A joined rank adds zeros.
class LossMetrics : public Joinable {
 public:
  explicit LossMetrics(std::shared_ptr<ProcessGroup> pg) : pg_(std::move(pg)) {}
  void add(double loss) {
    Join::notify(*this);
    allreduceInto(torch::tensor({loss, 1.0}, torch::kDouble));
  }
  JoinHook joinHook(const JoinOptions& /*options*/) override {
    return {[this] {
              allreduceInto(torch::zeros({2}, torch::kDouble));
              ++shadowed;
            },
            [this](bool isLastJoiner) { lastJoiner = isLastJoiner; },
            {}};
  }
  at::Device joinDevice() const override { return at::kCPU; }
  std::shared_ptr<ProcessGroup> joinProcessGroup() const override {
    return pg_;
  }

  torch::Tensor total = torch::zeros({2}, torch::kDouble);
  int shadowed = 0;
  bool lastJoiner = false;

 private:
  void allreduceInto(torch::Tensor t) {
    pg_->allreduce(t).wait();
    total += t;
  }
  std::shared_ptr<ProcessGroup> pg_;
};

TEST(Ddp, JoinWithAUserJoinableAndDdp) {
  at::set_num_threads(1);
  const JoinData d = joinData();
  const auto expected = joinReference(d, true);
  std::vector<JoinNet> nets;
  for (int r = 0; r < kJoinRanks; ++r) {
    torch::manual_seed(100 + r);
    nets.emplace_back();
  }
  std::vector<std::vector<torch::Tensor>> finals(kJoinRanks);
  std::vector<torch::Tensor> totals(kJoinRanks);
  std::vector<double> localLoss(kJoinRanks, 0);
  std::vector<int> shadowed(kJoinRanks);
  std::vector<int> last(kJoinRanks);
  runRanks(kJoinRanks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    JoinNet net = nets[rank];
    DistributedDataParallel model(net, pg);
    LossMetrics metrics(pg);
    auto opt = sgd(net->parameters());
    // The model first: its forward's notify is an iteration's first
    // collective, then its backward's, then the metrics'.
    Join join({&model, &metrics});
    for (int it = 0; it < kJoinBatches[rank]; ++it) {
      opt.zero_grad();
      auto loss = torch::mse_loss(model(d.x[rank][it]), d.y[rank][it]);
      loss.backward();
      opt.step();
      localLoss[rank] += loss.item<double>();
      metrics.add(loss.item<double>());
    }
    join.finish();
    finals[rank] = valuesOf(*net);
    totals[rank] = metrics.total;
    shadowed[rank] = metrics.shadowed;
    last[rank] = metrics.lastJoiner;
  });
  const double allLoss = localLoss[0] + localLoss[1] + localLoss[2];
  for (int r = 0; r < kJoinRanks; ++r) {
    EXPECT_LE(maxDiff(finals[r], expected), 1e-5) << "rank " << r;
    ASSERT_TRUE(totals[r].defined()) << "rank " << r;
    EXPECT_EQ(totals[r][1].item<double>(), 20) << "rank " << r;
    EXPECT_NEAR(totals[r][0].item<double>(), allLoss, 1e-9) << "rank " << r;
    EXPECT_EQ(shadowed[r], kJoinMaxBatches - kJoinBatches[r]) << "rank " << r;
    EXPECT_EQ(last[r], r == 0 ? 1 : 0) << "rank " << r;
  }
}

// ---- Communication hooks ----

struct HookCase {
  std::string name;
  std::function<CommHook()> hook;
  double tolerance;    // of the averaged gradients against the reference
  double scale = 1.0;  // the hook's result is scale * the average
  bool lossy = false;  // the result must differ from fp32's
};
void PrintTo(const HookCase& c, std::ostream* os) { *os << c.name; }

class CommHooks : public ::testing::TestWithParam<HookCase> {};

// Three ranks, several buckets (tiny caps), two backwards on the same
// parameters (the second after the rebuild): each rank's gradients within
// the hook's tolerance of one process on the whole batch, and bit for bit
// the same on every rank. Every bucket went through the hook once per
// backward, with its index, parameters and names.
TEST_P(CommHooks, GradientsMatchTheReferenceOnEveryRank) {
  at::set_num_threads(1);
  const HookCase& c = GetParam();
  constexpr int kRanks = 3;
  torch::manual_seed(7);
  const auto x = torch::randn({kBatch, 8});
  const auto y = torch::randn({kBatch, 4});
  torch::manual_seed(100);
  Mlp reference;
  torch::mse_loss(reference(x), y).backward();
  const auto refGrads = gradsOf(*reference);
  std::vector<Mlp> nets;
  for (int r = 0; r < kRanks; ++r) {
    torch::manual_seed(100 + r);
    nets.emplace_back();
  }
  std::vector<std::vector<std::vector<torch::Tensor>>> grads(kRanks);
  std::vector<std::multiset<std::string>> seenNames(kRanks);
  std::vector<std::vector<size_t>> seenIndex(kRanks);
  runRanks(kRanks, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Mlp net = nets[rank];
    DistributedDataParallel model(
        net, pg, {.bucketCapMb = 0.002, .firstBucketCapMb = 0.0001});
    CommHook inner = c.hook();
    // Records what the hook is given (one thread runs backward per rank).
    model.registerCommHook([&, inner](GradBucket& b) {
      size_t numel = 0;
      for (size_t k = 0; k < b.parameters.size(); ++k) {
        seenNames[rank].insert(b.parameterNames[k]);
        numel += b.parameters[k].numel();
      }
      EXPECT_EQ(static_cast<size_t>(b.buffer.numel()), numel);
      seenIndex[rank].push_back(b.index);
      return inner(b);
    });
    for (int it = 0; it < 2; ++it) {
      for (auto& p : net->parameters()) {
        p.mutable_grad() = torch::Tensor();
      }
      torch::mse_loss(model(shard(x, rank, kRanks)), shard(y, rank, kRanks))
          .backward();
      grads[rank].push_back(gradsOf(*net));
    }
  });
  std::vector<torch::Tensor> expected;
  for (const auto& g : refGrads) {
    expected.push_back(g * c.scale);
  }
  const size_t nParams = refGrads.size();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(grads[r].size(), 2u) << "rank " << r;
    for (int it = 0; it < 2; ++it) {
      const double diff = maxDiff(grads[r][it], expected);
      EXPECT_LE(diff, c.tolerance) << "rank " << r << " iteration " << it;
      if (c.lossy) {
        EXPECT_GT(diff, 1e-6) << "not compressed? rank " << r;
      }
      EXPECT_EQ(maxDiff(grads[r][it], grads[0][it]), 0) << "rank " << r;
    }
    // Every parameter once per backward; indices 0.. in launch order.
    EXPECT_EQ(seenNames[r].size(), 2 * nParams) << "rank " << r;
    for (const auto& item : nets[r]->named_parameters()) {
      EXPECT_EQ(seenNames[r].count(item.key()), 2u) << item.key();
    }
    const size_t perBackward = seenIndex[r].size() / 2;
    EXPECT_GT(perBackward, 1u);  // several buckets
    for (size_t k = 0; k < seenIndex[r].size(); ++k) {
      EXPECT_EQ(seenIndex[r][k], k % perBackward) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ddp, CommHooks,
    ::testing::Values(
        HookCase{"allreduce", hooks::allreduce, kTol},
        HookCase{"fp16", hooks::fp16Compress, 2e-3, 1.0, true},
        HookCase{"bf16", hooks::bf16Compress, 2e-2, 1.0, true},
        // A user hook: the bucket times 3, then the default allreduce.
        HookCase{"user_times_three",
                 [] {
                   return CommHook([](GradBucket& b) {
                     b.buffer.mul_(3);
                     return hooks::allreduce()(b);
                   });
                 },
                 3 * kTol, 3.0}),
    [](const auto& info) { return info.param.name; });

// With a hook, the unused-parameter flags travel on their own: a hook that
// changes the bucket's values (times 3, here) leaves the error intact.
TEST(Ddp, CommHookKeepsTheUnusedParameterError) {
  at::set_num_threads(1);
  std::vector<Mlp> nets;
  for (int r = 0; r < 2; ++r) {
    nets.emplace_back(/*withBranch=*/true);
  }
  std::vector<std::string> errors(2);
  runRanks(2, [&](int rank, std::shared_ptr<ProcessGroup> pg) {
    Mlp net = nets[rank];
    DistributedDataParallel model(net, pg);
    model.registerCommHook([](GradBucket& b) {
      b.buffer.mul_(3);
      return hooks::allreduce()(b);
    });
    try {
      torch::mse_loss(model(torch::ones({2, 8}), rank != 1),
                      torch::zeros({2, 4}))
          .backward();
    } catch (const FailedPreconditionError& e) {
      errors[rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("branch.weight (1 of 2 ranks)"), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
}

}  // namespace
}  // namespace trellis::ddp
