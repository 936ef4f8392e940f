#pragma once

// Distributed autograd over RPC (docs/dist_autograd.md).
//
//   trellis::dist_autograd::Context ctx;
//   auto rows = server.rpcSync<&Server::lookup>(ids, offsets);
//   auto loss = torch::binary_cross_entropy_with_logits(mlp(rows), labels);
//   ctx.backward({loss});                 // runs on every worker involved
//   auto grads = ctx.gradients();         // this worker's share
//
// Contract
//  - A Context makes its id the calling thread's current context for its
//    scope. Every RPC made on that thread inside it (rpcSync, rpcAsync,
//    remote, RRef method calls and toHere) carries the id; user functions
//    run for such a request are inside the same context on the callee, so
//    their own calls join it too. Callbacks of futures (then()) are not.
//  - A message whose arguments or result hold tensors that require grad
//    records a send function on the sender and makes the received tensors
//    non-leaves whose gradient flows back to the sender during backward.
//  - backward(roots) runs the FAST-mode algorithm: each worker runs its part
//    of the graph when gradients for it arrive; gradients of leaves are
//    summed into the context on the worker that holds the leaf, never into
//    .grad. It returns once every worker has finished its part. A failure on
//    any worker (an exception in a backward function, a dead worker, a
//    timeout) makes it throw that error (naming the worker), and the context
//    is released on every worker it reached.
//  - Without retainGraph, each part of the graph can be walked by one
//    backward only; a second backward through the same context fails with
//    FailedPreconditionError.
//  - Destroying the Context releases it here and, asynchronously, on every
//    worker it reached (liveContextCount() counts them).
//  - Thread safety: contexts are independent; many may be alive at once on
//    different threads. One Context object is used by one thread.

#include <ATen/core/Tensor.h>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include <trellis/core/deadline.h>
#include <trellis/core/future.h>

namespace trellis::rpc {
class Agent;
class AutogradContextScope;
}  // namespace trellis::rpc

namespace trellis::dist_autograd {

// Gradients one worker accumulated in one context, by tensor identity (the
// leaf itself, not its value).
class GradientMap {
 public:
  // The gradient of `t`, or an undefined tensor when none reached it.
  at::Tensor find(const at::Tensor& t) const;
  // Throws NotFoundError when `t` has no gradient here.
  at::Tensor at(const at::Tensor& t) const;
  bool contains(const at::Tensor& t) const { return find(t).defined(); }
  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }

  struct Entry {
    at::Tensor tensor;    // the leaf
    at::Tensor gradient;  // summed over this context's backward passes
  };
  auto begin() const { return entries_.begin(); }
  auto end() const { return entries_.end(); }

  // Used by the implementation.
  void add(const at::Tensor& t, at::Tensor gradient);

 private:
  std::unordered_map<const void*, Entry> entries_;  // by TensorImpl
};

class Context {
 public:
  // A new context on `agent` (default: rpc::Agent::current()), current on
  // this thread until destroyed. Throws FailedPreconditionError when the
  // agent has no distributed-autograd support (it was started before this
  // library was loaded).
  Context();
  explicit Context(rpc::Agent& agent);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // Unique in the group: the creating worker's rank in the top 16 bits.
  uint64_t id() const { return id_; }

  // See dist_autograd::backward.
  void backward(const std::vector<at::Tensor>& roots, bool retainGraph = false);
  // This worker's gradients (see getGradients).
  GradientMap gradients() const;

 private:
  std::shared_ptr<rpc::Agent> agent_;
  uint64_t id_ = 0;
  std::unique_ptr<rpc::AutogradContextScope> scope_;
};

// Runs the distributed backward pass of `contextId` from `roots` (scalars
// that require grad; each is seeded with 1) and returns when every worker
// has finished. `contextId` must have been created on this worker. Throws
// as described above; InvalidArgumentError for a bad root.
void backward(uint64_t contextId, const std::vector<at::Tensor>& roots,
              bool retainGraph = false);

// The gradients this worker accumulated in `contextId`. Throws
// NotFoundError when the context is not alive on this worker.
GradientMap getGradients(uint64_t contextId);

// The calling thread's current context id; 0 when there is none.
uint64_t currentContextId();

// Contexts alive on the current agent / on `agent` (tests, leak checks).
size_t liveContextCount();
size_t liveContextCount(rpc::Agent& agent);

// ---- Leaf-gradient hooks (for libraries: DDP uses them) --------------------
//
// A hook over a fixed list of leaves (tensors that require grad). Each time
// this worker's part of a context's backward runs (FAST mode runs it once
// from the roots on the initiator, and once per arriving message
// elsewhere) and its graph reaches at least one of those leaves, the hook
// gets their gradients from that run, parallel to the list (undefined
// where the run produced none) and may replace them before they are summed
// into the context; an undefined entry adds nothing. It runs on the thread
// that ran the engine, after that run's gradients for other workers have
// been sent, so work it does (DDP's allreduce) overlaps theirs. What it
// throws fails the backward on every worker. A leaf belongs to at most
// one hook at a time. Hooks are process-wide (every agent's contexts).
using LeafGradientHook =
    std::function<void(uint64_t contextId, std::vector<at::Tensor>& gradients)>;

// The same, for work that may complete later (OptimizerInBackward's step,
// which may wait for other contexts): this worker's part of the backward
// completes only when the returned future does, and fails with it. `agent`
// is the worker whose backward part runs.
using AsyncLeafGradientHook = std::function<Future<void>(
    rpc::Agent& agent, uint64_t contextId, std::vector<at::Tensor>& gradients)>;

// Keeps a hook registered; removing it waits for no run in progress, so
// the hook must stay valid (hold a weak reference to its owner).
class LeafGradientHookHandle {
 public:
  LeafGradientHookHandle() = default;
  ~LeafGradientHookHandle() { reset(); }
  LeafGradientHookHandle(LeafGradientHookHandle&& other) noexcept
      : key_(std::exchange(other.key_, 0)) {}
  LeafGradientHookHandle& operator=(LeafGradientHookHandle&& other) noexcept;
  LeafGradientHookHandle(const LeafGradientHookHandle&) = delete;
  LeafGradientHookHandle& operator=(const LeafGradientHookHandle&) = delete;

  // Unregisters (idempotent).
  void reset();
  bool registered() const { return key_ != 0; }

 private:
  friend LeafGradientHookHandle registerLeafGradientHook(
      std::vector<at::Tensor>, LeafGradientHook);
  friend LeafGradientHookHandle registerAsyncLeafGradientHook(
      std::vector<at::Tensor>, AsyncLeafGradientHook);
  explicit LeafGradientHookHandle(uint64_t key) : key_(key) {}
  uint64_t key_ = 0;
};

// InvalidArgumentError for an empty list, an undefined tensor, a tensor
// that is not a leaf requiring grad, a tensor listed twice, or one that
// already belongs to a hook.
LeafGradientHookHandle registerLeafGradientHook(std::vector<at::Tensor> leaves,
                                                LeafGradientHook hook);
LeafGradientHookHandle registerAsyncLeafGradientHook(
    std::vector<at::Tensor> leaves, AsyncLeafGradientHook hook);

}  // namespace trellis::dist_autograd
