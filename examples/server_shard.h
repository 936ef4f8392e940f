#pragma once
// The main job's parameter server (examples/hybrid_training.cc): one
// server's rows of every embedding table, their sparse Adagrad stepped in
// the distributed backward, and their checkpoints. Header only; the
// program that uses it registers its methods (TRELLIS_REMOTE_METHODS).
#include <ATen/CPUGeneratorImpl.h>
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "row_shards.h"
#include <trellis/trellis.h>

// The rows of every table that live on one server, stacked in one weight
// (table batching, as TorchRec's batched embedding kernels do): table t's
// rows of this server are rows base(t) .. base(t+1)-1. A trainer's step
// then makes one lookup, sends one gradient and runs one optimizer step
// on each server, whatever the number of tables: per table, each of those
// cost a message and libtorch's fixed per-op work (docs/benchmarks.md).
// Lookups come from trainers' contexts (training: the graph is recorded,
// the rows are noted) or from outside one (evaluation: no graph).
class ServerShard {
 public:
  ServerShard(int64_t server, int64_t tables, int64_t rowsPerTable, int64_t dim,
              int64_t servers, uint64_t seed, double lr)
      : server_(server), servers_(servers) {
    const int64_t rows =
        trellis::examples::shardRows(rowsPerTable, servers, server);
    at::NoGradGuard noGrad;
    weight_ = at::empty({tables * rows, dim});
    for (int64_t t = 0; t < tables; ++t) {
      // Each table's rows from their own generator, as when every table
      // had a weight of its own.
      at::Generator g = at::detail::createCPUGenerator(
          seed * 1000003 + static_cast<uint64_t>(t) * 101 +
          static_cast<uint64_t>(server));
      weight_.narrow(0, t * rows, rows).normal_(0.0, 0.05, g);
      bases_.push_back(t * rows);
    }
    bases_.push_back(tables * rows);
    weight_.requires_grad_(true);
    looked_ = std::vector<char>(static_cast<size_t>(tables * rows), 0);
    initial_ = weight_.detach().clone();
    // Each backward pass that reaches this server (one per trainer and
    // step: one lookup each) steps its rows right there, so the trainers'
    // optimizer step makes no round trip to the servers and this step
    // overlaps the rest of their backward (DDP's allreduce).
    optimizer_ = std::make_unique<trellis::dist_autograd::OptimizerInBackward>(
        trellis::dist_autograd::Adagrad{.lr = lr,
                                        .initialAccumulatorValue = 0.1},
        std::vector<at::Tensor>{weight_});
  }

  // Sum-mode bags over rows `ids` of the stacked weight.
  at::Tensor lookup(const at::Tensor& ids, const at::Tensor& offsets) {
    const int64_t rows = weight_.size(0);
    if (ids.dim() != 1 || offsets.dim() != 1 ||
        ids.scalar_type() != at::kLong || offsets.scalar_type() != at::kLong) {
      throw std::invalid_argument("lookup: ids and offsets must be 1-d int64");
    }
    if (ids.numel() > 0 &&
        (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() >= rows)) {
      throw std::out_of_range("lookup: a row id outside server " +
                              std::to_string(server_) + "'s " +
                              std::to_string(rows) + " rows");
    }
    const bool training = trellis::dist_autograd::currentContextId() != 0;
    if (training) {
      std::lock_guard<std::mutex> lock(mu_);
      const int64_t* p = ids.data_ptr<int64_t>();
      for (int64_t i = 0; i < ids.numel(); ++i) {
        looked_[static_cast<size_t>(p[i])] = 1;
      }
    }
    torch::AutoGradMode gradMode(training);
    return std::get<0>(at::embedding_bag(weight_, ids, offsets,
                                         /*scale_grad_by_freq=*/false,
                                         /*mode=*/0, /*sparse=*/true));
  }

  // Checkpoint `step` of this server's rows and their Adagrad state (the
  // caller, trainer 0, has made sure no step is in flight).
  bool save(int64_t step) {
    const std::string state = optimizer_->stateDict();
    checkpoints().save(step, [&](torch::serialize::OutputArchive& a) {
      a.write("weight", weight_.detach());
      a.write("optimizer", c10::IValue(state));
      a.write("servers", c10::IValue(servers_));
    });
    return true;
  }

  // Back to checkpoint `step`: "" when done, else why not (naming the
  // file), and this server's state is unchanged. Rows are sharded by the
  // number of servers, so a checkpoint taken with another number is
  // refused rather than re-sharded.
  std::string restore(int64_t step) {
    std::string why;
    auto loaded = checkpoints().load(step, std::nullopt, &why);
    if (!loaded) {
      return why;
    }
    const std::string file = loaded->path.string();
    c10::IValue servers;
    if (!loaded->archive.try_read("servers", servers) || !servers.isInt() ||
        servers.toInt() != servers_) {
      return file + " was taken with " +
             (servers.isInt() ? std::to_string(servers.toInt())
                              : "an unknown number of") +
             " servers and this job has " + std::to_string(servers_) +
             " (--servers): the rows are sharded by the number of servers and "
             "are not re-sharded; resume with as many servers, or start "
             "afresh in another --checkpoint-dir";
    }
    at::Tensor w;
    loaded->archive.read("weight", w);
    if (!w.sizes().equals(weight_.sizes())) {
      return file +
             ": the server's shape of the tables differs (--tables, "
             "--rows, --dim)";
    }
    c10::IValue state;
    loaded->archive.read("optimizer", state);
    if (!state.isString()) {
      return file + ": no optimizer state for the tables";
    }
    optimizer_->loadStateDict(state.toStringRef());
    at::NoGradGuard noGrad;
    weight_.copy_(w);
    std::lock_guard<std::mutex> lock(mu_);
    initial_ = weight_.detach().clone();
    std::fill(looked_.begin(), looked_.end(), 0);
    return "";
  }

  // Of table `table`'s rows here, since the start (or the restore): rows
  // looked up in training, rows whose values changed, and rows that
  // changed without a lookup (must be none: a sparse update touches only
  // the rows a lookup used).
  struct Stats {
    int64_t looked = 0, changed = 0, changedUnlooked = 0;
  };
  Stats stats(int64_t table) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto t = static_cast<size_t>(table);
    const int64_t first = bases_[t], count = bases_[t + 1] - bases_[t];
    at::Tensor changed = (weight_.detach().narrow(0, first, count) !=
                          initial_.narrow(0, first, count))
                             .any(1)
                             .to(at::kByte)
                             .contiguous();
    const uint8_t* c = changed.data_ptr<uint8_t>();
    Stats s;
    for (int64_t r = 0; r < count; ++r) {
      const char looked = looked_[static_cast<size_t>(first + r)];
      s.looked += looked;
      s.changed += c[r] ? 1 : 0;
      s.changedUnlooked += (c[r] && !looked) ? 1 : 0;
    }
    return s;
  }

  int64_t tables() const { return static_cast<int64_t>(bases_.size()) - 1; }

  static void setCheckpointDir(std::filesystem::path dir) {
    dir_() = std::move(dir);
  }

 private:
  static trellis::elastic::Checkpoints checkpoints() {
    return trellis::elastic::Checkpoints({.dir = dir_(), .prefix = "tables"});
  }
  static std::filesystem::path& dir_() {
    static std::filesystem::path dir;
    return dir;
  }

  int64_t server_;
  int64_t servers_;
  std::vector<int64_t> bases_;  // tables() + 1 entries
  at::Tensor weight_;
  std::mutex mu_;
  std::vector<char> looked_;
  at::Tensor initial_;
  std::unique_ptr<trellis::dist_autograd::OptimizerInBackward> optimizer_;
};
