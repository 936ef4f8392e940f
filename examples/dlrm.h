#pragma once
// The dense part of the DLRM-shaped examples (header only): used by
// examples/hybrid_training.cc and by bench/hybrid_bench.cc's one-process
// baseline, so both run the same model.
#include <cstdint>

#include <torch/torch.h>

namespace trellis::examples {

// DLRM's dense part: the dense features through a bottom MLP to one more
// vector beside the tables' bag embeddings, the pairwise dot products of
// all those vectors, and a top MLP over the bottom vector and the dots.
struct DenseNetImpl : torch::nn::Module {
  DenseNetImpl(int64_t denseFeatures, int64_t tables, int64_t dim) {
    bottom = register_module(
        "bottom", torch::nn::Sequential(
                      torch::nn::Linear(denseFeatures, 32), torch::nn::ReLU(),
                      torch::nn::Linear(32, dim), torch::nn::ReLU()));
    const int64_t vectors = tables + 1;
    const int64_t pairs = vectors * (vectors - 1) / 2;
    top = register_module(
        "top",
        torch::nn::Sequential(torch::nn::Linear(dim + pairs, 64),
                              torch::nn::ReLU(), torch::nn::Linear(64, 1)));
    auto upper = torch::triu_indices(vectors, vectors, 1);
    pairRows = register_buffer("pairRows", upper[0]);
    pairCols = register_buffer("pairCols", upper[1]);
  }
  // dense [B, F], embeddings [B, T, dim] -> logits [B]
  torch::Tensor forward(torch::Tensor dense, torch::Tensor embeddings) {
    auto x = bottom->forward(dense);
    auto vectors = torch::cat({x.unsqueeze(1), embeddings}, 1);
    auto dots = torch::bmm(vectors, vectors.transpose(1, 2));
    auto pairs = dots.index({torch::indexing::Slice(), pairRows, pairCols});
    return top->forward(torch::cat({x, pairs}, 1)).squeeze(1);
  }
  torch::nn::Sequential bottom{nullptr}, top{nullptr};
  torch::Tensor pairRows, pairCols;
};
TORCH_MODULE(DenseNet);

}  // namespace trellis::examples
