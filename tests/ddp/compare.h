#pragma once
// Comparisons of a model's parameters and gradients that the DDP tests
// share (ddp_test, ddp_cuda_test). Header only; needs gtest.
#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace trellis::ddp::testing {

// The largest elementwise difference between two lists of tensors; an
// entry undefined in one list and not in the other is INFINITY (both
// undefined: equal).
inline double maxDiff(const std::vector<torch::Tensor>& a,
                      const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (!a[i].defined() || !b[i].defined()) {
      return a[i].defined() == b[i].defined() ? m : INFINITY;
    }
    m = std::max(m, (a[i] - b[i]).abs().max().item<double>());
  }
  return m;
}

// Copies of the module's gradients, in parameter order (undefined where a
// parameter has none).
inline std::vector<torch::Tensor> gradsOf(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) {
    out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  }
  return out;
}

// Copies of the module's parameter values, in order.
inline std::vector<torch::Tensor> valuesOf(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) {
    out.push_back(p.detach().clone());
  }
  return out;
}

}  // namespace trellis::ddp::testing
