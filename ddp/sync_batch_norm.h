#pragma once
// SyncBatchNorm: batch norm whose training statistics are those of the
// global batch, every rank's batch together (torch.nn.SyncBatchNorm's
// meaning, docs/ddp.md "SyncBatchNorm").
//
//   auto pg = trellis::collectives::ProcessGroup::fromEnvironment();
//   auto bnGroup = pg->newGroup({0, 1, ..., n - 1});  // its own, see Join
//   trellis::ddp::SyncBatchNorm bn(
//       trellis::ddp::SyncBatchNormOptions(16).processGroup(bnGroup));
//   auto y = bn(x);     // x: (N, C), (N, C, L) or (N, C, H, W), C == 16
//
// Contract
//  - Training mode: forward is collective over the options' group: ONE
//    allreduce of (per-channel sum, sum of squares, element count), so
//    ranks with different batch sizes are weighted by their counts (a rank
//    may even bring an empty batch). The output is normalized with the
//    global mean and biased variance; the running statistics are updated
//    with the global mean and unbiased variance, as torch::nn::BatchNorm
//    does with the whole batch. Backward is collective too: ONE allreduce
//    of the per-channel sums of grad and grad * x̂, so the input's gradient
//    is that of batch norm over the global batch. The weight's and bias's
//    gradients are this rank's share (their sum over the ranks is the
//    global batch's gradient), which DDP then averages as for any
//    parameter. Every rank must run the same sequence of training
//    forwards and backwards through its SyncBatchNorm layers.
//  - Eval mode with running statistics: torch::nn::BatchNorm's eval
//    forward, no communication. Without running statistics
//    (trackRunningStats false), eval normalizes with this rank's batch,
//    no communication, as torch's SyncBatchNorm does.
//  - A bad input (dims other than 2, 3 or 4; a channel count other than
//    numFeatures; not floating point; a global batch of one value per
//    channel in training) is an InvalidArgumentError naming what was
//    wrong. A training forward without a process group is a
//    FailedPreconditionError. The collectives' errors pass through.
//  - Same parameter and buffer names as torch::nn::BatchNorm (weight,
//    bias, running_mean, running_var, num_batches_tracked), so state
//    dicts and checkpoints move between the two.
//  - Thread safety: as any module, one thread drives it.
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <trellis/collectives/process_group.h>
#include <trellis/ddp/join.h>

namespace trellis::ddp {

namespace detail {
struct SyncBatchNormLog;
}  // namespace detail

// torch::nn::BatchNormOptions' fields, camelBack, and the group.
struct SyncBatchNormOptions {
  /* implicit */ SyncBatchNormOptions(int64_t numFeatures)  // NOLINT
      : numFeatures_(numFeatures) {}
  // C: dim 1 of the input.
  TORCH_ARG(int64_t, numFeatures);
  TORCH_ARG(double, eps) = 1e-5;
  // Weight of the new batch's statistics in the running ones; nullopt: a
  // cumulative average (1 / numBatchesTracked).
  TORCH_ARG(std::optional<double>, momentum) = 0.1;
  // Learnable per-channel weight (ones) and bias (zeros).
  TORCH_ARG(bool, affine) = true;
  TORCH_ARG(bool, trackRunningStats) = true;
  // The ranks whose batches make the global batch. Under a Join with a
  // DistributedDataParallel, a group of its own (newGroup over the same
  // ranks), not DDP's: see SyncBatchNormJoinable.
  TORCH_ARG(std::shared_ptr<collectives::ProcessGroup>, processGroup) = nullptr;
};

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  explicit SyncBatchNormImpl(SyncBatchNormOptions options);
  // Takes `bn`'s options, parameters, buffers and training mode (values
  // shared, not copied): what convertSyncBatchNorm puts in its place.
  SyncBatchNormImpl(const torch::nn::BatchNorm1dImpl& bn,
                    std::shared_ptr<collectives::ProcessGroup> group);
  SyncBatchNormImpl(const torch::nn::BatchNorm2dImpl& bn,
                    std::shared_ptr<collectives::ProcessGroup> group);

  void reset() override;
  // Running statistics back to 0 mean, 1 variance, 0 batches.
  void resetRunningStats();
  at::Tensor forward(const at::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  SyncBatchNormOptions options;
  at::Tensor weight, bias;  // undefined unless affine
  at::Tensor running_mean, running_var,
      num_batches_tracked;  // undefined unless trackRunningStats

 private:
  friend class SyncBatchNormJoinable;
  void registerState(bool adopt);
  void checkInput(const at::Tensor& input) const;
  // Set while a SyncBatchNormJoinable covers this layer.
  std::shared_ptr<detail::SyncBatchNormLog> log_;
};
TORCH_MODULE(SyncBatchNorm);

// Replaces every torch::nn::BatchNorm1d and BatchNorm2d in `module` (the
// module itself included) by a SyncBatchNorm over `group` that takes its
// options, parameters, buffers and mode, like
// torch.nn.SyncBatchNorm.convert_sync_batchnorm. Returns the module to use
// (a new SyncBatchNorm when `module` itself is a batch norm; else
// `module`, changed in place). Local (no collective).
//
// C++ cannot rebind a member field: a batch norm is replaced where the
// forward finds it through the module tree, in a torch::nn::Sequential or
// ModuleList (rebuilt in place) or as `module` itself. A batch norm
// registered as the child of any other module is most likely called
// through a member holder of its parent, which would go on calling the old
// layer; that is an InvalidArgumentError naming its path, before anything
// is changed (declare such a layer as a SyncBatchNorm: same parameter and
// buffer names, so checkpoints load either way).
std::shared_ptr<torch::nn::Module> convertSyncBatchNorm(
    std::shared_ptr<torch::nn::Module> module,
    std::shared_ptr<collectives::ProcessGroup> group);

// The Joinable of the SyncBatchNorm layers of a module (ddp/join.h): a
// joined rank shadows their collectives, contributing count 0 to the
// statistics and zeros to the gradient sums, so the ranks still training
// normalize over their own batches only.
//
//   auto bnGroup = pg->newGroup(allRanks);        // before the layers
//   Net net(bnGroup);                             // has SyncBatchNorms
//   trellis::ddp::DistributedDataParallel model(net, pg);
//   trellis::ddp::SyncBatchNormJoinable bns(*net);
//   trellis::ddp::Join join({&model, &bns});      // DDP first
//
// Contract
//  - Covers the SyncBatchNorm layers of `module` at construction (itself
//    included); all must share one process group. A layer is covered by
//    at most one SyncBatchNormJoinable at a time. Not collective.
//  - A joined rank replays the collectives its own last iteration issued
//    through these layers (every statistics and gradient allreduce, in
//    order and size), so every iteration must issue the same ones (the
//    same layers in training mode, each forward followed by its backward).
//    A rank that joins before any iteration of its own assumes every
//    layer in registration order, forward then backward in reverse.
//  - With a DistributedDataParallel in the same Join, the layers' group
//    must not be DDP's: a training rank issues the statistics inside DDP's
//    iteration, which a joined rank cannot interleave on one group. On
//    their own group the joined rank starts them before shadowing DDP
//    (JoinHook::startHook). List DDP first.
//  - Alone in a Join, its first statistics allreduce of an iteration is
//    where the ranks still training call Join::notify.
//  - Once all have joined, the running statistics of the last rank to
//    join go to every rank (one max-allreduce and a broadcast per buffer).
class SyncBatchNormJoinable : public Joinable {
 public:
  explicit SyncBatchNormJoinable(torch::nn::Module& module);
  ~SyncBatchNormJoinable() override;

  JoinHook joinHook(const JoinOptions& options) override;
  at::Device joinDevice() const override;
  std::shared_ptr<collectives::ProcessGroup> joinProcessGroup() const override;

  // The layers covered, in registration order.
  size_t size() const { return layers_.size(); }

 private:
  std::vector<std::shared_ptr<SyncBatchNormImpl>> layers_;
  std::shared_ptr<collectives::ProcessGroup> group_;
  std::shared_ptr<detail::SyncBatchNormLog> log_;
  std::vector<collectives::Work> pending_;  // started by the start hook
  std::vector<at::Tensor> pendingTensors_;
};

}  // namespace trellis::ddp
