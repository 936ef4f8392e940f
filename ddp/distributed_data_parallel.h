#pragma once
// DistributedDataParallel: data parallel training of a libtorch module over
// a collectives::ProcessGroup, with torch.nn.parallel's meaning
// (docs/ddp.md).
//
//   auto pg = trellis::collectives::ProcessGroup::fromEnvironment();
//   Net net;                                  // a TORCH_MODULE holder
//   trellis::ddp::DistributedDataParallel model(net, pg,
//                                               {.bucketCapMb = 25});
//   torch::optim::SGD opt(net->parameters(), 0.1);
//   for (auto& [x, y] : myShard) {
//     opt.zero_grad();
//     auto loss = torch::mse_loss(model(x), y);
//     loss.backward();      // gradients averaged over the ranks on return
//     opt.step();
//   }
//
// Contract
//  - Construction is collective over the group: every rank calls it with
//    a module of the same parameters and buffers (names, shapes, dtypes, in
//    the same registration order). A difference is an InvalidArgumentError
//    on EVERY rank naming the first differing entry and what each rank has.
//    Then rank 0's parameters and buffers are copied to every rank.
//  - forward(args...) / operator() call module->forward(args...). With
//    broadcastBuffers, rank 0's buffers are broadcast first. A forward with
//    gradients enabled and outside noSync() arms the reducer: the
//    following backward averages every parameter's gradient over the ranks
//    (in buckets, each reduced as soon as all its gradients are ready, while
//    the rest of backward still runs), and returns only once the averaged
//    gradients are in each parameter's .grad. Every rank must run the same
//    sequence of forwards and backwards, each backward reaching at least one
//    parameter.
//  - A parameter that got no gradient in an armed backward, on any rank,
//    makes that backward throw FailedPreconditionError on every rank, naming
//    the parameters by module path, unless findUnusedParameters is set (then
//    its contribution is the local .grad, or zero without one; where no rank
//    produced one and it has no .grad, its .grad stays undefined).
//  - Failures of the group (a lost rank, a timeout) are thrown by the
//    backward (or by forward's broadcasts) as the collectives' typed errors.
//    A backward that failed midway (before its end-of-backward step) makes
//    the next forward throw FailedPreconditionError: the ranks'
//    collectives may be out of step.
//  - Parameters must be dense tensors of the group's device; those with
//    requires_grad == false are left out of the reduction.
//  - Thread safety: one thread drives forward and backward at a time (as
//    with any module); the reducer's hooks may run on autograd's threads.
//    Not copyable or movable (one wrapper owns the module's hooks).
//    Destroy it only when no backward through the module runs.
#include <ATen/core/Tensor.h>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <trellis/collectives/process_group.h>
#include <trellis/core/future.h>
#include <trellis/ddp/join.h>

namespace trellis::ddp {

// Field order is declaration order, for designated initializers:
// {.bucketCapMb = 4, .gradientAsBucketView = true}.
struct Options {
  // Size bound of a gradient bucket (MiB). Larger: fewer, larger
  // allreduces (less per-op latency), but the first starts later in
  // backward, so less of the communication overlaps it.
  double bucketCapMb = 25;
  // Bound of the first bucket (the last layers' gradients, ready first), so
  // that communication starts early in backward.
  double firstBucketCapMb = 1;
  // Each .grad is a view into its flat bucket: no copy into the bucket
  // before the allreduce and none back after, and no second copy of the
  // gradients in memory. .grad must then not be replaced by the program
  // between steps (zero_grad() that sets grads to none is handled: the next
  // backward puts the views back, at the cost of one copy).
  bool gradientAsBucketView = false;
  // Rank 0's buffers (batch norm statistics...) copied to every rank before
  // each forward: one broadcast per forward when the module has buffers.
  bool broadcastBuffers = true;
  // Tolerates parameters without a gradient in a backward (branches not
  // taken): after forward, the autograd graph is walked from forward's
  // outputs (Tensor, vector or tuple of Tensors) and the parameters it does
  // not reach are counted as ready at once, so their buckets are not held
  // back. Costs the walk per forward.
  bool findUnusedParameters = false;
  // With findUnusedParameters: the set of parameters forward uses is the
  // same every iteration, so the graph is walked at the first armed forward
  // only and its unused set reused after, saving the walk. A parameter of
  // that set that later gets a gradient is an error naming it (the graph
  // changed). No effect without findUnusedParameters.
  bool staticGraph = false;
};

// One bucket as a communication hook sees it, at its launch during
// backward (docs/ddp.md "Communication hooks").
struct GradBucket {
  // Position in launch order (0 goes first; the order is the same on every
  // rank).
  size_t index = 0;
  // This rank's gradients of the bucket's parameters, flat, in `parameters`'
  // order (the unused-parameter flags are not in it). The hook may change
  // it in place.
  at::Tensor buffer;
  std::vector<at::Tensor> parameters;
  std::vector<std::string> parameterNames;  // module paths
  bool isLast = false;                      // the last bucket launched
  std::shared_ptr<collectives::ProcessGroup> processGroup;
};

// A communication hook: replaces a bucket's allreduce. Returns a future of
// the reduced gradients (averaged over the ranks, as the default does): a
// tensor of buffer's numel, dtype and device, or buffer itself. Called on
// every rank for every bucket in the same order, from autograd's threads;
// it must issue the same collectives on every rank. The future is waited
// for at the end of backward (bounded by the group's timeout).
using CommHook = std::function<Future<at::Tensor>(GradBucket&)>;

// Built-in hooks.
namespace hooks {
// What DDP does without a hook: an allreduce averaging the bucket.
CommHook allreduce();
// The bucket cast to float16 (bfloat16), divided by the world size, summed
// by an allreduce, cast back: half the bytes on the wire, at float16's
// (bfloat16's) precision.
CommHook fp16Compress();
CommHook bf16Compress();
}  // namespace hooks

namespace detail {
class Reducer;

// What the reducer needs to see of forward's result: its tensors, when the
// result is a Tensor, a vector of Tensors or a tuple of those.
inline void collectOutputs(const at::Tensor& t, std::vector<at::Tensor>& out) {
  out.push_back(t);
}
inline void collectOutputs(const std::vector<at::Tensor>& ts,
                           std::vector<at::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <typename... Ts>
void collectOutputs(const std::tuple<Ts...>& ts, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... t) { (collectOutputs(t, out), ...); }, ts);
}
template <typename T>
concept OutputTensors = requires(const T& t, std::vector<at::Tensor>& out) {
  collectOutputs(t, out);
};
}  // namespace detail

class DistributedDataParallelBase;

// Returned by noSync(): while one exists, forwards do not arm the reducer,
// and backward accumulates gradients locally into .grad; the first armed
// backward after it reduces the accumulated sum. Cover the forward too.
class [[nodiscard]] NoSyncGuard {
 public:
  NoSyncGuard(NoSyncGuard&& other) noexcept
      : reducer_(std::move(other.reducer_)) {}
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard();

 private:
  friend class DistributedDataParallelBase;
  explicit NoSyncGuard(std::shared_ptr<detail::Reducer> reducer);
  std::shared_ptr<detail::Reducer> reducer_;
};

// The module-type independent part: checks, broadcasts, buckets, hooks.
// A Joinable (ddp/join.h): under a Join, each forward calls Join::notify
// first (so list the model first among the Join's Joinables); a joined
// rank shadows one iteration per round (the buffer broadcast, the one-time
// bucket rebuild broadcast when due, one allreduce of zeros per bucket)
// and, once all have joined, every rank takes the parameters and buffers
// of the last rank to join. Under an enabled Join every forward must arm
// the reducer (gradients enabled, outside noSync()): a joined rank cannot
// know which iterations skip the reduction.
class DistributedDataParallelBase : public Joinable {
 public:
  DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                              std::shared_ptr<collectives::ProcessGroup> group,
                              Options options);
  ~DistributedDataParallelBase() override;
  DistributedDataParallelBase(const DistributedDataParallelBase&) = delete;
  DistributedDataParallelBase& operator=(const DistributedDataParallelBase&) =
      delete;

  [[nodiscard]] NoSyncGuard noSync();
  // Replaces every bucket's allreduce by `hook` (hooks:: or the program's
  // own). Before the first forward, once, with the same kind of hook on
  // every rank. A null hook is an InvalidArgumentError.
  void registerCommHook(CommHook hook);
  const Options& options() const { return options_; }
  const std::shared_ptr<collectives::ProcessGroup>& processGroup() const {
    return group_;
  }
  // The current buckets, in launch order, as the module paths of their
  // parameters (for tests and logs). Changes once, at the first forward
  // after the first armed backward (rebuilt in gradient-ready order).
  std::vector<std::vector<std::string>> bucketParameterNames() const;

  // Joinable.
  JoinHook joinHook(const JoinOptions& options) override;
  at::Device joinDevice() const override { return device_; }
  std::shared_ptr<collectives::ProcessGroup> joinProcessGroup() const override {
    return group_;
  }

 protected:
  // Around module->forward: broadcasts buffers, rebuilds buckets once,
  // arms the reducer; then, with findUnusedParameters, walks the graph
  // from the outputs (nullopt: outputs of another type, nothing to walk).
  void beforeForward();
  void afterForward(const std::optional<std::vector<at::Tensor>>& outputs);
  // Whether this forward's outputs are to be walked (findUnusedParameters,
  // and not a staticGraph whose walk is done).
  bool walkNeeded() const;

 private:
  Options options_;
  std::shared_ptr<collectives::ProcessGroup> group_;
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<detail::Reducer> reducer_;
  at::Device device_{at::kCPU};  // of the first parameter or buffer
};

// M: the module's type (a torch::nn::Module subclass, usually the Impl of
// a TORCH_MODULE holder). Constructed from a shared_ptr<M> or a holder.
template <typename M = torch::nn::Module>
class DistributedDataParallel : public DistributedDataParallelBase {
 public:
  DistributedDataParallel(std::shared_ptr<M> module,
                          std::shared_ptr<collectives::ProcessGroup> group,
                          Options options = {})
      : DistributedDataParallelBase(module, std::move(group), options),
        module_(std::move(module)) {}
  DistributedDataParallel(const torch::nn::ModuleHolder<M>& holder,
                          std::shared_ptr<collectives::ProcessGroup> group,
                          Options options = {})
      : DistributedDataParallel(holder.ptr(), std::move(group), options) {}

  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    beforeForward();
    using Result =
        decltype(std::declval<M&>().forward(std::forward<Args>(args)...));
    if constexpr (std::is_void_v<Result>) {
      module_->forward(std::forward<Args>(args)...);
      afterForward(std::nullopt);
    } else {
      Result out = module_->forward(std::forward<Args>(args)...);
      if constexpr (detail::OutputTensors<Result>) {
        if (walkNeeded()) {
          std::vector<at::Tensor> tensors;
          detail::collectOutputs(out, tensors);
          afterForward(tensors);
        } else {
          afterForward(std::nullopt);
        }
      } else {
        afterForward(std::nullopt);
      }
      return out;
    }
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  const std::shared_ptr<M>& module() const { return module_; }

 private:
  std::shared_ptr<M> module_;
};

template <typename Impl>
DistributedDataParallel(const torch::nn::ModuleHolder<Impl>&,
                        std::shared_ptr<collectives::ProcessGroup>,
                        Options = {}) -> DistributedDataParallel<Impl>;

}  // namespace trellis::ddp
