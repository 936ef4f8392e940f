// A small CNN trained with DistributedDataParallel on Fashion-MNIST
// (docs/examples.md): Debian's dataset-fashion-mnist package (gzipped idx
// files), read by a bounds-checked idx reader into a libtorch Dataset,
// loaded by libtorch's DataLoader through a distributed sampler (each rank
// its own shard, reshuffled every epoch from --seed); the shards may be
// uneven (--train-limit 6001 --batch-size 50 gives 61 and 60 batches) and
// Join lets the rank that runs out first shadow the others. The batch norm
// layers are SyncBatchNorms (convertSyncBatchNorm), Joinable too.
//
//   elastic-run --standalone --nproc-per-node 2 ddp_fashion_mnist
//       --epochs 2 --train-limit 6001 --batch-size 50 --test-limit 1000
//
// Rank 0 prints, per epoch, the mean training loss over every rank's
// images, the images per second of the whole job and the test accuracy,
// and at the end the accuracy next to published Fashion-MNIST results.

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>
#include <zlib.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "cli_checks.h"
#include <trellis/trellis.h>

using Clock = std::chrono::steady_clock;

namespace {

// ---- idx files (http://yann.lecun.com/exdb/mnist/, "FILE FORMATS") ----
//
// A file is untrusted input: every length is checked before it is used,
// and a short, long or malformed file is an error naming it.

constexpr size_t kMaxFileBytes = 64 << 20;  // 60,000 images are 47 MB

// zlib's message, without the path it starts with.
std::string zlibError(gzFile f, const std::string& path) {
  int code = 0;
  std::string what = gzerror(f, &code);
  if (what.rfind(path + ": ", 0) == 0) {
    what.erase(0, path.size() + 2);
  }
  return what;
}

// The whole file, gunzipped (zlib reads an uncompressed file as is).
std::vector<uint8_t> readFile(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) {
    throw std::runtime_error(path + ": cannot open (" + std::strerror(errno) +
                             ")");
  }
  std::vector<uint8_t> bytes;
  std::array<uint8_t, 1 << 16> chunk{};
  for (;;) {
    const int n = gzread(f, chunk.data(), chunk.size());
    if (n < 0) {
      const std::string what = zlibError(f, path);
      gzclose(f);
      throw std::runtime_error(path + ": corrupt or truncated (" + what + ")");
    }
    if (n == 0) {
      break;
    }
    if (bytes.size() + static_cast<size_t>(n) > kMaxFileBytes) {
      gzclose(f);
      throw std::runtime_error(path + ": larger than " +
                               std::to_string(kMaxFileBytes) +
                               " bytes uncompressed; not an idx file of "
                               "Fashion-MNIST");
    }
    bytes.insert(bytes.end(), chunk.begin(), chunk.begin() + n);
  }
  // gzread returns 0 both at the end and on a gzip stream cut short.
  int code = 0;
  gzerror(f, &code);
  const std::string what = zlibError(f, path);
  gzclose(f);
  if (code != Z_OK && code != Z_STREAM_END) {
    throw std::runtime_error(path + ": corrupt or truncated (" + what + ")");
  }
  return bytes;
}

uint32_t bigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) |
         (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// An idx file of unsigned bytes with `dims` dimensions: its sizes and data.
struct Idx {
  std::vector<int64_t> sizes;
  std::vector<uint8_t> bytes;  // the file; data from `offset`
  size_t offset = 0;
};

Idx readIdx(const std::string& path, size_t dims) {
  Idx idx;
  idx.bytes = readFile(path);
  const auto& b = idx.bytes;
  if (b.size() < 4) {
    throw std::runtime_error(path + ": truncated (" + std::to_string(b.size()) +
                             " bytes, shorter than an idx header)");
  }
  if (b[0] != 0 || b[1] != 0 || b[2] != 0x08 || b[3] != dims) {
    char magic[32];
    std::snprintf(magic, sizeof magic, "%02x %02x %02x %02x", b[0], b[1], b[2],
                  b[3]);
    throw std::runtime_error(
        path + ": not an idx file of unsigned bytes with " +
        std::to_string(dims) + " dimensions (magic " + magic +
        ", expected 00 00 08 0" + std::to_string(dims) + ")");
  }
  idx.offset = 4 + 4 * dims;
  if (b.size() < idx.offset) {
    throw std::runtime_error(path + ": truncated inside its header");
  }
  uint64_t total = 1;
  for (size_t d = 0; d < dims; ++d) {
    const uint32_t n = bigEndian32(&b[4 + 4 * d]);
    total *= n;  // at most 3 factors below 2^32 each: checked below
    if (n == 0 || total > kMaxFileBytes) {
      throw std::runtime_error(path + ": dimension " + std::to_string(d) +
                               " is " + std::to_string(n) +
                               ", which makes no Fashion-MNIST file");
    }
    idx.sizes.push_back(n);
  }
  const uint64_t have = b.size() - idx.offset;
  if (have != total) {
    throw std::runtime_error(
        path + (have < total ? ": truncated" : ": has trailing bytes") +
        " (its header promises " + std::to_string(total) +
        " bytes of data, the file has " + std::to_string(have) + ")");
  }
  return idx;
}

// ---- The dataset, as a libtorch Dataset ----

class FashionMnist : public torch::data::datasets::Dataset<FashionMnist> {
 public:
  // split: "train" or "t10k". At most `limit` examples (0: all).
  FashionMnist(const std::string& dir, const std::string& split,
               int64_t limit) {
    const std::string images = dir + "/" + split + "-images-idx3-ubyte.gz";
    const std::string labels = dir + "/" + split + "-labels-idx1-ubyte.gz";
    Idx im = readIdx(images, 3);
    Idx lb = readIdx(labels, 1);
    if (im.sizes[1] != 28 || im.sizes[2] != 28) {
      throw std::runtime_error(
          images + ": images are " + std::to_string(im.sizes[1]) + "x" +
          std::to_string(im.sizes[2]) + ", Fashion-MNIST's are 28x28");
    }
    if (lb.sizes[0] != im.sizes[0]) {
      throw std::runtime_error(labels + ": " + std::to_string(lb.sizes[0]) +
                               " labels for " + std::to_string(im.sizes[0]) +
                               " images in " + images);
    }
    const int64_t n =
        limit > 0 ? std::min<int64_t>(limit, im.sizes[0]) : im.sizes[0];
    for (int64_t i = 0; i < n; ++i) {
      if (lb.bytes[lb.offset + i] > 9) {
        throw std::runtime_error(
            labels + ": label " + std::to_string(lb.bytes[lb.offset + i]) +
            " at index " + std::to_string(i) + " (classes are 0-9)");
      }
    }
    // Normalized with the training set's mean and standard deviation.
    images_ = torch::from_blob(im.bytes.data() + im.offset, {n, 1, 28, 28},
                               torch::kUInt8)
                  .to(torch::kFloat)
                  .div_(255)
                  .sub_(0.2860)
                  .div_(0.3530);
    labels_ = torch::from_blob(lb.bytes.data() + lb.offset, {n}, torch::kUInt8)
                  .to(torch::kLong);
  }

  torch::data::Example<> get(size_t index) override {
    return {images_[static_cast<int64_t>(index)],
            labels_[static_cast<int64_t>(index)]};
  }
  torch::optional<size_t> size() const override {
    return static_cast<size_t>(images_.size(0));
  }

 private:
  torch::Tensor images_, labels_;
};

// ---- A distributed sampler ----
//
// Every rank draws the same permutation of all indices (seed + epoch) and
// takes every worldSize-th from position `rank`: disjoint shards covering
// the data once, sizes differing by at most one, so the ranks' batch
// counts may differ by one. (libtorch's DistributedRandomSampler drops or
// duplicates to make the shards equal, and seeds with the epoch only.)
class ShardSampler : public torch::data::samplers::Sampler<> {
 public:
  ShardSampler(size_t size, int rank, int worldSize, bool shuffle,
               uint64_t seed, uint64_t epoch) {
    std::vector<size_t> all(size);
    std::iota(all.begin(), all.end(), size_t{0});
    if (shuffle) {
      std::mt19937_64 rng(seed * 1000003 + epoch);
      std::shuffle(all.begin(), all.end(), rng);
    }
    for (size_t i = static_cast<size_t>(rank); i < size;
         i += static_cast<size_t>(worldSize)) {
      indices_.push_back(all[i]);
    }
  }
  void reset(torch::optional<size_t> /*newSize*/ = torch::nullopt) override {
    next_ = 0;
  }
  torch::optional<std::vector<size_t>> next(size_t batchSize) override {
    if (next_ >= indices_.size()) {
      return torch::nullopt;
    }
    const size_t end = std::min(indices_.size(), next_ + batchSize);
    std::vector<size_t> batch(indices_.begin() + next_, indices_.begin() + end);
    next_ = end;
    return batch;
  }
  void save(torch::serialize::OutputArchive& /*archive*/) const override {}
  void load(torch::serialize::InputArchive& /*archive*/) override {}
  size_t size() const { return indices_.size(); }

 private:
  std::vector<size_t> indices_;
  size_t next_ = 0;
};

// ---- The model: 2 conv + batch norm + pooling, 2 FC (~36k parameters) ----

torch::nn::Sequential makeNet() {
  namespace nn = torch::nn;
  return nn::Sequential(
      nn::Conv2d(nn::Conv2dOptions(1, 16, 5)),            // 16x24x24
      nn::BatchNorm2d(16), nn::ReLU(), nn::MaxPool2d(2),  // 16x12x12
      nn::Conv2d(nn::Conv2dOptions(16, 32, 5)),           // 32x8x8
      nn::BatchNorm2d(32), nn::ReLU(), nn::MaxPool2d(2),  // 32x4x4
      nn::Flatten(), nn::Linear(32 * 4 * 4, 64), nn::ReLU(),
      nn::Linear(64, 10));
}

// Sums `values` over the ranks (float64).
std::vector<double> sumOverRanks(trellis::collectives::ProcessGroup& pg,
                                 const std::vector<double>& values) {
  auto t = torch::tensor(values, torch::kDouble);
  pg.allreduce(t).wait();
  return std::vector<double>(t.data_ptr<double>(),
                             t.data_ptr<double>() + t.numel());
}

// Correct predictions and examples of this rank's shard of the test set.
std::pair<double, double> evaluate(torch::nn::Sequential& net,
                                   FashionMnist test, int rank, int worldSize,
                                   int64_t batchSize) {
  torch::NoGradGuard noGrad;
  net->eval();
  ShardSampler sampler(*test.size(), rank, worldSize, /*shuffle=*/false, 0, 0);
  auto loader = torch::data::make_data_loader(
      test.map(torch::data::transforms::Stack<>()), std::move(sampler),
      torch::data::DataLoaderOptions().batch_size(batchSize));
  double correct = 0;
  double total = 0;
  for (auto& batch : *loader) {
    auto predicted = net->forward(batch.data).argmax(1);
    correct += predicted.eq(batch.target).sum().item<double>();
    total += static_cast<double>(batch.target.size(0));
  }
  net->train();
  return {correct, total};
}

struct Baseline {
  const char* model;
  double accuracy;
};

// Test accuracies of comparable models trained on all 60,000 images,
// from the benchmark table of the dataset authors' README
// (zalandoresearch/fashion-mnist, shipped as
// /usr/share/doc/dataset-fashion-mnist/README.md.gz, "Benchmark"; as the
// README says, the submitted figures are not re-tested by its authors).
constexpr Baseline kBaselines[] = {
    {"MLP 256-128-100", 0.8833},
    {"2 Conv+pooling (Kashif Rasul)", 0.876},
    {"2 Conv+pooling+ELU (PyTorch)", 0.903},
    {"3 Conv+pooling+BN", 0.903},
    {"2 Conv+pooling (TensorFlow tutorial, benchmark/convnet.py)", 0.916},
    {"2 Conv+pooling+BN", 0.934},
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Trains a small CNN with DistributedDataParallel on Fashion-MNIST; run "
      "under elastic-run"};
  int epochs = 2;
  int64_t batchSize = 64;
  int64_t trainLimit = 0;
  int64_t testLimit = 0;
  std::string dataDir = "/usr/share/datasets/fashion-mnist";
  uint64_t seed = 1;
  double lr = 0.05;
  bool syncBn = true;
  app.add_option("--epochs", epochs, "passes over the training set")
      ->check(trellis::examples::wholeNumberFrom(1));
  app.add_option("--batch-size", batchSize, "images per rank per step")
      ->check(trellis::examples::wholeNumberFrom(1));
  app.add_option("--train-limit", trainLimit,
                 "use the first N training images (0: all 60,000)")
      ->check(trellis::examples::wholeNumberFrom(0));
  app.add_option("--test-limit", testLimit,
                 "use the first N test images (0: all 10,000)")
      ->check(trellis::examples::wholeNumberFrom(0));
  app.add_option("--data-dir", dataDir,
                 "the idx files (Debian package dataset-fashion-mnist)");
  app.add_option("--seed", seed, "initial weights and shuffling");
  app.add_option("--lr", lr,
                 "SGD learning rate (momentum 0.9), at the start; a cosine "
                 "takes it to 0 at the end")
      ->check(trellis::examples::positiveReal());
  app.add_flag("!--no-sync-bn", syncBn,
               "plain BatchNorm (per-rank statistics) instead of "
               "SyncBatchNorm");
  CLI11_PARSE(app, argc, argv);

  // Every rank in job.group(); an exception that escapes main is written
  // to the launcher's error file (job.h).
  auto job = trellis::init();
  // One intra-op thread per core this process may use.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  at::set_num_threads(static_cast<int>(
      std::max<unsigned>(1, cores / std::max(1, job.env().localWorldSize))));
  {
    const auto& pg = job.group();
    const int rank = pg->rank();
    const int worldSize = pg->size();
    std::vector<int> all(static_cast<size_t>(worldSize));
    std::iota(all.begin(), all.end(), 0);
    // SyncBatchNorm's own group: under Join its collectives cannot share
    // DDP's (docs/ddp.md, "SyncBatchNorm").
    auto bnGroup = pg->newGroup(all);

    FashionMnist train(dataDir, "train", trainLimit);
    FashionMnist test(dataDir, "t10k", testLimit);

    torch::manual_seed(seed);
    auto net = makeNet();
    if (syncBn) {
      trellis::ddp::convertSyncBatchNorm(net.ptr(), bnGroup);
    }
    // SyncBatchNorm keeps the running statistics equal on every rank: no
    // buffer broadcast before each forward.
    trellis::ddp::DistributedDataParallel model(net, pg,
                                                {.broadcastBuffers = !syncBn});
    std::optional<trellis::ddp::SyncBatchNormJoinable> bns;
    if (syncBn) {
      bns.emplace(*net);
    }
    torch::optim::SGD opt(net->parameters(),
                          torch::optim::SGDOptions(lr).momentum(0.9));

    if (rank == 0) {
      std::printf(
          "ddp_fashion_mnist: %d ranks, %zu training and %zu test images, "
          "batch %lld per rank, %s\n",
          worldSize, *train.size(), *test.size(),
          static_cast<long long>(batchSize),
          syncBn ? "SyncBatchNorm" : "BatchNorm");
      std::fflush(stdout);
    }
    // The learning rate follows a cosine from --lr to 0 over the run, step
    // by step (the same on every rank: the steps are counted from the
    // largest shard): the end of a short run then settles instead of
    // bouncing between epochs.
    const auto largestShard =
        (static_cast<int64_t>(*train.size()) + worldSize - 1) / worldSize;
    const int64_t totalSteps =
        epochs * ((largestShard + batchSize - 1) / batchSize);
    int64_t step = 0;
    const double pi = std::acos(-1.0);
    double accuracy = 0;
    for (int epoch = 1; epoch <= epochs; ++epoch) {
      ShardSampler sampler(*train.size(), rank, worldSize, /*shuffle=*/true,
                           seed, static_cast<uint64_t>(epoch));
      const size_t shard = sampler.size();
      auto loader = torch::data::make_data_loader(
          train.map(torch::data::transforms::Stack<>()), std::move(sampler),
          torch::data::DataLoaderOptions().batch_size(batchSize));
      std::vector<trellis::ddp::Joinable*> joinables{&model};
      if (bns) {
        joinables.push_back(&*bns);
      }
      const auto start = Clock::now();
      double lossSum = 0;
      double batches = 0;
      {
        trellis::ddp::Join join(joinables);
        for (auto& batch : *loader) {
          for (auto& group : opt.param_groups()) {
            static_cast<torch::optim::SGDOptions&>(group.options())
                .lr(lr * 0.5 *
                    (1 + std::cos(pi * static_cast<double>(step) /
                                  static_cast<double>(totalSteps))));
          }
          ++step;
          opt.zero_grad();
          auto loss = torch::nn::functional::cross_entropy(model(batch.data),
                                                           batch.target);
          loss.backward();
          opt.step();
          lossSum +=
              loss.item<double>() * static_cast<double>(batch.target.size(0));
          ++batches;
        }
        join.finish();  // shadows the ranks with more batches
      }
      const double seconds =
          std::chrono::duration<double>(Clock::now() - start).count();
      const auto [correct, total] = evaluate(net, test, rank, worldSize, 256);
      const auto sums = sumOverRanks(
          *pg, {lossSum, static_cast<double>(shard), correct, total, batches});
      // The slowest rank's time is the job's.
      auto slowest = torch::tensor({seconds}, torch::kDouble);
      pg->allreduce(slowest, trellis::collectives::ReduceOp::kMax).wait();
      accuracy = sums[2] / sums[3];
      if (rank == 0) {
        std::printf(
            "epoch %d  loss %.4f  images/s %.0f  test accuracy %.4f  "
            "(%.0f batches over %d ranks, %.1f s)\n",
            epoch, sums[0] / sums[1], sums[1] / slowest.item<double>(),
            accuracy, sums[4], worldSize, slowest.item<double>());
        std::fflush(stdout);
      }
    }
    if (rank == 0) {
      std::printf("final test accuracy %.4f on %zu test images (chance 0.10)\n",
                  accuracy, *test.size());
      std::printf(
          "published test accuracies, all 60,000 training images "
          "(dataset README benchmark):\n");
      for (const auto& b : kBaselines) {
        std::printf("  %-58s %.3f\n", b.model, b.accuracy);
      }
      std::printf("  %-58s %.3f\n", "this run", accuracy);
      std::fflush(stdout);
    }
  }
  return 0;
}
