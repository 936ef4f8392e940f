#include <ATen/core/ivalue.h>
#include <ATen/ops/batch_norm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/var_mean.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <ostream>
#include <sstream>
#include <unordered_set>
#include <utility>

#include <torch/autograd.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <trellis/core/error.h>
#include <trellis/core/mutex.h>
#include <trellis/ddp/sync_batch_norm.h>

namespace trellis::ddp {

namespace detail {

// The sizes of the allreduces the covered layers issued in this rank's
// current (or last) iteration, for a joined rank to replay. An iteration
// starts at the first statistics allreduce after a backward one.
struct SyncBatchNormLog {
  Mutex mu;
  std::vector<int64_t> ops TRELLIS_GUARDED_BY(mu);
  bool started TRELLIS_GUARDED_BY(mu) = false;
  bool sawBackward TRELLIS_GUARDED_BY(mu) = false;
  Joinable* joinable = nullptr;  // owner; only its thread reads it

  // True when this op starts an iteration.
  bool forwardOp(int64_t numel) {
    MutexLock lock(mu);
    bool starts = false;
    if (!started || sawBackward) {
      ops.clear();
      started = true;
      sawBackward = false;
      starts = true;
    }
    ops.push_back(numel);
    return starts;
  }
  void backwardOp(int64_t numel) {
    MutexLock lock(mu);
    sawBackward = true;
    ops.push_back(numel);
  }
  std::optional<std::vector<int64_t>> lastIteration() {
    MutexLock lock(mu);
    if (!started) {
      return std::nullopt;
    }
    return ops;
  }
};

}  // namespace detail

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string shapeOf(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

// What the autograd function needs at backward time besides tensors. A
// capsule is the IValue that holds an arbitrary C++ object in saved_data.
struct SyncHandle : torch::CustomClassHolder {
  std::shared_ptr<collectives::ProcessGroup> group;
  std::shared_ptr<detail::SyncBatchNormLog> log;  // null: not covered
};

std::vector<int64_t> reducedDims(const at::Tensor& input) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) {
    dims.push_back(d);
  }
  return dims;
}

std::vector<int64_t> channelShape(const at::Tensor& input) {
  std::vector<int64_t> shape(static_cast<size_t>(input.dim()), 1);
  shape[1] = input.size(1);
  return shape;
}

// Forward: one allreduce of [sum (C), sum of squares (C), count (1)], in
// float64 (each rank's sums come from its own mean and centred variance,
// so the cancellation in E[x²] - mean² is float64's, not float32's).
// Outputs: y, and (not differentiable) the global mean and unbiased
// variance for the running statistics.
struct SyncBatchNormFunction
    : torch::autograd::Function<SyncBatchNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const at::Tensor& weight, const at::Tensor& bias,
                               double eps,
                               const c10::intrusive_ptr<SyncHandle>& handle) {
    const int64_t c = input.size(1);
    const int64_t n = c == 0 ? 0 : input.numel() / c;
    const auto dims = reducedDims(input);
    const auto f64 = input.options().dtype(at::kDouble);
    at::Tensor sum = at::zeros({c}, f64);
    at::Tensor sumSq = at::zeros({c}, f64);
    if (n > 0) {
      auto [var, mean] = at::var_mean(input, dims, /*unbiased=*/false,
                                      /*keepdim=*/false);
      const at::Tensor meanD = mean.to(at::kDouble);
      sum = meanD * static_cast<double>(n);
      sumSq = (var.to(at::kDouble) + meanD * meanD) * static_cast<double>(n);
    }
    at::Tensor stats =
        at::cat({sum, sumSq, at::full({1}, static_cast<double>(n), f64)});
    if (handle->log && handle->log->forwardOp(stats.numel()) &&
        handle->log->joinable != nullptr) {
      Join::notify(*handle->log->joinable);
    }
    handle->group->allreduce(stats).wait();  // bounded by the group
    const double count = stats[2 * c].item<double>();
    if (count <= 1) {
      throwError(Error::invalidArgument(
          "SyncBatchNorm: expected more than 1 value per channel in "
          "training, the global batch has " +
          std::to_string(static_cast<int64_t>(count)) + " (this rank's input " +
          shapeOf(input) + ")"));
    }
    const at::Tensor mean = stats.narrow(0, 0, c) / count;
    const at::Tensor var =
        (stats.narrow(0, c, c) / count - mean * mean).clamp_min(0);
    const auto shape = channelShape(input);
    const at::Tensor invstd =
        (var + eps).rsqrt().to(input.scalar_type()).view(shape);
    const at::Tensor xhat =
        (input - mean.to(input.scalar_type()).view(shape)) * invstd;
    at::Tensor out =
        weight.defined() ? xhat * weight.view(shape) + bias.view(shape) : xhat;
    ctx->save_for_backward({xhat, invstd, weight});
    ctx->saved_data["count"] = count;
    ctx->saved_data["handle"] = c10::IValue::make_capsule(handle);
    at::Tensor runningMean = mean.to(input.scalar_type());
    at::Tensor runningVar =
        (var * (count / (count - 1))).to(input.scalar_type());
    ctx->mark_non_differentiable({runningMean, runningVar});
    return {out, runningMean, runningVar};
  }

  // One allreduce of [sum dy (C), sum dy * x̂ (C)], then batch norm's input
  // gradient over the global batch:
  //   dx = w * invstd * (dy - mean(dy) - x̂ * mean(dy * x̂)).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& xhat = saved[0];
    const at::Tensor& invstd = saved[1];
    const at::Tensor& weight = saved[2];
    const double count = ctx->saved_data["count"].toDouble();
    const auto handle = c10::static_intrusive_pointer_cast<SyncHandle>(
        ctx->saved_data["handle"].toCapsule());
    const at::Tensor dy = grads[0];
    const int64_t c = xhat.size(1);
    const auto dims = reducedDims(xhat);
    const at::Tensor sumDy = dy.sum(dims);
    const at::Tensor sumDyXhat = (dy * xhat).sum(dims);
    at::Tensor sums = at::cat({sumDy, sumDyXhat}).to(at::kDouble);
    if (handle->log) {
      handle->log->backwardOp(sums.numel());
    }
    handle->group->allreduce(sums).wait();
    const auto shape = channelShape(xhat);
    const at::Tensor meanDy =
        (sums.narrow(0, 0, c) / count).to(xhat.scalar_type()).view(shape);
    const at::Tensor meanDyXhat =
        (sums.narrow(0, c, c) / count).to(xhat.scalar_type()).view(shape);
    const at::Tensor scale =
        weight.defined() ? invstd * weight.view(shape) : invstd;
    at::Tensor dx = (dy - meanDy - xhat * meanDyXhat) * scale;
    if (!weight.defined()) {
      return {dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    return {dx, sumDyXhat, sumDy, at::Tensor(), at::Tensor()};
  }
};

template <typename Bn>
SyncBatchNormOptions optionsOf(const Bn& bn,
                               std::shared_ptr<collectives::ProcessGroup> g) {
  const auto& o = bn.options;
  std::optional<double> momentum;
  if (o.momentum().has_value()) {
    momentum = *o.momentum();
  }
  return SyncBatchNormOptions(o.num_features())
      .eps(o.eps())
      .momentum(momentum)
      .affine(o.affine())
      .trackRunningStats(o.track_running_stats())
      .processGroup(std::move(g));
}

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(SyncBatchNormOptions options)
    : options(std::move(options)) {
  reset();
}

SyncBatchNormImpl::SyncBatchNormImpl(
    const torch::nn::BatchNorm1dImpl& bn,
    std::shared_ptr<collectives::ProcessGroup> group)
    : options(optionsOf(bn, std::move(group))) {
  weight = bn.weight;
  bias = bn.bias;
  running_mean = bn.running_mean;
  running_var = bn.running_var;
  num_batches_tracked = bn.num_batches_tracked;
  registerState(/*adopt=*/true);
  train(bn.is_training());
}

SyncBatchNormImpl::SyncBatchNormImpl(
    const torch::nn::BatchNorm2dImpl& bn,
    std::shared_ptr<collectives::ProcessGroup> group)
    : options(optionsOf(bn, std::move(group))) {
  weight = bn.weight;
  bias = bn.bias;
  running_mean = bn.running_mean;
  running_var = bn.running_var;
  num_batches_tracked = bn.num_batches_tracked;
  registerState(/*adopt=*/true);
  train(bn.is_training());
}

void SyncBatchNormImpl::reset() { registerState(/*adopt=*/false); }

// Cloneable::clone calls reset() on a copy (which shares this one's
// tensors) with the registrations cleared, then copies the values into
// the registered tensors: so fresh ones unless adopting a BatchNorm's.
void SyncBatchNormImpl::registerState(bool adopt) {
  log_.reset();  // a clone is covered by no Joinable
  const int64_t c = options.numFeatures();
  if (c <= 0) {
    throwError(Error::invalidArgument(
        "SyncBatchNorm: numFeatures must be positive, got " +
        std::to_string(c)));
  }
  if (!adopt) {
    weight = bias = running_mean = running_var = num_batches_tracked =
        at::Tensor();
  }
  if (options.affine()) {
    if (!weight.defined()) {
      weight = torch::ones({c});
      bias = torch::zeros({c});
    }
    weight =
        register_parameter("weight", weight, weight.requires_grad() || !adopt);
    bias = register_parameter("bias", bias, bias.requires_grad() || !adopt);
  }
  if (options.trackRunningStats()) {
    if (!running_mean.defined()) {
      running_mean = torch::zeros({c});
      running_var = torch::ones({c});
      num_batches_tracked = torch::zeros({}, torch::kLong);
    }
    running_mean = register_buffer("running_mean", running_mean);
    running_var = register_buffer("running_var", running_var);
    num_batches_tracked =
        register_buffer("num_batches_tracked", num_batches_tracked);
  }
}

void SyncBatchNormImpl::resetRunningStats() {
  if (options.trackRunningStats()) {
    torch::NoGradGuard noGrad;
    running_mean.zero_();
    running_var.fill_(1);
    num_batches_tracked.zero_();
  }
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "trellis::ddp::SyncBatchNorm(" << options.numFeatures()
         << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine()
         << ", trackRunningStats=" << options.trackRunningStats() << ")";
}

void SyncBatchNormImpl::checkInput(const at::Tensor& input) const {
  if (!input.defined()) {
    throwError(Error::invalidArgument("SyncBatchNorm: the input is undefined"));
  }
  if (input.dim() < 2 || input.dim() > 4) {
    throwError(Error::invalidArgument(
        "SyncBatchNorm: expected a 2-D (N, C), 3-D (N, C, L) or 4-D (N, C, "
        "H, W) input, got a " +
        std::to_string(input.dim()) + "-D input of shape " + shapeOf(input)));
  }
  if (input.size(1) != options.numFeatures()) {
    throwError(Error::invalidArgument(
        "SyncBatchNorm: the input has " + std::to_string(input.size(1)) +
        " channels (dim 1 of shape " + shapeOf(input) +
        ") but the layer has numFeatures " +
        std::to_string(options.numFeatures())));
  }
  if (!at::isFloatingType(input.scalar_type())) {
    throwError(Error::invalidArgument(
        std::string("SyncBatchNorm: expected a floating-point input, got ") +
        c10::toString(input.scalar_type())));
  }
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& input) {
  checkInput(input);
  if (!is_training()) {
    // torch::nn::BatchNorm's eval forward; without running statistics,
    // this rank's batch statistics. No communication.
    const bool track = options.trackRunningStats();
    return at::batch_norm(input, weight, bias,
                          track ? running_mean : at::Tensor(),
                          track ? running_var : at::Tensor(),
                          /*training=*/!track, /*momentum=*/0.0, options.eps(),
                          /*cudnn_enabled=*/true);
  }
  const auto& group = options.processGroup();
  if (!group) {
    throwError(Error(Code::kFailedPrecondition,
                     "SyncBatchNorm: a training forward needs a process "
                     "group (SyncBatchNormOptions::processGroup)"));
  }
  double momentum = 0;
  if (options.trackRunningStats()) {
    torch::NoGradGuard noGrad;
    num_batches_tracked.add_(1);
    momentum =
        options.momentum()
            ? *options.momentum()
            : 1.0 / static_cast<double>(num_batches_tracked.item<int64_t>());
  }
  auto handle = c10::make_intrusive<SyncHandle>();
  handle->group = group;
  handle->log = log_;
  auto outs =
      SyncBatchNormFunction::apply(input, weight, bias, options.eps(), handle);
  if (options.trackRunningStats()) {
    torch::NoGradGuard noGrad;
    running_mean.mul_(1 - momentum).add_(outs[1], momentum);
    running_var.mul_(1 - momentum).add_(outs[2], momentum);
  }
  return outs[0];
}

// ---- convertSyncBatchNorm ----

namespace {

std::shared_ptr<SyncBatchNormImpl> asSync(
    const std::shared_ptr<torch::nn::Module>& m,
    const std::shared_ptr<collectives::ProcessGroup>& group) {
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(m)) {
    return std::make_shared<SyncBatchNormImpl>(*bn, group);
  }
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(m)) {
    return std::make_shared<SyncBatchNormImpl>(*bn, group);
  }
  return nullptr;
}

bool isBatchNorm(const std::shared_ptr<torch::nn::Module>& m) {
  return std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(m) ||
         std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(m);
}

bool isContainer(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::SequentialImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::ModuleListImpl*>(&m) != nullptr;
}

// Before changing anything: every batch norm below `m` must sit in a
// container whose forward finds it through the tree.
void checkConvertible(const torch::nn::Module& m, const std::string& path) {
  for (const auto& item : m.named_children()) {
    const std::string childPath =
        path.empty() ? item.key() : path + "." + item.key();
    if (isBatchNorm(item.value()) && !isContainer(m)) {
      throwError(Error::invalidArgument(
          "convertSyncBatchNorm: '" + childPath + "' (" + item.value()->name() +
          ") is the child of a module that is not a torch::nn::Sequential "
          "or ModuleList; its forward most likely calls it through a member "
          "holder, which cannot be rebound from outside. Declare it as a "
          "trellis::ddp::SyncBatchNorm (same parameter and buffer names)"));
    }
    checkConvertible(*item.value(), childPath);
  }
}

void convertIn(torch::nn::Module& m,
               const std::shared_ptr<collectives::ProcessGroup>& group) {
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&m)) {
    const auto children = seq->named_children();
    bool any = false;
    for (const auto& item : children) {
      any = any || isBatchNorm(item.value());
    }
    if (any) {
      // Sequential's forward walks its own list of AnyModules, which
      // replace_module does not touch: rebuild it, same names and order.
      torch::nn::SequentialImpl fresh;
      size_t i = 0;
      for (auto it = seq->begin(); it != seq->end(); ++it, ++i) {
        const std::string& name = children[i].key();
        if (auto sync = asSync(it->ptr(), group)) {
          fresh.push_back(name, sync);
        } else {
          fresh.push_back(name, *it);
        }
      }
      const bool training = seq->is_training();
      *seq = fresh;
      if (!training) {
        seq->eval();
      }
    }
  } else if (auto* list = dynamic_cast<torch::nn::ModuleListImpl*>(&m)) {
    bool any = false;
    for (const auto& child : *list) {
      any = any || isBatchNorm(child);
    }
    if (any) {
      torch::nn::ModuleListImpl fresh;
      for (const auto& child : *list) {
        auto sync = asSync(child, group);
        fresh.push_back(sync ? std::shared_ptr<torch::nn::Module>(sync)
                             : child);
      }
      const bool training = list->is_training();
      *list = fresh;
      if (!training) {
        list->eval();
      }
    }
  }
  for (const auto& child : m.children()) {
    convertIn(*child, group);
  }
}

}  // namespace

std::shared_ptr<torch::nn::Module> convertSyncBatchNorm(
    std::shared_ptr<torch::nn::Module> module,
    std::shared_ptr<collectives::ProcessGroup> group) {
  if (!module) {
    throwError(Error::invalidArgument("convertSyncBatchNorm: null module"));
  }
  if (auto sync = asSync(module, group)) {
    return sync;
  }
  checkConvertible(*module, "");
  convertIn(*module, group);
  return module;
}

// ---- SyncBatchNormJoinable ----

SyncBatchNormJoinable::SyncBatchNormJoinable(torch::nn::Module& module)
    : log_(std::make_shared<detail::SyncBatchNormLog>()) {
  std::unordered_set<const void*> seen;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    auto layer = std::dynamic_pointer_cast<SyncBatchNormImpl>(m);
    if (layer && seen.insert(layer.get()).second) {
      layers_.push_back(std::move(layer));
    }
  }
  if (layers_.empty()) {
    throwError(Error::invalidArgument(
        "SyncBatchNormJoinable: the module has no SyncBatchNorm layer"));
  }
  group_ = layers_.front()->options.processGroup();
  for (const auto& layer : layers_) {
    if (!layer->options.processGroup()) {
      throwError(Error::invalidArgument(
          "SyncBatchNormJoinable: a SyncBatchNorm layer has no process "
          "group"));
    }
    if (layer->options.processGroup() != group_) {
      throwError(Error::invalidArgument(
          "SyncBatchNormJoinable: the SyncBatchNorm layers use different "
          "process groups ('" +
          group_->name() + "' and '" + layer->options.processGroup()->name() +
          "'); one Joinable covers layers of one group"));
    }
    if (layer->log_) {
      throwError(Error::invalidArgument(
          "SyncBatchNormJoinable: a SyncBatchNorm layer is already covered "
          "by another SyncBatchNormJoinable"));
    }
  }
  log_->joinable = this;
  for (const auto& layer : layers_) {
    layer->log_ = log_;
  }
}

SyncBatchNormJoinable::~SyncBatchNormJoinable() {
  for (const auto& layer : layers_) {
    if (layer->log_ == log_) {
      layer->log_.reset();
    }
  }
  log_->joinable = nullptr;
}

at::Device SyncBatchNormJoinable::joinDevice() const {
  for (const auto& layer : layers_) {
    for (const auto* t : {&layer->weight, &layer->running_mean}) {
      if (t->defined()) {
        return t->device();
      }
    }
  }
  return at::Device(at::kCPU);
}

std::shared_ptr<collectives::ProcessGroup>
SyncBatchNormJoinable::joinProcessGroup() const {
  return group_;
}

JoinHook SyncBatchNormJoinable::joinHook(const JoinOptions& /*options*/) {
  JoinHook hook;
  // Zeros for every allreduce of one iteration (count 0 in the statistics,
  // nothing in the gradient sums), all issued before any wait: the ranks
  // still training issue them inside DDP's iteration, which a joined rank
  // shadows after this.
  hook.startHook = [this] {
    std::vector<int64_t> ops;
    if (auto last = log_->lastIteration()) {
      ops = std::move(*last);
    } else {
      for (const auto& layer : layers_) {
        ops.push_back(2 * layer->options.numFeatures() + 1);
      }
      for (auto it = layers_.rbegin(); it != layers_.rend(); ++it) {
        ops.push_back(2 * (*it)->options.numFeatures());
      }
    }
    const auto f64 =
        at::TensorOptions().dtype(at::kDouble).device(joinDevice());
    pending_.clear();
    pendingTensors_.clear();
    for (int64_t numel : ops) {
      pendingTensors_.push_back(at::zeros({numel}, f64));
      pending_.push_back(group_->allreduce(pendingTensors_.back()));
    }
  };
  hook.mainHook = [this] {
    auto works = std::move(pending_);
    pending_.clear();
    for (auto& w : works) {
      w.wait();
    }
    pendingTensors_.clear();
  };
  // The running statistics of the last rank to join (it saw every
  // iteration) go to every rank.
  hook.postHook = [this](bool isLastJoiner) {
    at::Tensor candidate =
        at::full({1}, isLastJoiner ? int64_t{group_->rank()} : int64_t{-1},
                 at::TensorOptions().dtype(at::kLong))
            .to(joinDevice());
    group_->allreduce(candidate, collectives::ReduceOp::kMax).wait();
    const auto root = static_cast<int>(candidate.cpu().item<int64_t>());
    if (root < 0 || root >= group_->size()) {
      throwError(Error::internal(
          "SyncBatchNormJoinable: Join found no last rank to join"));
    }
    torch::NoGradGuard noGrad;
    for (const auto& layer : layers_) {
      if (!layer->options.trackRunningStats()) {
        continue;
      }
      for (auto* t : {&layer->running_mean, &layer->running_var,
                      &layer->num_batches_tracked}) {
        group_->broadcast(*t, root).wait();
      }
    }
  };
  return hook;
}

}  // namespace trellis::ddp
