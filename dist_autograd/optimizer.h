#pragma once

// DistributedOptimizer: steps torch::optim optimizers on the workers that
// own the parameters, with one context's gradients (docs/dist_autograd.md).
//
//   DistributedOptimizer opt(SGD{.lr = 0.05, .momentum = 0.9},
//                            server.rpcSync<&Server::parameterRRefs>());
//   for (...) {
//     Context ctx;
//     ... forward through RPC ...
//     ctx.backward({loss});
//     opt.step(ctx);
//   }
//
// Contract
//  - The constructor creates one local optimizer per owner (remote() on
//    that worker, this one included, holding the owner's own parameter
//    tensors, so optimizer state such as momentum lives there) and waits
//    until every owner has built it; it throws the first failure, naming
//    the owner: a RemoteError for a parameter that is not a floating-point
//    tensor, a parameter listed twice, a parameter whose remote() failed,
//    or options torch::optim rejects; a TimeoutError naming the owners that
//    did not answer in time. InvalidArgumentError for an empty list, an
//    empty RRef, or RRefs of different agents. It runs outside any
//    distributed-autograd context.
//  - step(contextId) runs, on every owner in parallel, torch::optim's step
//    with the gradients that worker accumulated in `contextId`; parameters
//    without a gradient there are left as they are, and so is every
//    parameter of an owner the context never reached. It returns when all
//    owners are done and throws the first failure (RemoteError naming the
//    owner). During its step an owner's .grad fields hold the context's
//    gradients; the previous ones (normally undefined) are put back
//    afterwards, also when the step fails. The step messages are sent
//    outside the context (they do not join it).
//  - On each owner, the step waits until no other context's backward pass
//    still needs the owner's parameter values as they are (a context that
//    ran a forward there and has not finished its backward or been
//    released); meanwhile new requests of other contexts wait on that owner
//    (docs/dist_autograd.md, "Steps and backward passes"). When that wait
//    outlasts the timeout, step throws TimeoutError naming the owner and
//    the contexts it waited for, and that owner's parameters are unchanged.
//  - `timeout` bounds each call and each wait (unset: the agent's default
//    call timeout; zero: none; negative: InvalidArgumentError).
//  - The update equals torch::optim's for the same gradients: the local
//    optimizers are torch::optim::SGD / Adagrad / Adam. Sparse gradients
//    (embedding_bag with sparse=true) work with SGD without momentum or
//    weight decay and with Adagrad without weight decay, as in torch::optim.
//  - Steps on one worker are serialised by one lock per process (as torch's
//    _LocalOptimizer.global_lock), so several trainers stepping the same
//    DistributedOptimizer, or different ones sharing parameters, never
//    interleave their updates.
//  - Thread safety: step() may be called from several threads.

#include <ATen/core/Tensor.h>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <trellis/core/deadline.h>
#include <trellis/dist_autograd/dist_autograd.h>
#include <trellis/rref/rref.h>

namespace trellis::dist_autograd {

class Context;

// Options with torch::optim's names and defaults.
struct SGD {
  double lr = 0.01;
  double momentum = 0;
  double dampening = 0;
  double weightDecay = 0;
  bool nesterov = false;
};
struct Adagrad {
  double lr = 0.01;
  double lrDecay = 0;
  double weightDecay = 0;
  double initialAccumulatorValue = 0;
  double eps = 1e-10;
};
struct Adam {
  double lr = 0.001;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weightDecay = 0;
  bool amsgrad = false;
};
using OptimizerSpec = std::variant<SGD, Adagrad, Adam>;

// RRefs owned by this worker for tensors it holds (torch's
// `[RRef(p) for p in module.parameters()]`).
std::vector<rpc::RRef<at::Tensor>> localParameters(
    const std::vector<at::Tensor>& tensors);

class DistributedOptimizer {
 public:
  DistributedOptimizer(OptimizerSpec spec,
                       std::vector<rpc::RRef<at::Tensor>> parameters,
                       std::optional<Duration> timeout = std::nullopt);
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  void step(const Context& context);
  // The same by id (a context made on another thread, or torch-style code
  // that passes ids around).
  void step(uint64_t contextId);

  // Number of owners (local optimizers).
  size_t numOwners() const;

  // The local optimizers' state (momentum buffers, Adagrad sums, Adam
  // moments): one serialized torch::optim state per owner, in owner order,
  // for checkpoints. A restarted trainer builds the same DistributedOptimizer
  // (same parameters, same order) and loads it back. Bounded like step();
  // not concurrently with a step of this optimizer.
  std::vector<std::string> stateDict() const;
  // InvalidArgumentError when the count is not numOwners(); an error
  // naming the owner that refuses its part: not one stateDict() returned
  // (each part carries a checksum, checked before libtorch reads it), or
  // shapes that do not match.
  void loadStateDict(const std::vector<std::string>& state);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// ---- Stepping parameters inside the backward pass ---------------------------
//
// OptimizerInBackward: steps parameters this worker holds inside each
// distributed backward pass that reaches them, instead of in a later
// DistributedOptimizer::step: what TorchRec's fused optimizers do for
// embedding tables, and torch.distributed.optim's
// _apply_optimizer_in_backward for local parameters. It saves the step's
// round trip to the owner, and the step overlaps the rest of the backward
// (docs/dist_autograd.md, "Stepping inside the backward pass").
//
//   // on a parameter server, over the tables it holds:
//   OptimizerInBackward tables(Adagrad{.lr = 0.1}, {weight});
//   // on the trainers: a DistributedOptimizer over the other parameters
//
// Contract
//  - Each time this worker's part of a context's backward pass runs (once
//    per gradient message that arrives here; on the context's creator, its
//    own part) and produces gradients for some of `params`, those are
//    stepped with those gradients, with torch::optim and the same options
//    and update as DistributedOptimizer's; that part of the backward
//    completes after the step, so when ctx.backward() returns every step
//    it caused is applied. The gradients do not go into the context
//    (getGradients has none for them).
//  - One step per gradient message: a context whose forward reached these
//    parameters through two RPCs to this worker steps them twice, each
//    time with one message's gradient, where torch::optim would step once
//    with the sum. It suits parameters that a step's forward reaches once
//    per worker (one lookup per server and step, as in
//    examples/hybrid_training.cc).
//  - The step waits like a DistributedOptimizer step on this worker until
//    no other context's backward still needs the parameters' values (the
//    step gate, docs/dist_autograd.md), up to `timeout` less a margin
//    (unset: the agent's call timeout; zero: no limit). Past it that
//    backward fails with a DEADLINE_EXCEEDED error naming the contexts it
//    waited for, and the parameters are unchanged. Parameters that only
//    step-safe functions use never wait.
//  - What the step throws (torch::optim::Adagrad refusing weight decay
//    with a sparse gradient, say) fails the backward, naming this worker.
//    A backward that fails for any reason may still have stepped some
//    parameters (on other workers, or here before the failure), as a
//    failed DistributedOptimizer::step may have stepped some owners.
//  - InvalidArgumentError for an empty list, a tensor that is not a
//    floating-point leaf requiring grad, a tensor listed twice or one that
//    already has a leaf-gradient hook (DDP's parameters, another
//    OptimizerInBackward's), options torch::optim refuses, or a negative
//    timeout. While this object lives, a DistributedOptimizer refuses
//    these parameters.
//  - Steps serialise with the DistributedOptimizer steps of this process
//    (one lock). Destruction unregisters: later backward passes put the
//    gradients into the context again; a step under way finishes.
//  - stateDict()/loadStateDict(): the torch::optim state for checkpoints,
//    sealed as DistributedOptimizer's parts are; loading refuses anything
//    stateDict() did not return. Not concurrently with a backward pass
//    that reaches the parameters.
class OptimizerInBackward {
 public:
  OptimizerInBackward(OptimizerSpec spec, std::vector<at::Tensor> params,
                      std::optional<Duration> timeout = std::nullopt);
  ~OptimizerInBackward();
  OptimizerInBackward(const OptimizerInBackward&) = delete;
  OptimizerInBackward& operator=(const OptimizerInBackward&) = delete;

  std::string stateDict() const;
  void loadStateDict(const std::string& state);

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
  LeafGradientHookHandle hook_;
};

}  // namespace trellis::dist_autograd
