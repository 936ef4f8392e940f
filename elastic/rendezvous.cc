#include <algorithm>
#include <unistd.h>

#include <trellis/core/auth.h>
#include <trellis/core/deadline.h>
#include <trellis/core/text.h>
#include <trellis/elastic/agent.h>
#include <trellis/elastic/rendezvous.h>
#include <trellis/store/store.h>

namespace trellis::elastic {

using namespace detail;

namespace {

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

int64_t participantIndex(const RoundRecord& r, const std::string& id) {
  for (size_t i = 0; i < r.participants.size(); ++i) {
    if (r.participants[i].id == id) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

}  // namespace

namespace detail {

std::string roundKey(int64_t round, std::string_view leaf) {
  return std::string(kKeyPrefix) + "r" + std::to_string(round) + "/" +
         std::string(leaf);
}

std::string plural(size_t n, const char* what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
}

}  // namespace detail

std::string heartbeatKey(const std::string& nodeId) {
  return std::string(kKeyPrefix) + "hb/" + nodeId;
}

void Liveness::observe(store::Store& store, const std::vector<std::string>& ids,
                       RdzvClock::time_point now) {
  if (mode_ == LivenessMode::kCounter && ids.size() > 1) {
    // Every node observes every other between its moves: one request for
    // all the counters (two per node made a 64-node rendezvous 8,000
    // requests per step of all nodes, and the store server the
    // bottleneck). Heartbeat keys are never deleted, so once all exist
    // they are read without waiting.
    std::vector<std::string> keys;
    keys.reserve(ids.size());
    for (const auto& id : ids) {
      keys.push_back(heartbeatKey(id));
    }
    if (store.check(keys)) {
      const auto values = store.multiGet(keys);
      for (size_t i = 0; i < ids.size(); ++i) {
        note(ids[i], store::detail::addToCounter(keys[i], &values[i], 0), now);
      }
      return;
    }
  }
  for (const auto& id : ids) {
    const std::string key = heartbeatKey(id);
    int64_t counter = -1;
    if (mode_ == LivenessMode::kLease) {
      counter = store.check({key}) ? 0 : -1;
    } else if (store.check({key})) {
      // add(0) reads a counter atomically without waiting.
      counter = store.add(key, 0);
    }
    note(id, counter, now);
  }
}

void Liveness::note(const std::string& id, int64_t counter,
                    RdzvClock::time_point now) {
  auto [it, fresh] = seen_.try_emplace(id, Seen{counter, now});
  if (!fresh && it->second.counter != counter) {
    it->second = Seen{counter, now};
  }
}

bool Liveness::dead(const std::string& id, RdzvClock::time_point now) const {
  const auto it = seen_.find(id);
  if (mode_ == LivenessMode::kLease) {
    return it != seen_.end() && it->second.counter < 0;
  }
  return it != seen_.end() && now - it->second.since > bound_;
}

RoundRecord nextRound(const RoundRecord& from, const RoundParams& params,
                      bool counted, std::string note) {
  RoundRecord next;
  next.runId = from.runId;
  next.nproc = from.nproc;
  next.round = from.round + 1;
  next.restarts = from.restarts + (counted ? 1 : 0);
  next.phase = RoundPhase::kJoining;
  next.note = std::move(note);
  if (counted && next.restarts > params.maxRestarts) {
    next.phase = RoundPhase::kFailed;
    next.restarts = from.restarts;
    next.note = "the restart budget is spent (--max-restarts " +
                std::to_string(params.maxRestarts) + "): " + next.note;
  }
  return next;
}

const char* roundJoinStateName(RoundJoin::State state) {
  switch (state) {
    case RoundJoin::State::kStart:
      return "START";
    case RoundJoin::State::kJoined:
      return "JOINED";
    case RoundJoin::State::kWaiting:
      return "WAITING";
    case RoundJoin::State::kReady:
      return "READY";
    case RoundJoin::State::kJobFailed:
      return "JOB_FAILED";
  }
  return "?";
}

std::optional<RoundRecord> readRoundRecord(store::Store& store) {
  if (!store.check({kRoundKey})) {
    return std::nullopt;
  }
  RoundRecord r;
  throwIfError(decodeRoundRecord(store.getString(kRoundKey), &r));
  return r;
}

RoundJoin::RoundJoin(store::Store& store, RoundParams params, RoundNode self,
                     std::function<bool(const std::string&)> isDead)
    : store_(store),
      params_(std::move(params)),
      self_(std::move(self)),
      isDead_(std::move(isDead)) {}

bool RoundJoin::read() {
  if (!store_.check({kRoundKey})) {
    recordText_.clear();
    return false;
  }
  recordText_ = store_.getString(kRoundKey);
  RoundRecord r;
  throwIfError(decodeRoundRecord(recordText_, &r));
  if (r.runId != params_.runId) {
    throw InvalidArgumentError(Error::invalidArgument(
        "--rdzv-id '" + params_.runId + "' does not match run '" + r.runId +
        "' that the rendezvous store (key '" + kRoundKey +
        "') already serves"));
  }
  if (r.nproc != params_.nproc) {
    throw InvalidArgumentError(Error::invalidArgument(
        "--nproc-per-node " + std::to_string(params_.nproc) +
        " does not match the job's " + std::to_string(r.nproc) +
        " (the other nodes of run '" + r.runId + "')"));
  }
  record_ = std::move(r);
  return true;
}

bool RoundJoin::swap(const RoundRecord& next) {
  const std::string desired = encodeRoundRecord(next);
  const std::string now = store_.compareSet(kRoundKey, recordText_, desired);
  return now == desired;
}

int32_t RoundJoin::groupRank() const {
  return static_cast<int32_t>(participantIndex(record_, self_.id));
}

std::string RoundJoin::describe() const {
  return std::to_string(record_.participants.size()) + " of " +
         std::to_string(params_.minNodes) + ".." +
         std::to_string(params_.maxNodes) + " nodes in round " +
         std::to_string(record_.round) + " (" + roundPhaseName(record_.phase) +
         (record_.waiting.empty()
              ? ""
              : ", " + plural(record_.waiting.size(), "node") + " waiting") +
         "); this node " + roundJoinStateName(state_);
}

RoundJoin::State RoundJoin::step(RdzvClock::time_point now) {
  if (state_ == State::kReady || state_ == State::kJobFailed) {
    return state_;
  }
  if (!read()) {
    RoundRecord first;
    first.runId = params_.runId;
    first.nproc = params_.nproc;
    first.participants = {self_};
    first.phase =
        params_.maxNodes == 1 ? RoundPhase::kClosed : RoundPhase::kJoining;
    first.note = "the first round";
    recordText_.clear();
    if (swap(first)) {
      record_ = first;
      joinedRound_ = 0;
      if (params_.minNodes <= 1) {
        lastCallSince_ = now;
      }
      state_ =
          first.phase == RoundPhase::kClosed ? State::kReady : State::kJoined;
    }
    return state_;
  }
  if (record_.phase == RoundPhase::kFailed) {
    state_ = State::kJobFailed;
    return state_;
  }
  if (state_ != State::kStart && record_.round != joinedRound_) {
    // A new round opened while we were in (or waiting for) the old one.
    state_ = State::kStart;
    lastCallSince_.reset();
  }
  const int64_t me = participantIndex(record_, self_.id);
  if (record_.phase == RoundPhase::kClosed) {
    if (me >= 0) {
      joinedRound_ = record_.round;
      state_ = State::kReady;
      return state_;
    }
    for (const auto& p : record_.participants) {
      if (isDead_(p.id)) {
        // A dead member ends the closed round for everyone (counted).
        (void)swap(nextRound(record_, params_, true,
                             "node " + p.id + " stopped heartbeating"));
        return state_;
      }
    }
    if (!contains(record_.waiting, self_.id)) {
      RoundRecord next = record_;
      next.waiting.push_back(self_.id);
      if (!swap(next)) {
        return state_;
      }
    }
    joinedRound_ = record_.round;
    state_ = State::kWaiting;
    return state_;
  }
  // Joining: strike the dead first.
  RoundRecord pruned = record_;
  std::erase_if(pruned.participants, [&](const RoundNode& n) {
    return n.id != self_.id && isDead_(n.id);
  });
  if (pruned.participants.size() != record_.participants.size()) {
    (void)swap(pruned);
    return state_;
  }
  const auto size = static_cast<int32_t>(record_.participants.size());
  if (me < 0) {
    if (size >= params_.maxNodes) {
      return state_;  // full; it closes at once (the closer's next step)
    }
    RoundRecord next = record_;
    next.participants.push_back(self_);
    if (size + 1 >= params_.maxNodes) {
      next.phase = RoundPhase::kClosed;
    }
    if (swap(next)) {
      record_ = next;
      joinedRound_ = next.round;
      if (size + 1 >= params_.minNodes) {
        lastCallSince_ = now;
      }
      state_ =
          next.phase == RoundPhase::kClosed ? State::kReady : State::kJoined;
    }
    return state_;
  }
  joinedRound_ = record_.round;
  state_ = State::kJoined;
  if (size >= params_.maxNodes || (size >= params_.minNodes && lastCallSince_ &&
                                   now - *lastCallSince_ >= params_.lastCall)) {
    RoundRecord next = record_;
    next.phase = RoundPhase::kClosed;
    if (swap(next)) {
      record_ = next;
      state_ = State::kReady;
    }
    return state_;
  }
  if (size >= params_.minNodes) {
    if (!lastCallSince_) {
      lastCallSince_ = now;
    }
  } else {
    lastCallSince_.reset();
  }
  return state_;
}

Rendezvous::~Rendezvous() = default;

// ---- One node ---------------------------------------------------------------

namespace {

class LocalRendezvous final : public Rendezvous {
 public:
  LocalRendezvous(const ElasticOptions& options, std::string runLogDir,
                  auth::JobToken token)
      : options_(options),
        runLogDir_(std::move(runLogDir)),
        token_(std::move(token)) {}

  RendezvousOutcome next(const std::function<bool()>&) override {
    RendezvousOutcome o;
    o.worldSize = options_.nprocPerNode;
    o.masterAddr = options_.masterAddr;
    o.masterPort = options_.standalone ? pickFreePort(options_.masterAddr)
                                       : options_.masterPort;
    o.restartCount = restarts_;
    o.runId = options_.rdzvId;
    o.runLogDir = runLogDir_;
    o.jobToken = token_;
    return o;
  }
  GroupEvent poll() override { return GroupEvent::kNone; }
  GroupEvent reportFailure(const std::string& why) override {
    if (restarts_ < options_.maxRestarts) {
      ++restarts_;
      return GroupEvent::kRestart;
    }
    note_ = why;
    return GroupEvent::kJobFailed;
  }
  BarrierResult finish(const std::function<bool()>&) override { return {}; }
  std::string failureNote() const override { return note_; }

 private:
  const ElasticOptions& options_;
  std::string runLogDir_;
  auth::JobToken token_;
  int32_t restarts_ = 0;
  std::string note_;
};

}  // namespace

std::unique_ptr<Rendezvous> makeLocalRendezvous(const ElasticOptions& options,
                                                std::string runLogDir,
                                                auth::JobToken token) {
  return std::make_unique<LocalRendezvous>(options, std::move(runLogDir),
                                           std::move(token));
}

}  // namespace trellis::elastic
