#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>
#include <unordered_set>
#include <utility>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <trellis/core/error.h>
#include <trellis/ddp/reducer.h>

namespace trellis::ddp::detail {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// A tensor of `sizes` over `flat`'s memory from element `offset`. Not an
// autograd view (narrow().view() would be one): libtorch 1.13's C++
// Optimizer::zero_grad() calls detach_() on every .grad, which throws for
// views; gradients never require grad, so nothing is lost.
at::Tensor aliasInto(const at::Tensor& flat, int64_t offset,
                     at::IntArrayRef sizes) {
  return at::empty({0}, flat.options())
      .set_(flat.storage(), flat.storage_offset() + offset, sizes);
}

size_t bytesOf(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.element_size();
}

}  // namespace

std::vector<std::vector<size_t>> assignBuckets(
    const std::vector<at::Tensor>& params, const std::vector<size_t>& order,
    size_t firstCapBytes, size_t capBytes) {
  struct Open {
    at::ScalarType dtype;
    at::Device device;
    std::vector<size_t> members;
    size_t bytes = 0;
    // A bucket of this dtype and device was closed: the cap is capBytes.
    bool closedOne = false;
  };
  std::vector<Open> open;
  std::vector<std::vector<size_t>> out;
  for (size_t i : order) {
    const at::Tensor& p = params[i];
    auto it = std::find_if(open.begin(), open.end(), [&](const Open& o) {
      return o.dtype == p.scalar_type() && o.device == p.device();
    });
    if (it == open.end()) {
      open.push_back(Open{p.scalar_type(), p.device(), {}, 0, false});
      it = open.end() - 1;
    }
    it->members.push_back(i);
    it->bytes += bytesOf(p);
    if (it->bytes >= (it->closedOne ? capBytes : firstCapBytes)) {
      out.push_back(std::move(it->members));
      it->members.clear();
      it->bytes = 0;
      it->closedOne = true;
    }
  }
  for (auto& o : open) {
    if (!o.members.empty()) {
      out.push_back(std::move(o.members));
    }
  }
  // Launch order: the bucket whose first parameter comes first in `order`
  // (is ready first) goes first.
  std::vector<size_t> position(params.size(), 0);
  for (size_t k = 0; k < order.size(); ++k) {
    position[order[k]] = k;
  }
  std::stable_sort(out.begin(), out.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });
  return out;
}

// Why a post-hook on the grad accumulator (AccumulateGrad) and not
// Tensor::register_hook: a tensor hook runs before accumulation and sees
// only the incoming gradient, while the bucket needs what ends up in .grad
// (the sum over noSync steps, or the in-place sum into a bucket view); a
// post-hook runs once .grad holds it. Node::add_post_hook/del_post_hook,
// FunctionPostHook's signature and impl::grad_accumulator are the same in
// libtorch 1.13 and 2.x (register_post_accumulate_grad_hook, the 2.1+
// public form of this, does not exist in 1.13). The accumulator is held
// here, since a parameter only keeps a weak reference to it and would get
// a fresh one, without the hook, in the next forward.
class Reducer::ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::weak_ptr<Reducer> reducer, size_t index)
      : reducer_(std::move(reducer)), index_(index) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    // The Reducer may be gone while a graph built before still runs.
    if (auto r = reducer_.lock()) {
      r->onGradReady(index_);
    }
    return outputs;
  }

 private:
  std::weak_ptr<Reducer> reducer_;
  size_t index_;
};

Reducer::Reducer(std::shared_ptr<collectives::ProcessGroup> group,
                 Options options, std::vector<Param> params)
    : group_(std::move(group)),
      options_(options),
      params_(std::move(params)),
      cpu_(params_.empty() || params_.front().tensor.is_cpu()) {
  std::vector<size_t> order(params_.size());
  std::iota(order.rbegin(), order.rend(), size_t{0});  // reverse registration
  MutexLock lock(mu_);
  buildBuckets(order);
  resetIteration();
}

Reducer::~Reducer() {
  contextHook_.reset();
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    (void)accumulators_[i]->del_post_hook(hookKeys_[i]);
  }
}

void Reducer::install() {
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i].tensor);
    if (!acc) {
      throwError(Error::invalidArgument("DistributedDataParallel: parameter '" +
                                        params_[i].name +
                                        "' is not a leaf that requires grad"));
    }
    hookKeys_.push_back(
        acc->add_post_hook(std::make_unique<ReadyHook>(weak_from_this(), i)));
    accumulators_.push_back(std::move(acc));
  }
  if (params_.empty()) {
    return;
  }
  std::vector<at::Tensor> leaves;
  for (const auto& p : params_) {
    leaves.push_back(p.tensor);
  }
  std::weak_ptr<Reducer> self = weak_from_this();
  try {
    contextHook_ = dist_autograd::registerLeafGradientHook(
        std::move(leaves),
        [self](uint64_t contextId, std::vector<at::Tensor>& grads) {
          if (auto r = self.lock()) {
            r->onContextGradients(contextId, grads);
          }
        });
  } catch (const Exception& e) {
    throwError(e.error().withContext(
        "DistributedDataParallel: a parameter is already wrapped by another "
        "DistributedDataParallel"));
  }
}

void Reducer::buildBuckets(const std::vector<size_t>& order) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(params_.size());
  for (const auto& p : params_) {
    tensors.push_back(p.tensor);
  }
  const auto firstCap =
      static_cast<size_t>(std::max(0.0, options_.firstBucketCapMb) * kMiB);
  const auto cap =
      static_cast<size_t>(std::max(0.0, options_.bucketCapMb) * kMiB);
  auto assignment = assignBuckets(tensors, order, firstCap, cap);

  at::NoGradGuard noGrad;
  std::vector<Slot> slots(params_.size());
  std::vector<Bucket> buckets;
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket bucket;
    bucket.params = std::move(assignment[b]);
    int64_t numel = 0;
    for (size_t i : bucket.params) {
      numel += params_[i].tensor.numel();
    }
    bucket.numel = numel;
    const bool last = b + 1 == assignment.size();
    const int64_t flags = last ? static_cast<int64_t>(params_.size()) : 0;
    const at::Tensor& first = params_[bucket.params.front()].tensor;
    bucket.flat = at::zeros({numel + flags}, first.options());
    int64_t offset = 0;
    for (size_t i : bucket.params) {
      const at::Tensor& p = params_[i].tensor;
      slots[i].bucket = b;
      slots[i].view = aliasInto(bucket.flat, offset, p.sizes());
      offset += p.numel();
      if (options_.gradientAsBucketView) {
        // Keep what .grad holds; from now on it lives in the bucket.
        const at::Tensor& grad = p.grad();
        if (grad.defined()) {
          slots[i].view.copy_(grad);
          p.mutable_grad() = slots[i].view;
        }
      }
    }
    if (last) {
      flags_ = bucket.flat.narrow(0, numel, flags);
    }
    buckets.push_back(std::move(bucket));
  }
  if (buckets.empty()) {
    flags_ = at::Tensor();
  }
  buckets_ = std::move(buckets);
  slots_ = std::move(slots);
}

void Reducer::resetIteration() {
  nextBucket_ = 0;
  ready_.assign(params_.size(), 0);
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.work.reset();
    b.hooked.reset();
    b.flagsWork.reset();
  }
  for (auto& slot : slots_) {
    slot.reduced = at::Tensor();  // holds no .grad beyond the iteration
    slot.direct = false;
  }
  if (flags_.defined()) {
    at::NoGradGuard noGrad;
    flags_.zero_();
  }
  walkUnused_.clear();
  armed_ = false;
  hooksFired_ = false;
}

std::vector<size_t> Reducer::orderForRebuild() const {
  std::vector<size_t> order = readyOrder_;
  std::vector<char> seen(params_.size(), 0);
  for (size_t i : order) {
    seen[i] = 1;
  }
  // Parameters that were never ready keep their current relative order.
  for (const auto& b : buckets_) {
    for (size_t i : b.params) {
      if (!seen[i]) {
        order.push_back(i);
      }
    }
  }
  return order;
}

void Reducer::rebuildIfPending() {
  if (!rebuildPending_) {
    return;
  }
  rebuildPending_ = false;
  if (params_.empty()) {
    return;
  }
  // Every rank takes rank 0's order, so all build the same buckets.
  const std::vector<size_t> mine = orderForRebuild();
  at::Tensor order = at::empty({static_cast<int64_t>(mine.size())},
                               at::TensorOptions().dtype(at::kLong));
  for (size_t k = 0; k < mine.size(); ++k) {
    order.data_ptr<int64_t>()[k] = static_cast<int64_t>(mine[k]);
  }
  const at::Device device = params_.front().tensor.device();
  at::Tensor onDevice = order.to(device);
  group_->broadcast(onDevice, 0).wait();
  order = onDevice.cpu();
  std::vector<size_t> chosen(mine.size());
  std::vector<char> seen(params_.size(), 0);
  for (size_t k = 0; k < chosen.size(); ++k) {
    const int64_t v = order.data_ptr<int64_t>()[k];
    if (v < 0 || static_cast<size_t>(v) >= params_.size() || seen[v]) {
      throwError(Error::internal(
          "DistributedDataParallel: rank 0's bucket order is not a "
          "permutation of the parameters"));
    }
    seen[v] = 1;
    chosen[k] = static_cast<size_t>(v);
  }
  buildBuckets(chosen);
}

void Reducer::endRecording() {
  if (recording_) {
    recording_ = false;
    rebuildPending_ = true;
  }
}

void Reducer::beginIteration(bool armed, double gradScale) {
  MutexLock lock(mu_);
  if (armed_ && hooksFired_) {
    // A backward started reducing and never reached its end (it threw
    // midway): some ranks may have issued allreduces this one did not.
    resetIteration();
    throwError(Error(Code::kFailedPrecondition,
                     "DistributedDataParallel: the previous backward pass "
                     "ended before its gradient reduction finished (it "
                     "failed midway); the ranks' collectives may be out of "
                     "step: create a new ProcessGroup and model wrapper"));
  }
  started_ = true;
  rebuildIfPending();
  resetIteration();
  reducedContext_ = 0;
  armed_ = armed && !params_.empty();
  gradScale_ = gradScale;
  if (armed_ && staticUnused_) {
    walkUnused_ = *staticUnused_;
  }
}

bool Reducer::walkNeeded() const {
  MutexLock lock(mu_);
  return !staticUnused_.has_value();
}

Error Reducer::unusedGotGradient(size_t index) const {
  return Error(Code::kFailedPrecondition,
               "DistributedDataParallel: parameter '" + params_[index].name +
                   "' got a gradient although " +
                   (staticUnused_ ? "the first iteration's graph did not "
                                    "reach it (staticGraph): the set of "
                                    "parameters forward uses changed"
                                  : "the autograd graph from forward's "
                                    "outputs does not reach it "
                                    "(findUnusedParameters): the loss must "
                                    "depend on forward's outputs only"));
}

void Reducer::shadowIteration() {
  MutexLock lock(mu_);
  rebuildIfPending();
  resetIteration();
  if (params_.empty()) {
    return;
  }
  // Fresh zeros: the buckets' own memory may be this rank's .grad
  // (gradientAsBucketView). All are issued before any wait, as an armed
  // backward issues them; they go through the comm hook when there is one.
  started_ = true;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    Bucket& bucket = buckets_[k];
    at::Tensor zeros = at::zeros_like(bucket.flat);
    const bool last = k + 1 == buckets_.size();
    launch(k, zeros,
           last && flags_.defined()
               ? zeros.narrow(0, bucket.numel, zeros.numel() - bucket.numel)
               : at::Tensor(),
           /*fromSlots=*/false);
  }
  try {
    for (auto& bucket : buckets_) {
      await(bucket);
    }
  } catch (...) {
    resetIteration();
    throw;
  }
  resetIteration();
  endRecording();
}

void Reducer::findUnused(const std::vector<at::Tensor>& outputs) {
  MutexLock lock(mu_);
  if (!armed_) {
    return;
  }
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& t : outputs) {
    if (!t.defined() || !t.requires_grad()) {
      continue;
    }
    auto fn = torch::autograd::impl::gradient_edge(t).function;
    if (fn && seen.insert(fn.get()).second) {
      stack.push_back(fn.get());
    }
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      if (edge.function && seen.insert(edge.function.get()).second) {
        stack.push_back(edge.function.get());
      }
    }
  }
  walkUnused_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!seen.count(accumulators_[i].get())) {
      walkUnused_.push_back(i);
    }
  }
  if (options_.staticGraph) {
    staticUnused_ = walkUnused_;
  }
}

void Reducer::onGradReady(size_t index) {
  MutexLock lock(mu_);
  if (!armed_) {
    return;  // noSync, no grad mode at forward, or after this step's end
  }
  if (!hooksFired_) {
    hooksFired_ = true;
    queueFinalize();
    for (size_t i : walkUnused_) {
      markReady(i, /*local=*/false);
    }
  }
  if (ready_[index]) {
    const bool fromWalk = std::find(walkUnused_.begin(), walkUnused_.end(),
                                    index) != walkUnused_.end();
    if (fromWalk) {
      throwError(unusedGotGradient(index));
    }
    throwError(Error(Code::kFailedPrecondition,
                     "DistributedDataParallel: parameter '" +
                         params_[index].name +
                         "' got its gradient twice in one backward pass "
                         "(reentrant backward, or two backward passes after "
                         "one forward)"));
  }
  markReady(index, /*local=*/true);
}

void Reducer::onContextGradients(uint64_t contextId,
                                 std::vector<at::Tensor>& grads) {
  MutexLock lock(mu_);
  if (hooksFired_ || (!armed_ && reducedContext_ == contextId)) {
    throwError(Error(
        Code::kFailedPrecondition,
        "DistributedDataParallel: the parameters got gradients twice in one "
        "backward pass (two engine runs of a distributed-autograd context "
        "reached them, or a local and a distributed backward after one "
        "forward): under distributed autograd, the graph from the loss to "
        "the DDP module's parameters must be on this rank (send its inputs "
        "over RPC, not its outputs)"));
  }
  if (!armed_) {
    return;  // noSync or no grad mode at forward: the context sums them
  }
  hooksFired_ = true;
  reducedContext_ = contextId;
  contextGrads_ = &grads;
  struct Clear {
    Reducer& r;
    ~Clear() TRELLIS_NO_THREAD_SAFETY_ANALYSIS { r.contextGrads_ = nullptr; }
  } clear{*this};
  // All at once: in reverse registration order, the order a local backward
  // usually makes them ready (it is what the bucket rebuild records).
  for (size_t i = params_.size(); i-- > 0;) {
    if (grads[i].defined()) {
      if (std::find(walkUnused_.begin(), walkUnused_.end(), i) !=
          walkUnused_.end()) {
        throwError(unusedGotGradient(i));
      }
      markReady(i, /*local=*/true);
    }
  }
  finalizeLocked();
}

const at::Tensor& Reducer::gradOf(size_t index) const {
  return contextGrads_ != nullptr ? (*contextGrads_)[index]
                                  : params_[index].tensor.grad();
}

void Reducer::queueFinalize() {
  // Runs once the whole backward pass is done, on the thread that finishes
  // it; what it throws is thrown by backward(). Only the weak reference:
  // the engine may outlive this Reducer.
  std::weak_ptr<Reducer> self = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([self] {
    if (auto r = self.lock()) {
      r->finalize();
    }
  });
}

void Reducer::markReady(size_t index, bool local) {
  at::NoGradGuard noGrad;
  ready_[index] = 1;
  if (recording_) {
    readyOrder_.push_back(index);
  }
  const at::Tensor& param = params_[index].tensor;
  const at::Tensor& grad = gradOf(index);
  at::Tensor& view = slots_[index].view;
  slots_[index].reduced = view;
  slots_[index].direct = false;
  if (grad.defined() && grad.is_sparse()) {
    throwError(Error(Code::kUnimplemented,
                     "DistributedDataParallel: parameter '" +
                         params_[index].name +
                         "' has a sparse gradient; only dense ones are "
                         "reduced"));
  }
  if (options_.gradientAsBucketView && contextGrads_ == nullptr) {
    if (!grad.defined()) {
      view.zero_();
    } else if (!grad.is_alias_of(view) || grad.data_ptr() != view.data_ptr()) {
      // .grad was replaced (zero_grad to none, or set by the program):
      // one copy, and it is a view again.
      view.copy_(grad);
      param.mutable_grad() = view;
    }
  } else if (grad.defined()) {
    if (cpu_ && !hook_ && contextGrads_ == nullptr && grad.is_contiguous() &&
        grad.scalar_type() == param.scalar_type() &&
        grad.sizes() == param.sizes() && grad.is_cpu()) {
      // Reduced where it is (launch): neither copied into the bucket now
      // nor back at the end. A parameter's gradient is final once its
      // hook fired, so nothing writes it while the group reads it.
      slots_[index].reduced = grad;
      slots_[index].direct = true;
    } else {
      view.copy_(grad);
    }
  } else {
    view.zero_();
  }
  if (!local) {
    flags_[static_cast<int64_t>(index)].fill_(1);
  }
  Bucket& bucket = buckets_[slots_[index].bucket];
  if (--bucket.pending == 0) {
    launchReadyBuckets();
  }
}

void Reducer::launchReadyBuckets() {
  // Strictly in bucket order: every rank issues the same sequence of
  // allreduces whatever order its gradients come in.
  while (nextBucket_ < buckets_.size() && buckets_[nextBucket_].pending == 0) {
    const size_t k = nextBucket_++;
    launch(k, buckets_[k].flat,
           k + 1 == buckets_.size() ? flags_ : at::Tensor(),
           /*fromSlots=*/true);
  }
}

void Reducer::separateOverlaps(Bucket& b) {
  struct Range {
    uintptr_t begin, end;
    size_t param;  // SIZE_MAX: the bucket's own memory
  };
  std::vector<Range> ranges;
  const auto add = [&](const at::Tensor& t, size_t param) {
    if (t.numel() > 0) {
      const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
      ranges.push_back({begin, begin + bytesOf(t), param});
    }
  };
  add(b.flat, SIZE_MAX);
  for (size_t i : b.params) {
    if (slots_[i].direct) {
      add(slots_[i].reduced, i);
    }
  }
  if (ranges.size() < 2) {
    return;
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& x, const Range& y) { return x.begin < y.begin; });
  std::vector<size_t> copies;
  uintptr_t end = ranges[0].end;
  for (size_t r = 1; r < ranges.size(); ++r) {
    if (ranges[r].begin < end) {
      for (size_t q : {r - 1, r}) {
        if (ranges[q].param != SIZE_MAX) {
          copies.push_back(ranges[q].param);
        }
      }
    }
    end = std::max(end, ranges[r].end);
  }
  for (size_t i : copies) {
    Slot& slot = slots_[i];
    if (slot.direct) {
      slot.view.copy_(slot.reduced);
      slot.reduced = slot.view;
      slot.direct = false;
    }
  }
}

void Reducer::launch(size_t k, const at::Tensor& flat, const at::Tensor& flags,
                     bool fromSlots) {
  Bucket& b = buckets_[k];
  if (!hook_) {
    if (!cpu_) {
      b.work = group_->allreduce(flat, collectives::ReduceOp::kAvg);
      return;
    }
    std::vector<at::Tensor> tensors;
    if (fromSlots) {
      separateOverlaps(b);
    }
    const bool anyDirect =
        fromSlots && std::any_of(b.params.begin(), b.params.end(),
                                 [&](size_t i) { return slots_[i].direct; });
    if (anyDirect) {
      for (size_t i : b.params) {
        tensors.push_back(slots_[i].reduced);
      }
      if (flags.defined()) {
        tensors.push_back(flags);
      }
    } else {
      // Everything is in the bucket (its slots, then the flags): one piece.
      tensors.push_back(flat);
    }
    b.work = group_->allreduceCoalesced(std::move(tensors),
                                        collectives::ReduceOp::kAvg);
    return;
  }
  GradBucket view;
  view.index = k;
  view.buffer = flat.narrow(0, 0, b.numel);
  for (size_t i : b.params) {
    view.parameters.push_back(params_[i].tensor);
    view.parameterNames.push_back(params_[i].name);
  }
  view.isLast = k + 1 == buckets_.size();
  view.processGroup = group_;
  at::Tensor buffer = view.buffer;
  // The hook's reduced tensor is copied into the slots at the end.
  b.hooked = hook_(view).then([buffer](const at::Tensor& out) {
    if (!out.defined() || out.numel() != buffer.numel()) {
      throwError(Error::invalidArgument(
          "DistributedDataParallel: a comm hook's result has " +
          std::to_string(out.defined() ? out.numel() : 0) +
          " elements, its bucket " + std::to_string(buffer.numel())));
    }
    if (!out.is_same(buffer)) {
      at::NoGradGuard noGrad;
      buffer.copy_(out.reshape({-1}));
    }
    return buffer;
  });
  if (flags.defined()) {
    b.flagsWork = group_->allreduce(flags, collectives::ReduceOp::kAvg);
  }
}

void Reducer::await(Bucket& b) {
  if (b.work) {
    b.work->wait();  // bounded by the group's timeout (work.h)
  }
  if (b.hooked) {
    // The hook's collectives are bounded by the group's timeout; a hook
    // that never completes its future is bounded here.
    (void)b.hooked->wait(group_->timeout());
  }
  if (b.flagsWork) {
    b.flagsWork->wait();
  }
}

void Reducer::setCommHook(CommHook hook) {
  MutexLock lock(mu_);
  if (!hook) {
    throwError(Error::invalidArgument(
        "DistributedDataParallel: registerCommHook with a null hook"));
  }
  if (hook_ || started_) {
    throwError(Error(Code::kFailedPrecondition,
                     "DistributedDataParallel: registerCommHook must come "
                     "before the first forward, once"));
  }
  hook_ = std::move(hook);
}

void Reducer::finalize() {
  MutexLock lock(mu_);
  if (!armed_) {
    return;
  }
  finalizeLocked();
}

void Reducer::finalizeLocked() {
  // Parameters without a gradient in this backward: their contribution is
  // their .grad (zero without one), and they are flagged.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) {
      markReady(i, /*local=*/false);
    }
  }
  for (auto& b : buckets_) {
    try {
      await(b);
    } catch (...) {
      resetIteration();
      throw;
    }
  }
  // Each flag is now the fraction of ranks without a gradient for that
  // parameter (the allreduce averaged it): 0 none, 1 all of them.
  at::NoGradGuard noGrad;
  const at::Tensor missing = flags_.to(at::kDouble).cpu();
  const double* fraction = missing.data_ptr<double>();
  const int worldSize = group_->size();
  std::vector<std::string> unused;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& param = params_[i].tensor;
    const at::Tensor& grad = gradOf(i);
    at::Tensor& view = slots_[i].view;
    if (fraction[i] != 0) {
      const long ranks = std::lround(fraction[i] * worldSize);
      unused.push_back(params_[i].name + " (" + std::to_string(ranks) + " of " +
                       std::to_string(worldSize) + " ranks)");
    }
    if (slots_[i].direct) {
      // The average is already in .grad.
      if (gradScale_ != 1.0) {
        slots_[i].reduced.mul_(gradScale_);
      }
      continue;
    }
    if (gradScale_ != 1.0) {
      view.mul_(gradScale_);
    }
    if (fraction[i] == 1 && !grad.defined()) {
      continue;  // no rank has a gradient: none is made up
    }
    if (contextGrads_ != nullptr) {
      // The context keeps it beyond this iteration: not the bucket's memory.
      (*contextGrads_)[i] = view.clone();
    } else if (options_.gradientAsBucketView) {
      if (!grad.defined() || grad.data_ptr() != view.data_ptr()) {
        param.mutable_grad() = view;
      }
    } else if (grad.defined()) {
      grad.copy_(view);
    } else {
      param.mutable_grad() = view.clone();
    }
  }
  endRecording();
  resetIteration();
  if (!unused.empty() && !options_.findUnusedParameters) {
    std::ostringstream msg;
    msg << "DistributedDataParallel: parameters that got no gradient in this "
           "backward pass: ";
    for (size_t k = 0; k < unused.size(); ++k) {
      msg << (k ? ", " : "") << unused[k];
    }
    msg << ". Forward did not use them (a branch not taken?) or the loss does "
           "not depend on all of forward's outputs. Set "
           "Options::findUnusedParameters if some parameters may go unused, "
           "or take them out of the module";
    throwError(Error(Code::kFailedPrecondition, msg.str()));
  }
}

void Reducer::enterNoSync() {
  MutexLock lock(mu_);
  ++noSyncDepth_;
}

void Reducer::exitNoSync() {
  MutexLock lock(mu_);
  --noSyncDepth_;
}

bool Reducer::syncing() const {
  MutexLock lock(mu_);
  return noSyncDepth_ == 0;
}

std::vector<std::vector<std::string>> Reducer::bucketNames() const {
  MutexLock lock(mu_);
  std::vector<std::vector<std::string>> out;
  for (const auto& b : buckets_) {
    std::vector<std::string> names;
    for (size_t i : b.params) {
      names.push_back(params_[i].name);
    }
    out.push_back(std::move(names));
  }
  return out;
}

}  // namespace trellis::ddp::detail
