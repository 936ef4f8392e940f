// Distributed autograd on one worker (docs/dist_autograd.md): the send and
// receive graph nodes, the per-agent container of contexts (dist_autograd's
// rpc agent extension, which also admits requests through the step gate),
// and the backward pass across workers. Over 600 lines: the three share
// ContextState and its locking rules, which read best side by side; the
// gate's own logic is in step_gate.cc, the message checks in messages.cc.

#include <ATen/ops/ones_like.h>
#include <algorithm>
#include <atomic>
#include <deque>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include <trellis/core/error.h>
#include <trellis/core/logging.h>
#include <trellis/core/mutex.h>
#include <trellis/dist_autograd/dist_autograd.h>
#include <trellis/dist_autograd/messages.h>
#include <trellis/dist_autograd/step_gate.h>
#include <trellis/rpc/agent.h>
#include <trellis/rpc/autograd_hooks.h>
#include <trellis/rpc/extension.h>
#include <trellis/rpc/rpc.h>

namespace trellis::dist_autograd {

namespace detail {
// Built-in requests (registered at the end of this file).
Future<bool> propagateGradients(uint64_t contextId, uint64_t messageId,
                                bool retainGraph,
                                std::vector<at::Tensor> gradients);
bool releaseContext(uint64_t contextId, int32_t from);
}  // namespace detail
}  // namespace trellis::dist_autograd

TRELLIS_REMOTE_FUNCTION(trellis::dist_autograd::detail::propagateGradients);
TRELLIS_REMOTE_FUNCTION(trellis::dist_autograd::detail::releaseContext);
// Both stay on worker threads: gradients run this worker's part of the
// backward, and a release frees the context's graph (autograd nodes, saved
// tensors), whose last references the workers that ran its requests may
// have dropped just before. Freeing it on the loop raced with those drops
// under ThreadSanitizer (the pool's queue ordered them before).

namespace trellis::dist_autograd {
namespace {

namespace ag = torch::autograd;
using rpc::Agent;

using detail::checkContextId;
using detail::contextName;
using detail::kCounterBits;
using detail::kCounterMask;
// Released context ids remembered per worker, so that a message that
// trails its context's release is refused instead of re-creating it.
constexpr size_t kMaxTombstones = 1 << 16;

// The sender's end of one message: the gradients of the tensors it carried
// (that required grad) enter the local graph here. apply() passes them on
// to the tensors' own grad_fns / accumulators.
class SendRpcBackward : public ag::Node {
 public:
  SendRpcBackward(ag::edge_list&& next, int32_t peer, detail::SentTensors sent)
      : Node(std::move(next)), peer_(peer), sent_(std::move(sent)) {}

  ag::variable_list apply(ag::variable_list&& grads) override {
    return std::move(grads);
  }
  std::string name() const override {
    return "trellis::dist_autograd::SendRpcBackward";
  }

  int32_t peer() const { return peer_; }
  // Set by the first gradient that arrives (the gate counts it once).
  bool markAnswered() { return !answered_.exchange(true); }
  // Checks gradients that arrived from the network against what was sent.
  Error check(const std::vector<at::Tensor>& grads) const {
    return detail::checkGradients(sent_, grads);
  }

 private:
  int32_t peer_;
  detail::SentTensors sent_;
  std::atomic<bool> answered_{false};
};

// The receiver's end: grad_fn of the tensors a message brought. The
// engine never runs it: backward captures the gradient flowing into it and
// sends that to the sender's SendRpcBackward.
class RecvRpcBackward : public ag::Node {
 public:
  RecvRpcBackward(uint64_t contextId, int32_t peer, uint64_t messageId)
      : contextId_(contextId), peer_(peer), messageId_(messageId) {}

  ag::variable_list apply(ag::variable_list&&) override {
    throwError(
        Error(Code::kFailedPrecondition,
              "this tensor came over RPC in distributed-autograd " +
                  contextName(contextId_) +
                  ": run dist_autograd::backward on that context instead of a "
                  "local backward()"));
  }
  std::string name() const override {
    return "trellis::dist_autograd::RecvRpcBackward";
  }

  uint64_t contextId() const { return contextId_; }
  int32_t peer() const { return peer_; }
  uint64_t messageId() const { return messageId_; }

 private:
  uint64_t contextId_;
  int32_t peer_;
  uint64_t messageId_;
};

// One context on one worker.
struct ContextState {
  explicit ContextState(uint64_t id) : id(id), slot(id) {}
  const uint64_t id;
  // Its standing in the worker's StepGate (guarded by the gate).
  detail::GateSlot slot;
  std::shared_ptr<detail::GateSlot> gateSlot(
      const std::shared_ptr<ContextState>& self) {
    return {self, &slot};  // aliasing: no allocation
  }

  Mutex mu;
  std::unordered_map<uint64_t, std::shared_ptr<SendRpcBackward>> sends
      TRELLIS_GUARDED_BY(mu);
  std::unordered_set<int32_t> knownWorkers TRELLIS_GUARDED_BY(mu);
  GradientMap gradients TRELLIS_GUARDED_BY(mu);
  // The initiator ran a backward without retainGraph.
  bool graphFreed TRELLIS_GUARDED_BY(mu) = false;

  // One engine run at a time per context on this worker: the runs of one
  // context share nodes (a tensor sent twice), and gradients are summed in
  // `gradients` after each.
  Mutex engineMu;
};

class Receiver : public rpc::GradReceiver {
 public:
  Receiver(uint64_t contextId, int32_t peer, uint64_t messageId)
      : contextId_(contextId), peer_(peer), messageId_(messageId) {}
  void attach(at::Tensor& t) override {
    if (node_ == nullptr) {
      node_ = std::make_shared<RecvRpcBackward>(contextId_, peer_, messageId_);
    }
    ag::set_history(t, node_);
  }

 private:
  uint64_t contextId_;
  int32_t peer_;
  uint64_t messageId_;
  std::shared_ptr<RecvRpcBackward> node_;
};

// The per-agent container of contexts: dist_autograd/'s agent extension
// (rpc/extension.h), made when the agent starts.
class Container : public rpc::detail::AgentExtension {
 public:
  explicit Container(Agent& agent) : agent_(agent), gate_(agent.self().name) {}

  std::string_view name() const override { return "dist_autograd"; }
  void onSend(rpc::detail::OutgoingMessage& m) override {
    m.autogradMessageId =
        recordSend(m.autogradContextId, m.peer, *m.gradTensors, m.stepSafe);
    m.autogradRecorded = true;
  }
  void onReceive(rpc::detail::IncomingMessage& m) override {
    m.gradReceiver =
        recordRecv(m.autogradContextId, m.peer, m.autogradMessageId);
    m.autogradRecorded = true;
  }

  int32_t rank() const { return agent_.self().rank; }
  Agent& agent() const { return agent_; }
  detail::StepGate& gate() { return gate_; }

  uint64_t newContext() {
    const uint64_t id =
        (static_cast<uint64_t>(rank()) << kCounterBits) |
        (nextContext_.fetch_add(1, std::memory_order_relaxed) & kCounterMask);
    MutexLock lock(mu_);
    contexts_.emplace(id, std::make_shared<ContextState>(id));
    return id;
  }

  std::shared_ptr<ContextState> find(uint64_t id) const {
    MutexLock lock(mu_);
    auto it = contexts_.find(id);
    return it == contexts_.end() ? nullptr : it->second;
  }

  std::shared_ptr<ContextState> get(uint64_t id) const {
    auto state = find(id);
    if (state == nullptr) {
      throwError(Error::notFound("distributed-autograd " + contextName(id) +
                                 " is not alive on worker '" +
                                 agent_.self().name + "'"));
    }
    return state;
  }

  size_t size() const {
    MutexLock lock(mu_);
    return contexts_.size();
  }

  // `stepSafe`: the graph behind `tensors` needs no parameter value of
  // this worker (a step-safe function's reply), so the send does not make
  // the context a reader for the step gate.
  uint64_t recordSend(uint64_t contextId, int32_t peer,
                      const std::vector<at::Tensor>& tensors,
                      bool stepSafe = false) {
    auto state = find(contextId);
    if (state == nullptr) {
      throwError(Error(Code::kFailedPrecondition,
                       "distributed-autograd " + contextName(contextId) +
                           " is not alive on worker '" + agent_.self().name +
                           "'" + (released(contextId) ? " (released)" : "")));
    }
    {
      MutexLock lock(state->mu);
      state->knownWorkers.insert(peer);
    }
    if (tensors.empty()) {
      return 0;
    }
    ag::edge_list next;
    detail::SentTensors sent;
    for (const auto& t : tensors) {
      next.push_back(ag::impl::gradient_edge(t));
      sent.sizes.push_back(t.sizes().vec());
      sent.dtypes.push_back(t.scalar_type());
    }
    auto node = std::make_shared<SendRpcBackward>(std::move(next), peer,
                                                  std::move(sent));
    for (const auto& t : tensors) {
      node->add_input_metadata(t);
    }
    const uint64_t messageId = nextMessage_.fetch_add(1);
    if (stepSafe) {
      // Counted as answered from the start: its gradient (or its drop at
      // the end of backward) never reaches the gate.
      (void)node->markAnswered();
    }
    {
      MutexLock lock(state->mu);
      state->sends.emplace(messageId, std::move(node));
    }
    if (!stepSafe) {
      // Until its gradient arrives, the graph behind it may need the
      // values of this worker's parameters as they are now.
      gate_.sendRecorded(state->slot);
    }
    return messageId;
  }

  std::unique_ptr<rpc::GradReceiver> recordRecv(uint64_t contextId,
                                                int32_t peer,
                                                uint64_t messageId) {
    // A peer's id: it must not make us create a context no worker could.
    throwIfError(checkContextId(contextId, agent_.worldSize()));
    std::shared_ptr<ContextState> state;
    {
      MutexLock lock(mu_);
      if (tombstones_.count(contextId) != 0) {
        throwError(Error(Code::kFailedPrecondition,
                         "distributed-autograd " + contextName(contextId) +
                             " was already released on worker '" +
                             agent_.self().name + "'"));
      }
      auto& slot = contexts_[contextId];
      if (slot == nullptr) {
        slot = std::make_shared<ContextState>(contextId);
      }
      state = slot;
    }
    {
      MutexLock lock(state->mu);
      state->knownWorkers.insert(peer);
    }
    if (messageId == 0) {
      return nullptr;
    }
    return std::make_unique<Receiver>(contextId, peer, messageId);
  }

  Future<void> admitRequest(uint64_t contextId, int32_t /*peer*/,
                            Deadline deadline) override {
    auto state = find(contextId);
    if (state == nullptr) {  // released since recordRecv
      return makeErrorFuture<void>(
          Error(Code::kFailedPrecondition,
                "distributed-autograd " + contextName(contextId) +
                    " was released on worker '" + agent_.self().name + "'"));
    }
    return gate_.admit(state->gateSlot(state), deadline);
  }

  void requestDone(uint64_t contextId) override {
    if (auto state = find(contextId)) {
      gate_.requestDone(state->slot);
    }
  }

  // Forgets the context here and tells the workers it reached (except
  // `from`, who told us); they do the same. Returns false when it was not
  // alive here.
  bool release(uint64_t id, int32_t from) {
    std::shared_ptr<ContextState> state;
    {
      MutexLock lock(mu_);
      auto it = contexts_.find(id);
      if (it == contexts_.end()) {
        return false;
      }
      state = std::move(it->second);
      contexts_.erase(it);
      if (tombstones_.insert(id).second) {
        tombstoneOrder_.push_back(id);
        if (tombstoneOrder_.size() > kMaxTombstones) {
          tombstones_.erase(tombstoneOrder_.front());
          tombstoneOrder_.pop_front();
        }
      }
    }
    // Not under mu_: it may let a waiting step through, on this thread.
    // A request that found the context before the erase is refused by the
    // gate (the slot is marked released).
    gate_.release(state->slot);
    std::vector<int32_t> peers;
    {
      MutexLock lock(state->mu);
      peers.assign(state->knownWorkers.begin(), state->knownWorkers.end());
    }
    if (agent_.isShutDown()) {
      return true;
    }
    for (int32_t peer : peers) {
      if (peer == from || peer == rank()) {
        continue;
      }
      rpc::detail::CallSpec spec =
          rpc::detail::functionSpec<&detail::releaseContext>(peer);
      spec.recordAutograd = false;
      // Nobody reads an answer: the peer sends none, and this worker does
      // not wake for one (the future completes when the message is
      // written).
      spec.oneWay = true;
      auto reply = rpc::detail::sendCall<&detail::releaseContext>(
          agent_, peer, spec, id, rank());
      reply.addDoneCallback([id, peer](const Future<rpc::detail::Reply>& f) {
        if (f.hasError()) {
          TRELLIS_LOG_DEBUG("dist_autograd: release of {} on rank {}: {}",
                            contextName(id), peer, f.error().what());
        }
      });
    }
    return true;
  }

  bool released(uint64_t id) const {
    MutexLock lock(mu_);
    return tombstones_.count(id) != 0;
  }

 private:
  Agent& agent_;
  mutable Mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<ContextState>> contexts_
      TRELLIS_GUARDED_BY(mu_);
  std::unordered_set<uint64_t> tombstones_ TRELLIS_GUARDED_BY(mu_);
  std::deque<uint64_t> tombstoneOrder_ TRELLIS_GUARDED_BY(mu_);
  std::atomic<uint64_t> nextContext_{1};
  std::atomic<uint64_t> nextMessage_{1};
  // Declared last: destroyed first, failing what it holds while the
  // contexts still exist.
  detail::StepGate gate_;
};

Container& containerOf(Agent& agent) {
  auto* c = agent.extension<Container>();
  if (c == nullptr) {
    throwError(Error(Code::kFailedPrecondition,
                     "rpc agent '" + agent.self().name +
                         "' has no distributed-autograd support (it was "
                         "started before trellis_dist_autograd was loaded)"));
  }
  return *c;
}

// The process-wide leaf-gradient hooks (registerLeafGradientHook).
class LeafHooks {
 public:
  struct Hook {
    std::vector<at::Tensor> leaves;
    LeafGradientHook fn;  // one of the two
    AsyncLeafGradientHook asyncFn;
  };
  struct Slot {
    std::shared_ptr<const Hook> hook;
    size_t index = 0;
  };

  static LeafHooks& get() {
    static auto* hooks = new LeafHooks;  // never destroyed: used at exit
    return *hooks;
  }

  uint64_t add(std::vector<at::Tensor> leaves, LeafGradientHook fn,
               AsyncLeafGradientHook asyncFn = nullptr) {
    if (leaves.empty() || (!fn && !asyncFn)) {
      throwError(Error::invalidArgument(
          "registerLeafGradientHook: no leaves, or no hook"));
    }
    std::unordered_set<const void*> seen;
    for (size_t i = 0; i < leaves.size(); ++i) {
      const at::Tensor& t = leaves[i];
      if (!t.defined() || !t.is_leaf() || !t.requires_grad()) {
        throwError(Error::invalidArgument("registerLeafGradientHook: tensor " +
                                          std::to_string(i) +
                                          " is not a leaf that requires grad"));
      }
      if (!seen.insert(t.unsafeGetTensorImpl()).second) {
        throwError(Error::invalidArgument("registerLeafGradientHook: tensor " +
                                          std::to_string(i) +
                                          " is listed twice"));
      }
    }
    auto hook = std::make_shared<Hook>(
        Hook{std::move(leaves), std::move(fn), std::move(asyncFn)});
    MutexLock lock(mu_);
    for (size_t i = 0; i < hook->leaves.size(); ++i) {
      if (byLeaf_.count(hook->leaves[i].unsafeGetTensorImpl()) != 0) {
        throwError(Error::invalidArgument("registerLeafGradientHook: tensor " +
                                          std::to_string(i) +
                                          " already belongs to another hook"));
      }
    }
    const uint64_t key = nextKey_++;
    for (size_t i = 0; i < hook->leaves.size(); ++i) {
      byLeaf_.emplace(hook->leaves[i].unsafeGetTensorImpl(), Slot{hook, i});
    }
    byKey_.emplace(key, std::move(hook));
    size_.store(byLeaf_.size(), std::memory_order_release);
    return key;
  }

  void remove(uint64_t key) {
    std::shared_ptr<const Hook> hook;  // released outside the lock
    MutexLock lock(mu_);
    auto it = byKey_.find(key);
    if (it == byKey_.end()) {
      return;
    }
    hook = std::move(it->second);
    byKey_.erase(it);
    for (const auto& t : hook->leaves) {
      byLeaf_.erase(t.unsafeGetTensorImpl());
    }
    size_.store(byLeaf_.size(), std::memory_order_release);
  }

  // The hook and index of `leaf`; an empty slot when it has none.
  Slot find(const at::Tensor& leaf) const {
    if (size_.load(std::memory_order_acquire) == 0) {
      return {};
    }
    MutexLock lock(mu_);
    auto it = byLeaf_.find(leaf.unsafeGetTensorImpl());
    return it == byLeaf_.end() ? Slot{} : it->second;
  }

 private:
  mutable Mutex mu_;
  std::unordered_map<const void*, Slot> byLeaf_ TRELLIS_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, std::shared_ptr<const Hook>> byKey_
      TRELLIS_GUARDED_BY(mu_);
  uint64_t nextKey_ TRELLIS_GUARDED_BY(mu_) = 1;
  std::atomic<size_t> size_{0};
};

// Gives the hooks of this run's leaves their gradients (a hook sees all of
// its leaves, undefined where the run produced none) and takes back what
// they return; the futures of the asynchronous ones.
std::vector<Future<void>> runLeafHooks(Agent& agent, uint64_t contextId,
                                       std::vector<at::Tensor>& leaves,
                                       std::vector<at::Tensor>& grads) {
  std::vector<Future<void>> pending;
  struct Call {
    std::shared_ptr<const LeafHooks::Hook> hook;
    std::vector<at::Tensor> grads;  // parallel to hook->leaves
    std::vector<size_t> fromRun;    // hook index -> run index, or npos
  };
  constexpr size_t kNone = static_cast<size_t>(-1);
  std::vector<Call> calls;
  for (size_t i = 0; i < leaves.size(); ++i) {
    LeafHooks::Slot slot = LeafHooks::get().find(leaves[i]);
    if (slot.hook == nullptr) {
      continue;
    }
    auto it = std::find_if(calls.begin(), calls.end(),
                           [&](const Call& c) { return c.hook == slot.hook; });
    if (it == calls.end()) {
      const size_t n = slot.hook->leaves.size();
      calls.push_back({slot.hook, std::vector<at::Tensor>(n),
                       std::vector<size_t>(n, kNone)});
      it = std::prev(calls.end());
    }
    it->grads[slot.index] = std::move(grads[i]);
    it->fromRun[slot.index] = i;
  }
  for (auto& call : calls) {
    if (call.hook->asyncFn) {
      pending.push_back(call.hook->asyncFn(agent, contextId, call.grads));
    } else {
      call.hook->fn(contextId, call.grads);
    }
    for (size_t k = 0; k < call.grads.size(); ++k) {
      if (call.fromRun[k] != kNone) {
        grads[call.fromRun[k]] = std::move(call.grads[k]);
      } else if (call.grads[k].defined()) {
        // A leaf of the hook that this run did not reach: its gradient
        // (DDP's average over the group) still belongs in the context.
        leaves.push_back(call.hook->leaves[k]);
        grads.push_back(std::move(call.grads[k]));
      }
    }
  }
  return pending;
}

// Sums `grad` into the context's gradient of `leaf`, taking it over when
// nobody else holds it.
void accumulate(ContextState& state, const at::Tensor& leaf, at::Tensor grad) {
  if (!grad.defined()) {
    return;
  }
  MutexLock lock(state.mu);
  const at::Tensor existing = state.gradients.find(leaf);
  if (existing.defined()) {
    state.gradients.add(leaf, existing + grad);
    return;
  }
  const bool owned = !grad.is_sparse() && grad.use_count() == 1 &&
                     !grad.is_view() && grad.storage().use_count() == 1;
  state.gradients.add(leaf, owned ? std::move(grad) : grad.clone());
}

// Runs this worker's part of the graph from `roots` (seeded with `inputs`),
// sums leaf gradients into the context, and sends the gradients that reach
// RecvRpcBackward nodes to their senders. The future completes when every
// worker reached that way has finished its part.
Future<void> runGraph(Container& container,
                      const std::shared_ptr<ContextState>& state,
                      const ag::edge_list& roots,
                      const ag::variable_list& inputs, bool retainGraph) {
  struct Outgoing {
    RecvRpcBackward* node;
    std::vector<at::Tensor> grads;
  };
  std::vector<Outgoing> outgoing;
  std::vector<at::Tensor> leafTensors;  // the leaves this run reached
  std::vector<at::Tensor> leafGrads;    // and their gradients
  {
    MutexLock engineLock(state->engineMu);
    // What the engine should capture instead of running: leaves (their
    // AccumulateGrad) and the gradients entering RecvRpcBackward nodes.
    ag::edge_list outputs;
    std::vector<ag::AccumulateGrad*> leaves;  // parallel to outputs; or null
    std::unordered_map<RecvRpcBackward*, size_t> recvIndex;
    std::vector<std::pair<size_t, size_t>> recvSlot;  // output -> (recv, i)
    std::unordered_set<ag::Node*> seen;
    std::vector<ag::Node*> stack;
    for (const auto& e : roots) {
      if (e.function != nullptr && seen.insert(e.function.get()).second) {
        stack.push_back(e.function.get());
      }
    }
    while (!stack.empty()) {
      ag::Node* fn = stack.back();
      stack.pop_back();
      if (auto* acc = dynamic_cast<ag::AccumulateGrad*>(fn)) {
        outputs.emplace_back(acc->shared_from_this(), 0);
        leaves.push_back(acc);
        recvSlot.emplace_back(0, 0);
        continue;
      }
      if (auto* recv = dynamic_cast<RecvRpcBackward*>(fn)) {
        if (recv->contextId() != state->id) {
          return makeErrorFuture<void>(Error::invalidArgument(
              "backward of " + contextName(state->id) +
              " reaches a tensor received over RPC in " +
              contextName(recv->contextId()) +
              "; a graph cannot span two distributed-autograd contexts"));
        }
        const size_t r = outgoing.size();
        recvIndex.emplace(recv, r);
        outgoing.push_back({recv, std::vector<at::Tensor>(recv->num_inputs())});
        for (uint32_t i = 0; i < recv->num_inputs(); ++i) {
          outputs.emplace_back(
              std::static_pointer_cast<ag::Node>(recv->shared_from_this()), i);
          leaves.push_back(nullptr);
          recvSlot.emplace_back(r, i);
        }
        continue;
      }
      for (const auto& e : fn->next_edges()) {
        if (e.function != nullptr && seen.insert(e.function.get()).second) {
          stack.push_back(e.function.get());
        }
      }
    }
    if (outputs.empty()) {
      return makeReadyFuture();
    }
    ag::variable_list results;
    try {
      // keep_graph: the runs of one context may share nodes (FAST mode runs
      // each send function's part on its own); the graph is freed with the
      // tensors and send functions that hold it.
      results = ag::Engine::get_default_engine().execute(
          roots, inputs, /*keep_graph=*/true, /*create_graph=*/false,
          /*accumulate_grad=*/false, outputs);
    } catch (...) {
      return makeErrorFuture<void>(errorFromCurrentException().withContext(
          "backward on worker '" + container.agent().self().name + "'"));
    }
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (leaves[i] != nullptr) {
        leafTensors.push_back(leaves[i]->variable);
        leafGrads.push_back(std::move(results[i]));
      } else {
        outgoing[recvSlot[i].first].grads[recvSlot[i].second] =
            std::move(results[i]);
      }
    }
  }
  std::vector<Future<bool>> replies;
  for (auto& o : outgoing) {
    bool any = false;
    for (const auto& g : o.grads) {
      any = any || g.defined();
    }
    if (!any) {
      continue;  // nothing flows back through this message
    }
    Agent& agent = container.agent();
    rpc::detail::CallSpec spec =
        rpc::detail::functionSpec<&detail::propagateGradients>(o.node->peer());
    spec.recordAutograd = false;
    // Its callbacks decode a bool and count answers; the last one wakes the
    // backward's waiter (or answers a nested backward's request).
    spec.completeOnLoop = true;
    auto reply = rpc::detail::sendCall<&detail::propagateGradients>(
        agent, o.node->peer(), spec, state->id, o.node->messageId(),
        retainGraph, std::move(o.grads));
    replies.push_back(rpc::detail::decodeReply<bool>(std::move(reply), agent));
  }
  // After the sends: a hook's work (DDP's allreduce) overlaps the other
  // workers' parts of the backward.
  std::vector<Future<void>> hooks;
  try {
    hooks = runLeafHooks(container.agent(), state->id, leafTensors, leafGrads);
  } catch (...) {
    return makeErrorFuture<void>(errorFromCurrentException().withContext(
        "backward on worker '" + container.agent().self().name + "'"));
  }
  for (size_t i = 0; i < leafTensors.size(); ++i) {
    accumulate(*state, leafTensors[i], std::move(leafGrads[i]));
  }
  if (hooks.empty()) {
    return whenAllSucceed(replies);
  }
  // This part is done when the other workers' parts and the hooks' work
  // (an in-backward optimizer step) are; a hook's failure names this worker.
  Future<void> hooksDone = whenAllSucceed(hooks).then(
      [where = "backward on worker '" + container.agent().self().name +
               "'"](const Future<void>& f) {
        return f.hasError()
                   ? makeErrorFuture<void>(f.error().withContext(where))
                   : makeReadyFuture();
      });
  return whenAllSucceed(
      std::vector<Future<void>>{std::move(hooksDone), whenAllSucceed(replies)});
}

}  // namespace

// ---- GradientMap -----------------------------------------------------------

at::Tensor GradientMap::find(const at::Tensor& t) const {
  if (!t.defined()) {
    return {};
  }
  auto it = entries_.find(t.unsafeGetTensorImpl());
  return it == entries_.end() ? at::Tensor() : it->second.gradient;
}

at::Tensor GradientMap::at(const at::Tensor& t) const {
  at::Tensor g = find(t);
  if (!g.defined()) {
    throwError(Error::notFound("no gradient for this tensor in the context"));
  }
  return g;
}

void GradientMap::add(const at::Tensor& t, at::Tensor gradient) {
  auto& e = entries_[t.unsafeGetTensorImpl()];
  e.tensor = t;
  e.gradient = std::move(gradient);
}

// ---- Context ---------------------------------------------------------------

Context::Context() : Context(Agent::current()) {}

Context::Context(rpc::Agent& agent) : agent_(agent.shared_from_this()) {
  id_ = containerOf(agent).newContext();
  scope_ = std::make_unique<rpc::AutogradContextScope>(id_);
}

Context::~Context() {
  scope_.reset();
  try {
    containerOf(*agent_).release(id_, -1);
  } catch (const std::exception& e) {
    TRELLIS_LOG_WARN("dist_autograd: releasing {}: {}", contextName(id_),
                     e.what());
  }
}

void Context::backward(const std::vector<at::Tensor>& roots, bool retainGraph) {
  rpc::CurrentAgentScope scope(agent_.get());
  dist_autograd::backward(id_, roots, retainGraph);
}

GradientMap Context::gradients() const {
  rpc::CurrentAgentScope scope(agent_.get());
  return getGradients(id_);
}

// ---- free functions --------------------------------------------------------

namespace detail {

GateRef gateOf(rpc::Agent& agent, uint64_t contextId) {
  Container& container = containerOf(agent);
  auto state = container.find(contextId);
  if (state == nullptr) {
    return {&container.gate(), nullptr};
  }
  return {&container.gate(), state->gateSlot(state)};
}

}  // namespace detail

void backward(uint64_t contextId, const std::vector<at::Tensor>& roots,
              bool retainGraph) {
  Agent& agent = Agent::current();
  Container& container = containerOf(agent);
  if (static_cast<int32_t>(contextId >> kCounterBits) != container.rank()) {
    throwError(Error::invalidArgument(
        "backward of " + contextName(contextId) +
        ": a context's backward runs on the worker that created it (rank " +
        std::to_string(contextId >> kCounterBits) + "), not on '" +
        agent.self().name + "'"));
  }
  auto state = container.get(contextId);
  if (roots.empty()) {
    throwError(Error::invalidArgument("backward: no roots"));
  }
  ag::edge_list edges;
  ag::variable_list inputs;
  for (size_t i = 0; i < roots.size(); ++i) {
    const auto& r = roots[i];
    if (!r.defined() || !r.requires_grad() || r.numel() != 1) {
      throwError(Error::invalidArgument(
          "backward: root " + std::to_string(i) +
          " must be a defined one-element tensor that requires grad"));
    }
    edges.push_back(ag::impl::gradient_edge(r));
    inputs.push_back(at::ones_like(r));
  }
  {
    MutexLock lock(state->mu);
    if (state->graphFreed) {
      throwError(Error(Code::kFailedPrecondition,
                       "backward of " + contextName(contextId) +
                           " ran already without retainGraph; pass "
                           "retainGraph=true to run it again"));
    }
    state->graphFreed = !retainGraph;
  }
  auto done = runGraph(container, state, edges, inputs, retainGraph);
  try {
    done.wait();
  } catch (const Exception& e) {
    // A failed backward leaves partial gradients everywhere: release the
    // context on every worker it reached, like torch.
    container.release(contextId, -1);
    throwError(e.error().withContext("distributed backward of " +
                                     contextName(contextId)));
  }
  if (!retainGraph) {
    // The whole tree has answered: no gradient can arrive here any more.
    // Other workers free their part of the graph with the context.
    uint32_t unanswered = 0;
    {
      MutexLock lock(state->mu);
      for (auto& [id, send] : state->sends) {
        unanswered += send->markAnswered() ? 1 : 0;
      }
      state->sends.clear();
    }
    // Sends whose tensors did not reach the loss: no gradient comes now.
    container.gate().sendsDropped(state->slot, unanswered);
  }
}

LeafGradientHookHandle& LeafGradientHookHandle::operator=(
    LeafGradientHookHandle&& other) noexcept {
  if (this != &other) {
    reset();
    key_ = std::exchange(other.key_, 0);
  }
  return *this;
}

void LeafGradientHookHandle::reset() {
  if (key_ != 0) {
    LeafHooks::get().remove(std::exchange(key_, 0));
  }
}

LeafGradientHookHandle registerLeafGradientHook(std::vector<at::Tensor> leaves,
                                                LeafGradientHook hook) {
  return LeafGradientHookHandle(
      LeafHooks::get().add(std::move(leaves), std::move(hook)));
}

LeafGradientHookHandle registerAsyncLeafGradientHook(
    std::vector<at::Tensor> leaves, AsyncLeafGradientHook hook) {
  if (!hook) {
    throwError(Error::invalidArgument(
        "registerAsyncLeafGradientHook: no leaves, or no hook"));
  }
  return LeafGradientHookHandle(
      LeafHooks::get().add(std::move(leaves), nullptr, std::move(hook)));
}

GradientMap getGradients(uint64_t contextId) {
  auto state = containerOf(Agent::current()).get(contextId);
  MutexLock lock(state->mu);
  return state->gradients;
}

uint64_t currentContextId() { return rpc::currentAutogradContext(); }

size_t liveContextCount() { return liveContextCount(Agent::current()); }

size_t liveContextCount(rpc::Agent& agent) { return containerOf(agent).size(); }

// ---- built-in requests -----------------------------------------------------

namespace detail {

Future<bool> propagateGradients(uint64_t contextId, uint64_t messageId,
                                bool retainGraph,
                                std::vector<at::Tensor> gradients) {
  Agent& agent = Agent::current();
  throwIfError(checkContextId(contextId, agent.worldSize()));
  Container& container = containerOf(agent);
  auto state = container.find(contextId);
  if (state == nullptr) {
    throwError(Error(Code::kFailedPrecondition,
                     "gradients for distributed-autograd " +
                         contextName(contextId) +
                         ", which is not alive on this worker" +
                         (container.released(contextId) ? " (released)" : "")));
  }
  std::shared_ptr<SendRpcBackward> send;
  {
    MutexLock lock(state->mu);
    auto it = state->sends.find(messageId);
    if (it == state->sends.end()) {
      throwError(Error(Code::kFailedPrecondition,
                       "gradients for message " + std::to_string(messageId) +
                           " of " + contextName(contextId) +
                           ", which has no send function here"));
    }
    // Kept until the context is released: in FAST mode one send function
    // may receive several partial gradients in one backward (a tensor the
    // receiver used both locally and in a nested call gets one per part).
    send = it->second;
  }
  if (Error e = send->check(gradients); !e.ok()) {
    throwError(e.withContext("message " + std::to_string(messageId) + " of " +
                             contextName(contextId)));
  }
  ag::edge_list roots;
  for (uint32_t i = 0; i < send->num_inputs(); ++i) {
    roots.emplace_back(send, i);
  }
  auto done = runGraph(container, state, roots, gradients, retainGraph);
  // The engine has run this worker's part for the message (or failed): the
  // graph behind it no longer needs the parameters' current values.
  if (send->markAnswered()) {
    container.gate().sendAnswered(state->slot);
  }
  return done.then([] { return true; });
}

bool releaseContext(uint64_t contextId, int32_t from) {
  Agent& agent = Agent::current();
  throwIfError(checkContextId(contextId, agent.worldSize()));
  if (from < 0 || from >= agent.worldSize()) {
    throwError(Error::protocol("release of " + contextName(contextId) +
                               " from rank " + std::to_string(from) +
                               ", outside the group"));
  }
  containerOf(agent).release(contextId, from);
  return true;
}

}  // namespace detail

namespace {

[[maybe_unused]] const bool kInstalled =
    rpc::detail::registerExtension<Container>();

}  // namespace
}  // namespace trellis::dist_autograd
