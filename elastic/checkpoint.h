#pragma once
// Checkpoints a restarted group resumes from (docs/elastic.md,
// "Checkpoints"). Target trellis::elastic_checkpoint: the one piece of
// elastic/ that uses libtorch, kept apart so elastic-run itself never links
// it.
//
//   trellis::elastic::Checkpoints ckpt(
//       {.dir = "/ckpt/rank" + std::to_string(env.rank)});
//   int64_t start = 0;
//   if (auto last = ckpt.loadLatest()) {
//     trellis::elastic::loadModule(last->archive, "model", *model);
//     trellis::elastic::loadOptimizer(last->archive, "optim", optimizer);
//     start = last->step + 1;
//   }
//   for (int64_t step = start; step < steps; ++step) {
//     ...
//     if (step % 100 == 0) {
//       ckpt.save(step, [&](torch::serialize::OutputArchive& a) {
//         trellis::elastic::saveModule(a, "model", *model);
//         trellis::elastic::saveOptimizer(a, "optim", optimizer);
//       });
//     }
//   }
//
// Contract
//  - save() is atomic: the checkpoint is written to a temporary file in the
//    same directory, flushed to disk (fsync), renamed to its final name, and
//    the directory is flushed too. A process killed at any point leaves
//    either the new checkpoint whole or none of it (a temporary file that
//    loadLatest() never reads).
//  - Each file carries the step and a SHA-256 of its contents. loadLatest()
//    returns the newest checkpoint that is whole; a torn, truncated or
//    corrupted one is skipped with a warning naming the file and what was
//    wrong, and the one before it is tried.
//  - After each save, only the newest `keepLast` checkpoints of this prefix
//    stay; older ones are removed.
//  - Errors writing (a full disk, a directory that cannot be created) throw
//    trellis::Error-based exceptions naming the path and errno; nothing is
//    renamed into place then.
//  - One writer per directory and prefix (each rank its own directory, or
//    its own prefix); readers may run at any time.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

namespace trellis::elastic {

struct CheckpointOptions {
  std::filesystem::path dir;
  // File names: <prefix>-<step, 12 digits>.ckpt.
  std::string prefix = "checkpoint";
  // Checkpoints kept after a save (>= 1).
  int keepLast = 3;
};

class Checkpoints {
 public:
  // Creates `dir` (and its parents) if needed. Throws InvalidArgumentError
  // for an empty dir, a prefix with '/' or a leading '.', keepLast < 1.
  explicit Checkpoints(CheckpointOptions options);

  // Writes what `fill` puts into the archive as checkpoint `step` (>= 0)
  // and returns its path.
  std::filesystem::path save(
      int64_t step,
      const std::function<void(torch::serialize::OutputArchive&)>& fill);

  struct Loaded {
    int64_t step = 0;
    std::filesystem::path path;
    torch::serialize::InputArchive archive;
  };
  // The newest whole checkpoint, or nullopt when there is none (none
  // written yet, or every one is damaged).
  std::optional<Loaded> loadLatest(
      std::optional<torch::Device> device = std::nullopt) const;

  // Checkpoint `step`, or nullopt when it is absent or damaged (damage is
  // logged as for loadLatest). With `why`, what was wrong, naming the file
  // ("<path> does not exist", "<path>: its SHA-256 does not match its
  // payload", ...).
  std::optional<Loaded> load(int64_t step,
                             std::optional<torch::Device> device = std::nullopt,
                             std::string* why = nullptr) const;

  // Steps of the checkpoint files present, oldest first, whole or not.
  std::vector<int64_t> steps() const;

  const CheckpointOptions& options() const { return options_; }

 private:
  std::filesystem::path pathOf(int64_t step) const;
  void prune() const;

  CheckpointOptions options_;
};

// A module's parameters and buffers, or an optimizer's state, under `key`.
// load* throw (c10::Error) when the key is missing or the shapes differ.
void saveModule(torch::serialize::OutputArchive& archive,
                const std::string& key, const torch::nn::Module& module);
void loadModule(torch::serialize::InputArchive& archive, const std::string& key,
                torch::nn::Module& module);
void saveOptimizer(torch::serialize::OutputArchive& archive,
                   const std::string& key,
                   const torch::optim::Optimizer& optimizer);
void loadOptimizer(torch::serialize::InputArchive& archive,
                   const std::string& key, torch::optim::Optimizer& optimizer);

}  // namespace trellis::elastic
