#pragma once
// Small models shared by ddp_test and ddp_worker (header only).
#include <torch/torch.h>

namespace trellis::ddp::testing {

// 8 -> hidden -> hidden -> 4, and a `branch` head that forward adds only
// when asked (for the unused-parameter tests).
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(bool withBranch = false) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
    fc3 = register_module("fc3", torch::nn::Linear(16, 4));
    if (withBranch) {
      branch = register_module("branch", torch::nn::Linear(16, 4));
    }
  }
  torch::Tensor forward(torch::Tensor x, bool useBranch = false) {
    auto h = torch::relu(fc2(torch::relu(fc1(x))));
    auto out = fc3(h);
    if (useBranch) {
      out = out + branch(h);
    }
    return out;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, branch{nullptr};
};
TORCH_MODULE(Mlp);

// 1x8x8 images -> conv 3x3 (4 channels) -> 4 outputs.
struct CnnImpl : torch::nn::Module {
  CnnImpl() {
    conv = register_module(
        "conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)));
    fc = register_module("fc", torch::nn::Linear(4 * 6 * 6, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    return fc(torch::relu(conv(x)).flatten(1));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Cnn);

// Registers its last layer first, so that reverse registration order is
// not the order gradients become ready in.
struct ReorderedImpl : torch::nn::Module {
  ReorderedImpl() {
    out = register_module("out", torch::nn::Linear(16, 4));
    in = register_module("in", torch::nn::Linear(8, 16));
  }
  torch::Tensor forward(torch::Tensor x) { return out(torch::relu(in(x))); }
  torch::nn::Linear out{nullptr}, in{nullptr};
};
TORCH_MODULE(Reordered);

}  // namespace trellis::ddp::testing
