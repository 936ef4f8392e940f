#pragma once
// Synthetic click logs for the examples (header only): a hidden
// ground-truth model draws each sample's bags of item ids (one bag per
// table) and dense features, and labels it by a noisy logistic of its true
// logit. Since the true model is known, a trained model's held-out AUC can
// be printed next to chance (0.5) and the best achievable (the true
// logits' AUC on the same samples).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include <torch/torch.h>

namespace trellis::examples {

class ClickWorld {
 public:
  struct Options {
    int64_t tables = 1;
    int64_t rows = 100000;  // items per table
    int64_t denseFeatures = 0;
    double weightStd = 1.0;  // of the hidden item weights
    double zipf = 1.2;       // popularity exponent
    uint64_t seed = 1234;
  };

  // Popularity is Zipf-like over a random permutation of each table's ids.
  explicit ClickWorld(Options o) : o_(o) {
    std::mt19937_64 g(o.seed);
    std::normal_distribution<double> w(0.0, o.weightStd);
    for (int64_t t = 0; t < o.tables; ++t) {
      Table table;
      table.weights.resize(static_cast<size_t>(o.rows));
      for (auto& x : table.weights) {
        x = w(g);
      }
      table.itemAt.resize(static_cast<size_t>(o.rows));
      std::iota(table.itemAt.begin(), table.itemAt.end(), int64_t{0});
      std::shuffle(table.itemAt.begin(), table.itemAt.end(), g);
      tables_.push_back(std::move(table));
    }
    std::normal_distribution<double> v(0.0, 0.5);
    for (int64_t f = 0; f < o.denseFeatures; ++f) {
      denseWeights_.push_back(v(g));
    }
    cdf_.resize(static_cast<size_t>(o.rows));
    double sum = 0;
    for (int64_t k = 0; k < o.rows; ++k) {
      sum += 1.0 / std::pow(static_cast<double>(k + 1), o.zipf);
      cdf_[static_cast<size_t>(k)] = sum;
    }
    for (auto& c : cdf_) {
      c /= sum;
    }
  }

  struct Batch {
    std::vector<at::Tensor> ids;      // per table: int64 [total]
    std::vector<at::Tensor> offsets;  // per table: int64 [bags]
    at::Tensor dense;                 // float [bags, denseFeatures]
    at::Tensor labels;                // float [bags]
    at::Tensor trueLogits;            // float [bags]
  };

  // `bags` samples; each bag holds 1 to 20 items.
  Batch draw(std::mt19937_64& g, int64_t bags) const {
    std::uniform_int_distribution<int> len(1, 20);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::normal_distribution<double> noise(0.0, 0.3);
    std::normal_distribution<double> feature(0.0, 1.0);
    const auto nt = static_cast<size_t>(o_.tables);
    std::vector<std::vector<int64_t>> ids(nt), offsets(nt);
    std::vector<float> dense, labels, logits;
    for (int64_t b = 0; b < bags; ++b) {
      double z = 0;
      for (size_t t = 0; t < nt; ++t) {
        offsets[t].push_back(static_cast<int64_t>(ids[t].size()));
        const int n = len(g);
        for (int i = 0; i < n; ++i) {
          const auto k =
              std::lower_bound(cdf_.begin(), cdf_.end(), u(g)) - cdf_.begin();
          const int64_t item = tables_[t].itemAt[std::min<size_t>(
              static_cast<size_t>(k), tables_[t].itemAt.size() - 1)];
          ids[t].push_back(item);
          z += tables_[t].weights[static_cast<size_t>(item)];
        }
      }
      for (double v : denseWeights_) {
        const double x = feature(g);
        dense.push_back(static_cast<float>(x));
        z += v * x;
      }
      logits.push_back(static_cast<float>(z));
      const double p = 1.0 / (1.0 + std::exp(-(z + noise(g))));
      labels.push_back(u(g) < p ? 1.0f : 0.0f);
    }
    auto i64 = torch::TensorOptions().dtype(torch::kInt64);
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    Batch out;
    for (size_t t = 0; t < nt; ++t) {
      const auto total = static_cast<int64_t>(ids[t].size());
      out.ids.push_back(torch::from_blob(ids[t].data(), {total}, i64).clone());
      out.offsets.push_back(
          torch::from_blob(offsets[t].data(), {bags}, i64).clone());
    }
    out.dense =
        torch::from_blob(dense.data(), {bags, o_.denseFeatures}, f32).clone();
    out.labels = torch::from_blob(labels.data(), {bags}, f32).clone();
    out.trueLogits = torch::from_blob(logits.data(), {bags}, f32).clone();
    return out;
  }

 private:
  struct Table {
    std::vector<double> weights;
    std::vector<int64_t> itemAt;
  };
  Options o_;
  std::vector<Table> tables_;
  std::vector<double> denseWeights_;
  std::vector<double> cdf_;
};

// Area under the ROC curve by the rank-sum formula (ties averaged); 0.5
// when one class is absent.
inline double auc(const at::Tensor& scores, const at::Tensor& labels) {
  auto s = scores.to(torch::kFloat32).contiguous();
  auto l = labels.to(torch::kFloat32).contiguous();
  const int64_t n = s.size(0);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  const float* sp = s.data_ptr<float>();
  const float* lp = l.data_ptr<float>();
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return sp[a] < sp[b]; });
  double rankSumPos = 0;
  int64_t pos = 0;
  for (int64_t i = 0; i < n;) {
    int64_t j = i;
    while (j < n && sp[order[j]] == sp[order[i]]) {
      ++j;
    }
    const double avgRank = (static_cast<double>(i + j - 1) / 2.0) + 1.0;
    for (int64_t k = i; k < j; ++k) {
      if (lp[order[k]] > 0.5f) {
        rankSumPos += avgRank;
        ++pos;
      }
    }
    i = j;
  }
  const int64_t neg = n - pos;
  if (pos == 0 || neg == 0) {
    return 0.5;
  }
  return (rankSumPos - static_cast<double>(pos) * (pos + 1) / 2.0) /
         (static_cast<double>(pos) * static_cast<double>(neg));
}

}  // namespace trellis::examples
