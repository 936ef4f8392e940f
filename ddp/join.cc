#include <ATen/ops/full.h>
#include <string>
#include <unordered_set>
#include <utility>

#include <trellis/core/error.h>
#include <trellis/ddp/join.h>

namespace trellis::ddp {

Joinable::~Joinable() = default;

namespace {

at::Device firstDevice(const std::vector<Joinable*>& joinables) {
  return joinables.empty() || joinables.front() == nullptr
             ? at::Device(at::kCPU)
             : joinables.front()->joinDevice();
}

}  // namespace

Join::Join(std::vector<Joinable*> joinables, JoinOptions options)
    : joinables_(std::move(joinables)),
      options_(options),
      device_(firstDevice(joinables_)) {
  if (joinables_.empty()) {
    throwError(Error::invalidArgument("Join: no Joinables"));
  }
  std::unordered_set<Joinable*> seen;
  for (Joinable* j : joinables_) {
    if (j == nullptr) {
      throwError(Error::invalidArgument("Join: a Joinable is null"));
    }
    if (!seen.insert(j).second) {
      throwError(Error::invalidArgument("Join: a Joinable is listed twice"));
    }
    if (j->join_ != nullptr) {
      throwError(Error::invalidArgument(
          "Join: a Joinable is already attached to another Join"));
    }
  }
  group_ = joinables_.front()->joinProcessGroup();
  if (!group_) {
    throwError(Error::invalidArgument(
        "Join: the first Joinable has no process group"));
  }
  active_ = group_->size();
  for (Joinable* j : joinables_) {
    j->join_ = this;
  }
}

Join::~Join() {
  for (Joinable* j : joinables_) {
    j->join_ = nullptr;
  }
}

int Join::countAllreduce(int contribution) {
  at::Tensor count =
      at::full({1}, contribution, at::TensorOptions().dtype(at::kInt))
          .to(device_);
  group_->allreduce(count, collectives::ReduceOp::kSum).wait();  // bounded
  return count.cpu().item<int>();
}

void Join::throwEarlyTermination(int active) const {
  throwError(Error(
      Code::kFailedPrecondition,
      "Join: a rank ran out of inputs and throwOnEarlyTermination is set (" +
          std::to_string(active) + " of " + std::to_string(group_->size()) +
          " ranks still training); every rank stops here"));
}

int Join::notify(Joinable& joinable) {
  Join* join = joinable.join_;
  if (join == nullptr) {
    const auto group = joinable.joinProcessGroup();
    return group ? group->size() : 1;
  }
  if (!join->options_.enable) {
    return join->group_->size();
  }
  if (join->finished_) {
    throwError(Error(Code::kFailedPrecondition,
                     "Join: notify() after this rank's finish()"));
  }
  if (&joinable != join->joinables_.front()) {
    return join->active_;  // this iteration's count, already known
  }
  join->active_ = join->countAllreduce(1);
  if (join->options_.throwOnEarlyTermination &&
      join->active_ < join->group_->size()) {
    join->throwEarlyTermination(join->active_);
  }
  return join->active_;
}

void Join::finish() {
  if (finished_) {
    throwError(Error(Code::kFailedPrecondition, "Join: finish() called twice"));
  }
  finished_ = true;
  if (!options_.enable) {
    return;
  }
  std::vector<JoinHook> hooks;
  hooks.reserve(joinables_.size());
  for (Joinable* j : joinables_) {
    hooks.push_back(j->joinHook(options_));
  }
  bool isLastJoiner = true;
  for (;;) {
    // Pairs with the notify() of the ranks still training.
    const int active = countAllreduce(0);
    active_ = active;
    if (active == 0) {
      break;
    }
    if (options_.throwOnEarlyTermination) {
      throwEarlyTermination(active);
    }
    isLastJoiner = false;
    for (auto& h : hooks) {
      if (h.startHook) {
        h.startHook();
      }
    }
    for (auto& h : hooks) {
      if (h.mainHook) {
        h.mainHook();
      }
    }
  }
  for (auto& h : hooks) {
    if (h.postHook) {
      h.postHook(isLastJoiner);
    }
  }
}

}  // namespace trellis::ddp
