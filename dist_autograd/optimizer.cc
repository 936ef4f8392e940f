#include <algorithm>
#include <c10/core/ScalarType.h>
#include <chrono>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <trellis/core/check.h>
#include <trellis/core/error.h>
#include <trellis/core/future.h>
#include <trellis/core/mutex.h>
#include <trellis/core/seal.h>
#include <trellis/dist_autograd/dist_autograd.h>
#include <trellis/dist_autograd/messages.h>
#include <trellis/dist_autograd/optimizer.h>
#include <trellis/dist_autograd/step_gate.h>
#include <trellis/rpc/autograd_hooks.h>
#include <trellis/rpc/rpc.h>
#include <trellis/rpc/serializable.h>

namespace trellis::dist_autograd::detail {

// OptimizerSpec as it travels to the owners: the variant's index plus the
// union of the alternatives' fields (unused ones keep their defaults).
struct OptimizerConfig {
  int32_t kind = 0;  // OptimizerSpec::index()
  double lr = 0;
  double momentum = 0;
  double dampening = 0;
  double weightDecay = 0;
  bool nesterov = false;
  double lrDecay = 0;
  double initialAccumulatorValue = 0;
  double eps = 0;
  double beta1 = 0;
  double beta2 = 0;
  bool amsgrad = false;
};

}  // namespace trellis::dist_autograd::detail

TRELLIS_SERIALIZABLE(trellis::dist_autograd::detail::OptimizerConfig, kind, lr,
                     momentum, dampening, weightDecay, nesterov, lrDecay,
                     initialAccumulatorValue, eps, beta1, beta2, amsgrad);

namespace trellis::dist_autograd::detail {

namespace {

OptimizerConfig toConfig(const OptimizerSpec& spec) {
  OptimizerConfig c;
  c.kind = static_cast<int32_t>(spec.index());
  if (const auto* s = std::get_if<SGD>(&spec)) {
    c.lr = s->lr;
    c.momentum = s->momentum;
    c.dampening = s->dampening;
    c.weightDecay = s->weightDecay;
    c.nesterov = s->nesterov;
  } else if (const auto* a = std::get_if<Adagrad>(&spec)) {
    c.lr = a->lr;
    c.lrDecay = a->lrDecay;
    c.weightDecay = a->weightDecay;
    c.initialAccumulatorValue = a->initialAccumulatorValue;
    c.eps = a->eps;
  } else if (const auto* m = std::get_if<Adam>(&spec)) {
    c.lr = m->lr;
    c.beta1 = m->beta1;
    c.beta2 = m->beta2;
    c.eps = m->eps;
    c.weightDecay = m->weightDecay;
    c.amsgrad = m->amsgrad;
  }
  return c;
}

// torch::optim checks the values (negative rates, nesterov without
// momentum, ...) and throws c10::Error, which reaches the caller as a
// RemoteError from the owner.
std::unique_ptr<torch::optim::Optimizer> makeTorchOptimizer(
    const OptimizerConfig& c, const std::vector<at::Tensor>& params) {
  switch (c.kind) {
    case 0:
      return std::make_unique<torch::optim::SGD>(
          params, torch::optim::SGDOptions(c.lr)
                      .momentum(c.momentum)
                      .dampening(c.dampening)
                      .weight_decay(c.weightDecay)
                      .nesterov(c.nesterov));
    case 1:
      return std::make_unique<torch::optim::Adagrad>(
          params, torch::optim::AdagradOptions(c.lr)
                      .lr_decay(c.lrDecay)
                      .weight_decay(c.weightDecay)
                      .initial_accumulator_value(c.initialAccumulatorValue)
                      .eps(c.eps));
    case 2:
      return std::make_unique<torch::optim::Adam>(
          params, torch::optim::AdamOptions(c.lr)
                      .betas({c.beta1, c.beta2})
                      .eps(c.eps)
                      .weight_decay(c.weightDecay)
                      .amsgrad(c.amsgrad));
    default:
      throwError(Error::invalidArgument("unknown optimizer kind " +
                                        std::to_string(c.kind)));
  }
}

// A saved state is a sealed blob (core/seal.h): magic "TRLSOPT1", tag 0,
// the archive as its payload. libtorch 1.13's archive reader can crash the
// process on corrupted input (its TorchScript type parser), so a state
// whose seal does not hold never reaches it.
constexpr char kStateMagic[] = "TRLSOPT1";

std::string sealState(std::string_view archive) {
  std::string out = seal::header(kStateMagic, 0, archive);
  out.append(archive);
  return out;
}

// The archive inside `sealed`; InvalidArgumentError saying what is wrong.
std::string_view openState(std::string_view sealed) {
  seal::Opened opened;
  std::string why = seal::open(kStateMagic, sealed, &opened);
  if (why.empty() && opened.tag != 0) {
    // The digest covers the payload; the header's fields are checked by
    // their readers.
    why = "is corrupted: its header's tag is " + std::to_string(opened.tag);
  }
  if (!why.empty()) {
    throwError(Error::invalidArgument(
        "optimizer state (" + std::to_string(sealed.size()) +
        " bytes) does not load: it " + why +
        "; only what DistributedOptimizer::stateDict() returned loads"));
  }
  return opened.payload;
}

// Steps on one worker are serialised by one lock per process, as torch's
// _LocalOptimizer.global_lock does: two local optimizers built over the same
// parameters (two DistributedOptimizers, or two trainers' optimizers) must
// not interleave their .grad swaps and updates. Steps of workers in one
// process (tests) serialise too; nothing else is done under the lock.
Mutex& stepMutex() {
  static Mutex mu;
  return mu;
}

// InvalidArgumentError unless `t` is a tensor an optimizer can update;
// `which` names it in the message.
void checkUpdatable(const at::Tensor& t, const std::string& which) {
  if (!t.defined()) {
    throwError(Error::invalidArgument(which + " is an undefined tensor"));
  }
  if (!at::isFloatingType(t.scalar_type())) {
    throwError(Error::invalidArgument(
        which + " is a " + std::string(c10::toString(t.scalar_type())) +
        " tensor; optimizers update floating-point parameters only"));
  }
}

}  // namespace

// Parameters and the torch::optim optimizer over them, on their owner: the
// part that DistributedOptimizer's LocalOptimizer and OptimizerInBackward
// share. State (momentum, Adagrad sums, Adam moments) lives here across
// steps.
class ParamStepper {
 public:
  ParamStepper(const OptimizerConfig& config, std::vector<at::Tensor> params)
      : params_(std::move(params)),
        optimizer_(makeTorchOptimizer(config, params_)) {}

  const std::vector<at::Tensor>& params() const { return params_; }

  // One torch::optim step with `grads` (parallel to params(); undefined:
  // that parameter is left alone). torch::optim steps every parameter
  // whose .grad is defined, so each one gets exactly its gradient here (or
  // none), whatever .grad held; that is put back afterwards, also when the
  // step throws.
  void apply(std::vector<at::Tensor> grads) {
    MutexLock lock(stepMutex());
    std::vector<at::Tensor> saved;
    saved.reserve(params_.size());
    bool any = false;
    for (size_t i = 0; i < params_.size(); ++i) {
      saved.push_back(params_[i].grad());
      any = any || grads[i].defined();
      params_[i].mutable_grad() = std::move(grads[i]);
    }
    struct Restore {
      std::vector<at::Tensor>& params;
      std::vector<at::Tensor>& saved;
      ~Restore() {
        for (size_t i = 0; i < params.size(); ++i) {
          params[i].mutable_grad() = std::move(saved[i]);
        }
      }
    } restore{params_, saved};
    if (any) {
      optimizer_->step();
    }
  }

  // The torch::optim state, serialized and sealed.
  std::string saveState() {
    MutexLock lock(stepMutex());
    torch::serialize::OutputArchive archive;
    optimizer_->save(archive);
    std::ostringstream out;
    archive.save_to(out);
    return sealState(out.str());
  }

  // `bytes` may have come over the network: its seal is checked
  // (openState), then torch's reader checks the archive.
  void loadState(const std::string& bytes) {
    const std::string_view payload = openState(bytes);
    MutexLock lock(stepMutex());
    try {
      torch::serialize::InputArchive archive;
      archive.load_from(payload.data(), payload.size());
      optimizer_->load(archive);
    } catch (const c10::Error& e) {
      throwError(Error::invalidArgument(
          "optimizer state (" + std::to_string(bytes.size()) +
          " bytes) does not load: " + e.what_without_backtrace()));
    }
  }

 private:
  std::vector<at::Tensor> params_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

// Runs `run` (a step of `contextId` on this worker) once no other context's
// backward pass still needs the parameters' current values here (StepGate,
// docs/dist_autograd.md); `waitUs` bounds that wait (0: none), `what` names
// the step in the gate's timeout. The step runs on this thread when the
// gate lets it through at once, else on the thread that ends the last read,
// or on a worker thread when that is a transport loop (a step there would
// stall every pipe). A context not alive here (released just now: its
// gradients are gone) steps nothing.
Future<void> gatedStep(rpc::Agent& agent, uint64_t contextId, int64_t waitUs,
                       std::string what, std::function<void()> run) {
  GateRef ref = gateOf(agent, contextId);
  if (ref.slot == nullptr) {
    return makeReadyFuture();
  }
  const Deadline deadline =
      waitUs > 0 ? Deadline::after(std::chrono::microseconds(waitUs))
                 : Deadline::never();
  Future<void> admitted =
      ref.gate->beginWrite(ref.slot, deadline, std::move(what));
  std::weak_ptr<rpc::Agent> weak = agent.shared_from_this();
  auto gated = [ref, weak, run = std::move(run)] {
    struct EndWrite {
      const GateRef& ref;
      ~EndWrite() { ref.gate->endWrite(*ref.slot); }
    } end{ref};
    auto a = weak.lock();
    TRELLIS_CHECK(a == nullptr || !a->onLoopThread(),
                  "an optimizer step on a transport loop thread");
    run();
  };
  if (admitted.completed()) {
    return admitted.then(std::move(gated));  // here, on this thread
  }
  // Held: the thread that ends the last read lets the step through. That
  // may be a transport loop (an inline function's reply, the answer to a
  // backward this worker forwarded): then it goes to a worker thread.
  return admitted.then([weak, ref, gated = std::move(gated)]() -> Future<void> {
    auto a = weak.lock();
    if (a == nullptr || !a->onLoopThread()) {
      gated();
      return makeReadyFuture();
    }
    Promise<void> done;
    auto out = done.getFuture();
    a->runOnWorkerThread([done, ref, gated](const Error& e) mutable {
      if (!e.ok()) {  // the agent is closing: the step does not run
        ref.gate->endWrite(*ref.slot);
        done.setError(e);
        return;
      }
      try {
        gated();
        done.setValue();
      } catch (...) {
        done.setError(errorFromCurrentException());
      }
    });
    return out;
  });
}

// Parameters some OptimizerInBackward steps, process-wide: a
// DistributedOptimizer refuses them (their gradients never reach a
// context, so its step would silently skip them).
class InBackwardParams {
 public:
  static InBackwardParams& get() {
    static auto* p = new InBackwardParams;  // never destroyed: used at exit
    return *p;
  }
  void add(const std::vector<at::Tensor>& params) {
    MutexLock lock(mu_);
    for (const auto& t : params) {
      set_.insert(t.unsafeGetTensorImpl());
    }
  }
  void remove(const std::vector<at::Tensor>& params) {
    MutexLock lock(mu_);
    for (const auto& t : params) {
      set_.erase(t.unsafeGetTensorImpl());
    }
  }
  bool contains(const at::Tensor& t) const {
    MutexLock lock(mu_);
    return set_.count(t.unsafeGetTensorImpl()) != 0;
  }

 private:
  mutable Mutex mu_;
  std::unordered_set<const void*> set_ TRELLIS_GUARDED_BY(mu_);
};

// The owner's half of a DistributedOptimizer: its parameters (the RRefs'
// owner values, so the very tensors its model uses) and their stepper.
class LocalOptimizer {
 public:
  LocalOptimizer(const OptimizerConfig& config, std::vector<at::Tensor> params)
      : stepper_(config, std::move(params)) {}

  // Applies the gradients this worker accumulated in `contextId`, once no
  // other context's backward pass still needs the parameters' current
  // values here (gatedStep). `waitUs` bounds that wait (0: none); the step
  // itself is not interrupted.
  Future<void> step(uint64_t contextId, int64_t waitUs) {
    GradientMap map;
    try {
      map = getGradients(contextId);
    } catch (const NotFoundError&) {
      // No message of the context reached this worker, so none of its
      // parameters has a gradient in it: nothing to apply. (A context that
      // was released here before the step is indistinguishable; its
      // gradients are gone either way.)
      return makeReadyFuture();
    }
    std::vector<at::Tensor> grads;
    bool any = false;
    for (const auto& p : stepper_.params()) {
      grads.push_back(map.find(p));
      any = any || grads.back().defined();
    }
    if (!any) {
      return makeReadyFuture();  // changes nothing: no need to wait
    }
    // The RRef's holder keeps this object alive until the future completes.
    return gatedStep(rpc::Agent::current(), contextId, waitUs,
                     "the step of " + contextName(contextId),
                     [this, grads = std::move(grads)]() mutable {
                       stepper_.apply(std::move(grads));
                     });
  }

  std::string saveState() { return stepper_.saveState(); }

  bool loadState(const std::string& bytes) {
    stepper_.loadState(bytes);
    return true;
  }

 private:
  ParamStepper stepper_;
};

// Runs on the owner of every RRef in `params` (remote()).
std::shared_ptr<LocalOptimizer> makeLocalOptimizer(
    OptimizerConfig config, std::vector<rpc::RRef<at::Tensor>> params) {
  auto& agent = rpc::Agent::current();
  const Duration wait = agent.options().defaultTimeout;
  std::vector<at::Tensor> tensors;
  std::unordered_set<const void*> seen;
  tensors.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& r = params[i];
    // Waits for a parameter made by a remote() that is still running.
    at::Tensor t = *r.localValue(wait);
    const std::string which = "parameter " + std::to_string(i) + " (RRef " +
                              std::to_string(r.id().worker) + ":" +
                              std::to_string(r.id().local) + ")";
    checkUpdatable(t, which);
    if (!seen.insert(t.unsafeGetTensorImpl()).second) {
      // torch::optim would step it twice.
      throwError(Error::invalidArgument(which + " appears twice"));
    }
    if (InBackwardParams::get().contains(t)) {
      throwError(Error::invalidArgument(
          which +
          " is stepped in the backward pass by an OptimizerInBackward; its "
          "gradients never reach the context, so a DistributedOptimizer "
          "cannot step it too"));
    }
    tensors.push_back(std::move(t));
  }
  return std::make_shared<LocalOptimizer>(config, std::move(tensors));
}

}  // namespace trellis::dist_autograd::detail

TRELLIS_REMOTE_FUNCTION(trellis::dist_autograd::detail::makeLocalOptimizer);
TRELLIS_REMOTE_METHODS(trellis::dist_autograd::detail::LocalOptimizer, step,
                       saveState, loadState);

namespace trellis::dist_autograd {

using detail::contextName;
using detail::LocalOptimizer;

namespace {

// `f` failing with its error prefixed by `context` (the owner's name).
// With `ownerTimeout`, a DEADLINE_EXCEEDED the owner raised itself (its
// StepGate wait) becomes a local TimeoutError, as the same wait on this
// worker would be; other remote errors stay RemoteErrors.
Future<void> withContext(const Future<void>& f, std::string context,
                         bool ownerTimeout = false) {
  Promise<void> promise;
  auto out = promise.getFuture();
  f.addDoneCallback([promise, context = std::move(context),
                     ownerTimeout](const Future<void>& done) mutable {
    if (done.hasError()) {
      const Error& e = done.error();
      if (ownerTimeout && e.code() == Code::kDeadlineExceeded &&
          e.remoteOrigin() != nullptr) {
        promise.setError(Error::timeout(context + ": " + e.message()));
        return;
      }
      promise.setError(e.withContext(context));
    } else {
      promise.setValue();
    }
  });
  return out;
}

// The waits' deadline: each call already fails at its own timeout, with an
// error naming the owner and the function; waiting exactly that long raced
// those timers (the wait's deadline, taken first, won by microseconds and
// said less). This only bounds a wait whose call could not time out.
Deadline waitDeadline(Duration callTimeout) {
  return callTimeout > Duration::zero()
             ? Deadline::after(callTimeout + std::chrono::seconds(1))
             : Deadline::never();
}

// How long an owner's step may wait for other contexts' backward passes
// (in microseconds, 0 = no limit): the call's timeout less a margin, so
// that the owner's error, which names the contexts it waited for, arrives
// before the call's own timer fires with a bare "timed out".
int64_t ownerWaitUs(Duration callTimeout) {
  if (callTimeout <= Duration::zero()) {
    return 0;
  }
  const Duration margin =
      std::min<Duration>(callTimeout / 10, std::chrono::milliseconds(500));
  return std::max<int64_t>(
      1, std::chrono::duration_cast<std::chrono::microseconds>(callTimeout -
                                                               margin)
             .count());
}

// Waits for every owner's future; throws the first error to arrive, or a
// TimeoutError naming the owners still pending at `deadline`.
void waitOwners(const std::vector<Future<void>>& futures,
                const std::vector<std::string>& names, Deadline deadline,
                Duration timeout, const char* what) {
  try {
    waitAll(futures, deadline);
  } catch (const TimeoutError&) {
    std::string pending;
    for (size_t i = 0; i < futures.size(); ++i) {
      if (!futures[i].completed()) {
        pending += (pending.empty() ? "'" : ", '") + names[i] + "'";
      }
    }
    if (pending.empty()) {  // all finished just now: report their outcome
      waitAll(futures, Deadline::never());
      return;
    }
    throwError(Error::timeout(std::string("DistributedOptimizer: ") + what +
                              " on " + pending + " did not finish within " +
                              formatDuration(timeout)));
  }
}

}  // namespace

struct DistributedOptimizer::Impl {
  std::optional<Duration> timeout;  // per call, as given
  Duration waitLimit;  // the same resolved (0 = none, as for Deadline)
  std::vector<rpc::RRef<LocalOptimizer>> owners;
  std::vector<std::string> ownerNames;
};

std::vector<rpc::RRef<at::Tensor>> localParameters(
    const std::vector<at::Tensor>& tensors) {
  std::vector<rpc::RRef<at::Tensor>> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    // The owner value is a handle to the same TensorImpl, so the owner's
    // optimizer updates the tensor the caller's model uses.
    out.push_back(rpc::makeRRef(std::make_shared<at::Tensor>(t)));
  }
  return out;
}

DistributedOptimizer::DistributedOptimizer(
    OptimizerSpec spec, std::vector<rpc::RRef<at::Tensor>> parameters,
    std::optional<Duration> timeout)
    : impl_(std::make_unique<Impl>()) {
  if (parameters.empty()) {
    throwError(Error::invalidArgument(
        "DistributedOptimizer: the parameter list is empty"));
  }
  for (const auto& p : parameters) {
    if (!p.valid()) {
      throwError(Error::invalidArgument(
          "DistributedOptimizer: an empty RRef among the parameters"));
    }
  }
  const std::shared_ptr<rpc::Agent> agentPtr =
      parameters.front().state()->agent();
  rpc::Agent& agent = *agentPtr;
  impl_->timeout = timeout;
  impl_->waitLimit = timeoutOr(timeout, agent.options().defaultTimeout,
                               "DistributedOptimizer timeout");
  for (const auto& p : parameters) {
    if (p.state()->agent().get() != &agent) {
      throwError(Error::invalidArgument(
          "DistributedOptimizer: the parameters belong to different agents"));
    }
  }

  std::map<int32_t, std::vector<rpc::RRef<at::Tensor>>> byOwner;
  for (auto& p : parameters) {
    byOwner[p.owner()].push_back(std::move(p));
  }
  const detail::OptimizerConfig config = detail::toConfig(spec);
  const Deadline deadline = waitDeadline(impl_->waitLimit);
  std::vector<Future<void>> confirmed;
  {
    // The optimizers are the workers' own state, not part of whatever
    // context the caller is in.
    rpc::AutogradContextScope noContext(0);
    rpc::CurrentAgentScope agentScope(&agent);
    // Owners that are this worker go through remote() too, so that every
    // local optimizer is built and stepped the same way.
    for (auto& [owner, params] : byOwner) {
      const std::string name = agent.workerInfo(owner).name;
      rpc::Callee callee(owner);
      callee.timeout = timeout;
      auto r = rpc::remote<&detail::makeLocalOptimizer>(callee, config,
                                                        std::move(params));
      confirmed.push_back(withContext(
          r.state()->confirmed(),
          "DistributedOptimizer: building the optimizer on '" + name + "'"));
      impl_->owners.push_back(std::move(r));
      impl_->ownerNames.push_back(name);
    }
  }
  waitOwners(confirmed, impl_->ownerNames, deadline, impl_->waitLimit,
             "building the optimizer");
}

DistributedOptimizer::~DistributedOptimizer() = default;

void DistributedOptimizer::step(const Context& context) { step(context.id()); }

void DistributedOptimizer::step(uint64_t contextId) {
  const Deadline deadline = waitDeadline(impl_->waitLimit);
  const int64_t waitUs = ownerWaitUs(impl_->waitLimit);
  const size_t n = impl_->owners.size();
  std::vector<Future<void>> done(n);
  {
    // The step is no part of the context: carrying it would make the
    // owners join it (and the context's id is an argument anyway).
    rpc::AutogradContextScope noContext(0);
    auto label = [&](size_t i) {
      return "DistributedOptimizer: step on '" + impl_->ownerNames[i] + "'";
    };
    // Remote owners first, so that they step while this worker does.
    for (size_t i = 0; i < n; ++i) {
      const auto& owner = impl_->owners[i];
      if (!owner.isOwner()) {
        done[i] = withContext(
            (impl_->timeout ? owner.withTimeout(*impl_->timeout) : owner)
                .rpcAsyncOnLoop<&LocalOptimizer::step>(contextId, waitUs),
            label(i), /*ownerTimeout=*/true);
      }
    }
    // This worker's own optimizer steps on this thread: an RPC to itself
    // would cross its own transport loop twice and wake a worker thread
    // and then this one, for the same call (docs/dist_autograd.md).
    for (size_t i = 0; i < n; ++i) {
      const auto& owner = impl_->owners[i];
      if (owner.isOwner()) {
        Future<void> f;
        try {
          rpc::CurrentAgentScope agentScope(owner.state()->agent().get());
          f = owner.localValue()->step(contextId, waitUs);
        } catch (...) {
          f = makeErrorFuture<void>(errorFromCurrentException());
        }
        done[i] = withContext(f, label(i), /*ownerTimeout=*/true);
      }
    }
  }
  waitOwners(done, impl_->ownerNames, deadline, impl_->waitLimit, "step");
}

size_t DistributedOptimizer::numOwners() const { return impl_->owners.size(); }

std::vector<std::string> DistributedOptimizer::stateDict() const {
  const Deadline deadline = waitDeadline(impl_->waitLimit);
  std::vector<Future<std::string>> replies;
  std::vector<Future<void>> done;
  {
    rpc::AutogradContextScope noContext(0);
    for (size_t i = 0; i < impl_->owners.size(); ++i) {
      const auto& owner = impl_->owners[i];
      replies.push_back(
          (impl_->timeout ? owner.withTimeout(*impl_->timeout) : owner)
              .rpcAsync<&LocalOptimizer::saveState>());
      done.push_back(withContext(
          replies.back().then([](const std::string&) {}),
          "DistributedOptimizer: state of '" + impl_->ownerNames[i] + "'"));
    }
  }
  waitOwners(done, impl_->ownerNames, deadline, impl_->waitLimit,
             "saving the optimizer state");
  std::vector<std::string> out;
  out.reserve(replies.size());
  for (auto& r : replies) {
    out.push_back(r.value());
  }
  return out;
}

void DistributedOptimizer::loadStateDict(
    const std::vector<std::string>& state) {
  if (state.size() != impl_->owners.size()) {
    throwError(Error::invalidArgument(
        "DistributedOptimizer: the state has " + std::to_string(state.size()) +
        " parts, the optimizer " + std::to_string(impl_->owners.size()) +
        " owners"));
  }
  const Deadline deadline = waitDeadline(impl_->waitLimit);
  std::vector<Future<void>> done;
  {
    rpc::AutogradContextScope noContext(0);
    for (size_t i = 0; i < impl_->owners.size(); ++i) {
      const auto& owner = impl_->owners[i];
      done.push_back(withContext(
          (impl_->timeout ? owner.withTimeout(*impl_->timeout) : owner)
              .rpcAsync<&LocalOptimizer::loadState>(state[i])
              .then([](bool) {}),
          "DistributedOptimizer: loading the state on '" +
              impl_->ownerNames[i] + "'"));
    }
  }
  waitOwners(done, impl_->ownerNames, deadline, impl_->waitLimit,
             "loading the optimizer state");
}

// ---- OptimizerInBackward ---------------------------------------------------

struct OptimizerInBackward::Impl {
  Impl(const detail::OptimizerConfig& config, std::vector<at::Tensor> params,
       std::optional<Duration> t)
      : stepper(config, std::move(params)), timeout(t) {}
  detail::ParamStepper stepper;
  std::optional<Duration> timeout;  // as given
};

OptimizerInBackward::OptimizerInBackward(OptimizerSpec spec,
                                         std::vector<at::Tensor> params,
                                         std::optional<Duration> timeout) {
  if (params.empty()) {
    throwError(Error::invalidArgument(
        "OptimizerInBackward: the parameter list is empty"));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    detail::checkUpdatable(
        params[i], "OptimizerInBackward: parameter " + std::to_string(i));
  }
  // The fallback (the agent's call timeout) is known only in the backward;
  // this refuses a negative timeout now.
  timeoutOr(timeout, Duration::zero(), "OptimizerInBackward timeout");
  try {
    impl_ = std::make_shared<Impl>(detail::toConfig(spec), params, timeout);
  } catch (const c10::Error& e) {
    throwError(Error::invalidArgument(std::string("OptimizerInBackward: ") +
                                      e.what_without_backtrace()));
  }
  // The hook holds the stepper: a backward part that found the hook keeps
  // it alive after this object is gone.
  try {
    hook_ = registerAsyncLeafGradientHook(
        params, [impl = impl_](rpc::Agent& agent, uint64_t contextId,
                               std::vector<at::Tensor>& grads) {
          // Taken: none of them goes into the context.
          std::vector<at::Tensor> taken(grads.size());
          for (size_t i = 0; i < grads.size(); ++i) {
            taken[i] = std::exchange(grads[i], at::Tensor());
          }
          const Duration limit =
              timeoutOr(impl->timeout, agent.options().defaultTimeout,
                        "OptimizerInBackward timeout");
          return detail::gatedStep(
              agent, contextId, ownerWaitUs(limit),
              "the in-backward step of " + contextName(contextId),
              [impl, taken = std::move(taken)]() mutable {
                impl->stepper.apply(std::move(taken));
              });
        });
  } catch (const Exception& e) {
    throwError(e.error().withContext("OptimizerInBackward"));
  }
  detail::InBackwardParams::get().add(params);
}

OptimizerInBackward::~OptimizerInBackward() {
  hook_.reset();
  detail::InBackwardParams::get().remove(impl_->stepper.params());
}

std::string OptimizerInBackward::stateDict() const {
  return impl_->stepper.saveState();
}

void OptimizerInBackward::loadStateDict(const std::string& state) {
  try {
    impl_->stepper.loadState(state);
  } catch (const Exception& e) {
    throwError(e.error().withContext("OptimizerInBackward"));
  }
}

}  // namespace trellis::dist_autograd
