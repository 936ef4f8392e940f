// DistributedDataParallel on a GPU over the nccl backend: a group of one
// rank (NCCL wants a GPU per rank, and a GPU machine here has one), so
// DDP's averaged gradients must equal plain local training's, while the
// reducer's CUDA path runs for real (flat buckets on the device, the
// reducer's device thread, NCCL allreduces, gradients as bucket views, the
// unused-parameter walk, a compression hook). Every test skips, saying
// why, where no GPU is visible or libtorch has no CUDA.
#include <chrono>
#include <cuda_runtime_api.h>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../gpu/gpu_test.h"
#include "compare.h"
#include "models.h"
#include <trellis/collectives/process_group.h>
#include <trellis/core/error.h>
#include <trellis/ddp/distributed_data_parallel.h>
#include <trellis/store/hash_store.h>

namespace trellis::ddp {
namespace {

using namespace std::chrono_literals;
using collectives::ProcessGroup;
using collectives::ProcessGroupOptions;
using testing::maxDiff;
using testing::Mlp;
using testing::valuesOf;

const torch::Device kCuda0(torch::kCUDA, 0);

std::shared_ptr<ProcessGroup> ncclGroup() {
  ProcessGroupOptions o;
  o.timeout = 60s;
  o.watchdogMode = collectives::WatchdogMode::kFail;  // never end the test
  o.flightRecorderDir = "";
  return ProcessGroup::create("nccl", std::make_shared<store::HashStore>(), 0,
                              1, o);
}

// The gradients with zeros where a parameter has none: DDP's unused
// parameters and the plain model's may differ in whether they hold a zero
// gradient or none, which this comparison does not judge.
std::vector<torch::Tensor> gradsOrZeros(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) {
    out.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  }
  return out;
}

// Four SGD steps with DDP on a one-rank nccl group against the same model
// trained plainly: gradients and parameters equal after every step (the
// average over one rank is the gradient itself; fp32 sums of one term are
// exact).
void trainAndCompare(Options options, bool useBranch, double tol,
                     bool fp16Hook = false) {
  // The branch's parameters exist only where DDP is told to expect unused
  // ones: without findUnusedParameters, a parameter without a gradient is
  // an error.
  const bool withBranch = options.findUnusedParameters;
  torch::manual_seed(7);
  Mlp reference(withBranch);
  reference->to(kCuda0);
  torch::manual_seed(7);
  Mlp net(withBranch);
  net->to(kCuda0);
  auto pg = ncclGroup();
  DistributedDataParallel model(net, pg, options);
  if (fp16Hook) {
    model.registerCommHook(hooks::fp16Compress());
  }
  torch::optim::SGD refOpt(reference->parameters(), 0.1);
  torch::optim::SGD opt(net->parameters(), 0.1);
  const auto x = torch::randn({16, 8}, kCuda0);
  const auto y = torch::randn({16, 4}, kCuda0);
  for (int it = 0; it < 4; ++it) {
    refOpt.zero_grad();
    torch::mse_loss(reference(x, useBranch), y).backward();
    opt.zero_grad();
    torch::mse_loss(model(x, useBranch), y).backward();
    for (const auto& p : net->parameters()) {
      if (p.grad().defined()) {
        EXPECT_TRUE(p.grad().is_cuda());
      }
    }
    EXPECT_LE(maxDiff(gradsOrZeros(*net), gradsOrZeros(*reference)), tol)
        << "iteration " << it;
    refOpt.step();
    opt.step();
    EXPECT_LE(maxDiff(valuesOf(*net), valuesOf(*reference)), tol)
        << "iteration " << it;
  }
}

TEST(DdpCuda, GradientsEqualLocalTraining) {
  REQUIRE_GPU();
  // Small caps: several buckets, so a later one is reduced while autograd
  // still runs.
  trainAndCompare({.bucketCapMb = 1e-3, .firstBucketCapMb = 1e-4}, false, 1e-6);
}

TEST(DdpCuda, GradientsAsBucketViews) {
  REQUIRE_GPU();
  trainAndCompare({.bucketCapMb = 1e-3,
                   .firstBucketCapMb = 1e-4,
                   .gradientAsBucketView = true},
                  false, 1e-6);
}

TEST(DdpCuda, UnusedParametersFound) {
  REQUIRE_GPU();
  trainAndCompare({.bucketCapMb = 1e-3, .findUnusedParameters = true}, false,
                  1e-6);
  trainAndCompare({.bucketCapMb = 1e-3, .findUnusedParameters = true}, true,
                  1e-6);
}

// float16 compression: the gradients at float16's precision.
TEST(DdpCuda, Fp16CompressionHook) {
  REQUIRE_GPU();
  trainAndCompare({.bucketCapMb = 1e-3}, false, 5e-3, /*fp16Hook=*/true);
}

// A module left on the CPU cannot go through an nccl group: the error
// comes at construction (the first broadcast), naming the device.
TEST(DdpCuda, CpuModuleOnAnNcclGroupIsRefused) {
  REQUIRE_GPU();
  Mlp net;
  auto pg = ncclGroup();
  try {
    DistributedDataParallel model(net, pg, {});
    ADD_FAILURE() << "DDP took CPU parameters on an nccl group";
  } catch (const trellis::Exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cpu"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace trellis::ddp
