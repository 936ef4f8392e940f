// A parameter-server training job (docs/examples.md): rank 0 is "ps" and
// holds an embedding table (100,000 x 64, sum-mode bags) and a small dense
// net; ranks 1..N-1 are trainers. Each step a trainer looks up its batch's
// bags through an RRef method call, pulls the dense weights, runs forward
// and backward locally, and pushes the embedding-row gradients and the
// dense gradients back; the server applies them (Adagrad, sparse for the
// table) under a mutex. Data are synthetic, drawn from a hidden
// ground-truth model, so the final AUC can be compared with both chance and
// the best achievable.
//
//   trellis-launch --nproc 3 -- parameter_server --steps 800 --batch 128

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <trellis/core/error.h>
#include <trellis/rpc/rpc.h>
#include <trellis/rref/rref.h>

namespace rpc = trellis::rpc;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kHidden = 32;

// The dense part, the same on the server and on every trainer.
torch::nn::Sequential makeDense(int64_t dim) {
  return torch::nn::Sequential(torch::nn::Linear(dim, kHidden),
                               torch::nn::ReLU(),
                               torch::nn::Linear(kHidden, 1));
}

std::atomic<int64_t> gUpdates{0};
std::atomic<int64_t> gRowsUpdated{0};

}  // namespace

// Lives on the ps. Every trainer holds an RRef to it; it is freed when the
// last one is released.
class EmbeddingServer {
 public:
  EmbeddingServer(int64_t rows, int64_t dim, double lr, uint64_t seed)
      : lr_(lr),
        table_(torch::nn::EmbeddingBagOptions(rows, dim).mode(torch::kSum)),
        dense_(makeDense(dim)) {
    torch::manual_seed(seed);
    torch::NoGradGuard noGrad;
    table_->weight.normal_(0.0, 0.05);
    for (auto& p : dense_->parameters()) {
      p.requires_grad_(false);
    }
    table_->weight.requires_grad_(false);
    tableAccum_ = torch::full_like(table_->weight, 0.1);
    for (const auto& p : dense_->parameters()) {
      denseAccum_.push_back(torch::full_like(p, 0.1));
    }
  }

  // Sum of each bag's rows: [bags, dim].
  at::Tensor lookup(const at::Tensor& ids, const at::Tensor& offsets) {
    std::lock_guard<std::mutex> lock(mu_);
    return table_(ids, offsets);
  }

  std::vector<at::Tensor> denseWeights() {
    std::vector<at::Tensor> out;
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& p : dense_->parameters()) {
      out.push_back(p.clone());
    }
    return out;
  }

  // rowGrads[i] is the gradient of ids[i]'s row (repeats allowed; they are
  // summed). Returns the number of updates applied so far.
  int64_t pushGradients(const at::Tensor& ids, const at::Tensor& rowGrads,
                        const std::vector<at::Tensor>& denseGrads) {
    TORCH_CHECK(ids.dim() == 1 && rowGrads.dim() == 2 &&
                    rowGrads.size(0) == ids.size(0),
                "pushGradients: ids and rowGrads do not match");
    auto [rows, inverse] = at::_unique(ids, /*sorted=*/false,
                                       /*return_inverse=*/true);
    torch::NoGradGuard noGrad;
    auto grad = torch::zeros({rows.size(0), rowGrads.size(1)})
                    .index_add_(0, inverse, rowGrads);
    std::lock_guard<std::mutex> lock(mu_);
    auto params = dense_->parameters();
    TORCH_CHECK(denseGrads.size() == params.size(), "pushGradients: expected ",
                params.size(), " dense gradients, got ", denseGrads.size());
    // Sparse Adagrad: only the touched rows and their accumulators move.
    auto acc = tableAccum_.index_select(0, rows).add_(grad.square());
    tableAccum_.index_copy_(0, rows, acc);
    table_->weight.index_add_(0, rows, grad.div(acc.sqrt()).mul_(-lr_));
    for (size_t i = 0; i < params.size(); ++i) {
      denseAccum_[i].add_(denseGrads[i].square());
      params[i].sub_(denseGrads[i].div(denseAccum_[i].sqrt()).mul_(lr_));
    }
    gRowsUpdated += rows.size(0);
    return ++gUpdates;
  }

 private:
  std::mutex mu_;
  double lr_;
  torch::nn::EmbeddingBag table_;
  torch::nn::Sequential dense_;
  at::Tensor tableAccum_;
  std::vector<at::Tensor> denseAccum_;
};

namespace {

std::mutex gServerMu;
std::weak_ptr<EmbeddingServer> gServer;

}  // namespace

// Every trainer calls remote<makeServer>("ps", ...): the first call builds
// the server, later ones share it, so each trainer's RRef keeps the same
// object alive and no trainer has to wait for another.
std::shared_ptr<EmbeddingServer> makeServer(int64_t rows, int64_t dim,
                                            double lr, int64_t seed) {
  std::lock_guard<std::mutex> lock(gServerMu);
  auto s = gServer.lock();
  if (s == nullptr) {
    s = std::make_shared<EmbeddingServer>(rows, dim, lr,
                                          static_cast<uint64_t>(seed));
    gServer = s;
  }
  return s;
}

TRELLIS_REMOTE_FUNCTION(makeServer);
TRELLIS_REMOTE_METHODS(EmbeddingServer, lookup, denseWeights, pushGradients);

namespace {

// The hidden model the data come from: a weight per item; an item's
// popularity is Zipf-like over a random permutation of the ids.
class World {
 public:
  World(int64_t items, double weightStd, double zipf, uint64_t seed)
      : weights_(items), itemAt_(items) {
    std::mt19937_64 g(seed);
    std::normal_distribution<double> w(0.0, weightStd);
    for (auto& x : weights_) {
      x = w(g);
    }
    std::iota(itemAt_.begin(), itemAt_.end(), int64_t{0});
    std::shuffle(itemAt_.begin(), itemAt_.end(), g);
    cdf_.resize(items);
    double sum = 0;
    for (int64_t k = 0; k < items; ++k) {
      sum += 1.0 / std::pow(static_cast<double>(k + 1), zipf);
      cdf_[k] = sum;
    }
    for (auto& c : cdf_) {
      c /= sum;
    }
  }

  struct Batch {
    at::Tensor ids;      // int64 [total]
    at::Tensor offsets;  // int64 [bags]
    at::Tensor bagOf;    // int64 [total]: the bag of each id
    at::Tensor labels;   // float [bags]
    at::Tensor trueLogits;
  };

  Batch draw(std::mt19937_64& g, int64_t bags) const {
    std::uniform_int_distribution<int> len(1, 20);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::normal_distribution<double> noise(0.0, 0.3);
    std::vector<int64_t> ids, offsets, bagOf;
    std::vector<float> labels, logits;
    for (int64_t b = 0; b < bags; ++b) {
      offsets.push_back(static_cast<int64_t>(ids.size()));
      const int n = len(g);
      double z = 0;
      for (int i = 0; i < n; ++i) {
        const auto k =
            std::lower_bound(cdf_.begin(), cdf_.end(), u(g)) - cdf_.begin();
        const int64_t item = itemAt_[std::min<size_t>(k, itemAt_.size() - 1)];
        ids.push_back(item);
        bagOf.push_back(b);
        z += weights_[item];
      }
      logits.push_back(static_cast<float>(z));
      const double p = 1.0 / (1.0 + std::exp(-(z + noise(g))));
      labels.push_back(u(g) < p ? 1.0f : 0.0f);
    }
    auto i64 = torch::TensorOptions().dtype(torch::kInt64);
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    const auto total = static_cast<int64_t>(ids.size());
    return Batch{torch::from_blob(ids.data(), {total}, i64).clone(),
                 torch::from_blob(offsets.data(), {bags}, i64).clone(),
                 torch::from_blob(bagOf.data(), {total}, i64).clone(),
                 torch::from_blob(labels.data(), {bags}, f32).clone(),
                 torch::from_blob(logits.data(), {bags}, f32).clone()};
  }

 private:
  std::vector<double> weights_;
  std::vector<int64_t> itemAt_;
  std::vector<double> cdf_;
};

// Area under the ROC curve by the rank-sum formula (ties averaged).
double auc(const at::Tensor& scores, const at::Tensor& labels) {
  auto s = scores.contiguous();
  auto l = labels.contiguous();
  const int64_t n = s.size(0);
  std::vector<int64_t> order(n);
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

struct Flags {
  int64_t steps = 800;
  int64_t batch = 128;
  int64_t logEvery = 100;
  int64_t evalSamples = 8192;
  int64_t rows = 100000;
  int64_t dim = 64;
  double lr = 0.5;
  double weightStd = 1.0;
  double zipf = 1.2;
  int64_t seed = 1234;
};

void copyWeights(torch::nn::Sequential& model,
                 const std::vector<at::Tensor>& weights) {
  torch::NoGradGuard noGrad;
  auto params = model->parameters();
  TORCH_CHECK(params.size() == weights.size(), "dense weights: expected ",
              params.size(), " tensors, got ", weights.size());
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].copy_(weights[i]);
  }
}

int runTrainer(const Flags& f, int32_t rank) {
  const std::string me = "trainer" + std::to_string(rank);
  const World world(f.rows, f.weightStd, f.zipf, static_cast<uint64_t>(f.seed));
  std::mt19937_64 data(static_cast<uint64_t>(f.seed) * 7919 +
                       static_cast<uint64_t>(rank));
  auto server = rpc::remote<makeServer>("ps", f.rows, f.dim, f.lr, f.seed);
  auto model = makeDense(f.dim);

  auto start = Clock::now();
  auto windowStart = start;
  double windowLoss = 0;
  int64_t windowSteps = 0;
  for (int64_t step = 1; step <= f.steps; ++step) {
    auto batch = world.draw(data, f.batch);
    // Both requests are in flight at once.
    auto embF =
        server.rpcAsync<&EmbeddingServer::lookup>(batch.ids, batch.offsets);
    auto denseF = server.rpcAsync<&EmbeddingServer::denseWeights>();
    copyWeights(model, denseF.wait());
    at::Tensor emb = embF.wait().detach().requires_grad_(true);
    for (auto& p : model->parameters()) {
      p.mutable_grad() = at::Tensor();
    }
    auto logits = model->forward(emb).squeeze(1);
    auto loss = torch::binary_cross_entropy_with_logits(logits, batch.labels);
    loss.backward();
    std::vector<at::Tensor> denseGrads;
    for (const auto& p : model->parameters()) {
      denseGrads.push_back(p.grad());
    }
    // In sum mode every id of a bag gets that bag's gradient.
    at::Tensor rowGrads = emb.grad().index_select(0, batch.bagOf);
    server.rpcSync<&EmbeddingServer::pushGradients>(batch.ids, rowGrads,
                                                    denseGrads);
    windowLoss += loss.item<double>();
    ++windowSteps;
    if (step % f.logEvery == 0 || step == f.steps) {
      const auto now = Clock::now();
      const double secs =
          std::chrono::duration<double>(now - windowStart).count();
      std::printf("%s step %4lld/%lld  loss %.4f  samples/s %.0f\n", me.c_str(),
                  static_cast<long long>(step), static_cast<long long>(f.steps),
                  windowLoss / windowSteps,
                  static_cast<double>(windowSteps * f.batch) / secs);
      std::fflush(stdout);
      windowStart = now;
      windowLoss = 0;
      windowSteps = 0;
    }
  }
  const double trainSecs =
      std::chrono::duration<double>(Clock::now() - start).count();

  // Held-out data: another stream from the same hidden model, evaluated
  // with the final server state.
  std::mt19937_64 heldOut(static_cast<uint64_t>(f.seed) * 104729 +
                          static_cast<uint64_t>(rank));
  copyWeights(model, server.rpcSync<&EmbeddingServer::denseWeights>());
  std::vector<at::Tensor> scores, labels, oracle;
  torch::NoGradGuard noGrad;
  for (int64_t done = 0; done < f.evalSamples; done += 1024) {
    const int64_t n = std::min<int64_t>(1024, f.evalSamples - done);
    auto b = world.draw(heldOut, n);
    auto emb = server.rpcSync<&EmbeddingServer::lookup>(b.ids, b.offsets);
    scores.push_back(model->forward(emb).squeeze(1));
    labels.push_back(b.labels);
    oracle.push_back(b.trueLogits);
  }
  auto s = torch::cat(scores);
  auto l = torch::cat(labels);
  const double positives = l.mean().item<double>();
  const double accuracy = (s.gt(0).to(torch::kFloat32) == l)
                              .to(torch::kFloat32)
                              .mean()
                              .item<double>();
  std::printf(
      "%s held-out (%lld samples): AUC %.4f (chance 0.5000, hidden-model "
      "ceiling %.4f), accuracy %.4f (majority class %.4f); trained %lld "
      "steps in %.1f s\n",
      me.c_str(), static_cast<long long>(f.evalSamples), auc(s, l),
      auc(torch::cat(oracle), l), accuracy,
      std::max(positives, 1.0 - positives), static_cast<long long>(f.steps),
      trainSecs);
  std::fflush(stdout);
  return auc(s, l) >= 0.75 ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Trellis parameter-server example (run under trellis-launch)"};
  Flags f;
  app.add_option("--steps", f.steps, "training steps per trainer")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", f.batch, "bags per step")
      ->check(CLI::PositiveNumber);
  app.add_option("--log-every", f.logEvery, "print progress every N steps")
      ->check(CLI::PositiveNumber);
  app.add_option("--eval-samples", f.evalSamples, "held-out samples")
      ->check(CLI::PositiveNumber);
  app.add_option("--rows", f.rows, "embedding table rows (items)")
      ->check(CLI::PositiveNumber);
  app.add_option("--dim", f.dim, "embedding dimension")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", f.lr, "Adagrad learning rate");
  app.add_option("--seed", f.seed, "seed of the hidden model and the data");
  app.add_option("--weight-std", f.weightStd,
                 "hidden model: standard deviation of the item weights");
  app.add_option("--zipf", f.zipf, "hidden model: popularity exponent");
  CLI11_PARSE(app, argc, argv);

  const char* rankEnv = std::getenv("RANK");
  const char* worldEnv = std::getenv("WORLD_SIZE");
  if (rankEnv == nullptr || worldEnv == nullptr) {
    std::fprintf(stderr,
                 "parameter_server: RANK and WORLD_SIZE are not set; start "
                 "it with trellis-launch --nproc 3 -- %s\n",
                 argv[0]);
    return 2;
  }
  const int32_t rank = std::atoi(rankEnv);
  const int32_t worldSize = std::atoi(worldEnv);
  if (worldSize < 2) {
    std::fprintf(stderr, "parameter_server: needs at least 2 processes\n");
    return 2;
  }
  // Two cores are shared by every process of the job.
  torch::set_num_threads(1);

  int rc = 0;
  try {
    const auto t0 = Clock::now();
    rpc::init(rank == 0 ? "ps" : "trainer" + std::to_string(rank), rank,
              worldSize);
    if (rank != 0) {
      rc = runTrainer(f, rank);
    }
    // The ps serves until every trainer is done: graceful shutdown is a
    // barrier across the group, so its bound covers the whole run.
    rpc::shutdown(true, rank == 0 ? std::chrono::seconds(3600)
                                  : std::chrono::seconds(120));
    if (rank == 0) {
      std::printf("ps: applied %lld updates (%lld embedding rows) in %.1f s\n",
                  static_cast<long long>(gUpdates.load()),
                  static_cast<long long>(gRowsUpdated.load()),
                  std::chrono::duration<double>(Clock::now() - t0).count());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parameter_server rank %d: %s\n", rank, e.what());
    return 1;
  }
  return rc;
}
