#include <algorithm>
#include <arpa/inet.h>
#include <condition_variable>
#include <mutex>
#include <netdb.h>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

#include <trellis/core/auth.h>
#include <trellis/core/deadline.h>
#include <trellis/core/text.h>
#include <trellis/elastic/agent.h>
#include <trellis/elastic/rendezvous.h>
#include <trellis/store/tcp_store.h>

namespace trellis::elastic {

namespace {

constexpr std::string_view kMagic = "trellis-rdzv-round 1";

std::string roundKey(int64_t round, std::string_view leaf) {
  return std::string(kKeyPrefix) + "r" + std::to_string(round) + "/" +
         std::string(leaf);
}

Error garbage(const std::string& why) {
  return Error::protocol(std::string("rendezvous record '") + kRoundKey +
                         "' is not valid: " + why);
}

void checkToken(std::string_view what, std::string_view s) {
  if (!isRecordToken(s)) {
    throw InvalidArgumentError(Error::invalidArgument(
        std::string(what) + " '" + std::string(s) +
        "' cannot go into the rendezvous record: it must be 1 to " +
        std::to_string(kMaxRecordField) +
        " printable ASCII characters without spaces"));
  }
}

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

std::string plural(size_t n, const char* what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
}

}  // namespace

const char* roundPhaseName(RoundPhase phase) {
  switch (phase) {
    case RoundPhase::kJoining:
      return "joining";
    case RoundPhase::kClosed:
      return "closed";
    case RoundPhase::kFailed:
      return "failed";
  }
  return "?";
}

bool isRecordToken(std::string_view s) {
  if (s.empty() || s.size() > kMaxRecordField) {
    return false;
  }
  return std::all_of(s.begin(), s.end(), [](char c) {
    return static_cast<unsigned char>(c) > 0x20 &&
           static_cast<unsigned char>(c) < 0x7f;
  });
}

std::string encodeRoundRecord(const RoundRecord& r) {
  checkToken("the run id", r.runId);
  std::string out(kMagic);
  out += "\nrun " + r.runId;
  out += "\nnproc " + std::to_string(r.nproc);
  out += "\nround " + std::to_string(r.round);
  out += std::string("\nphase ") + roundPhaseName(r.phase);
  out += "\nrestarts " + std::to_string(r.restarts);
  for (const auto& n : r.participants) {
    checkToken("the node id", n.id);
    checkToken("the node address", n.addr);
    out += "\nnode " + n.id + " " + n.addr;
  }
  for (const auto& w : r.waiting) {
    checkToken("the node id", w);
    out += "\nwaiting " + w;
  }
  std::string note = r.note.substr(0, kMaxRecordField);
  for (char& c : note) {
    if (static_cast<unsigned char>(c) < 0x20 ||
        static_cast<unsigned char>(c) >= 0x7f) {
      c = '?';
    }
  }
  out += "\nnote " + note + "\n";
  return out;
}

Error decodeRoundRecord(std::string_view text, RoundRecord* out) {
  RoundRecord r;
  bool seen[6] = {};  // run nproc round phase restarts note
  size_t pos = 0;
  size_t lineNo = 0;
  auto number = [](std::string_view v, int64_t lo, int64_t hi,
                   int64_t* to) -> bool {
    const auto n = parseDecimal(v);
    if (!n || *n < lo || *n > hi) {
      return false;
    }
    *to = *n;
    return true;
  };
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    if (nl == std::string_view::npos) {
      return garbage("line " + std::to_string(lineNo + 1) +
                     " does not end with a newline");
    }
    const std::string_view line = text.substr(pos, nl - pos);
    pos = nl + 1;
    ++lineNo;
    const std::string where = "line " + std::to_string(lineNo);
    if (lineNo == 1) {
      if (line != kMagic) {
        return garbage("expected '" + std::string(kMagic) + "' on line 1");
      }
      continue;
    }
    const size_t sp = line.find(' ');
    if (sp == std::string_view::npos) {
      return garbage(where + " has no value");
    }
    const std::string_view field = line.substr(0, sp);
    const std::string_view value = line.substr(sp + 1);
    auto once = [&](int i) {
      if (seen[i]) {
        return false;
      }
      seen[i] = true;
      return true;
    };
    int64_t n = 0;
    if (field == "run") {
      if (!once(0) || !isRecordToken(value)) {
        return garbage(where + ": a bad or repeated run id");
      }
      r.runId = value;
    } else if (field == "nproc") {
      if (!once(1) || !number(value, 1, 1 << 20, &n)) {
        return garbage(where + ": a bad or repeated nproc");
      }
      r.nproc = static_cast<int32_t>(n);
    } else if (field == "round") {
      if (!once(2) || !number(value, 0, int64_t{1} << 62, &n)) {
        return garbage(where + ": a bad or repeated round number");
      }
      r.round = n;
    } else if (field == "phase") {
      if (!once(3)) {
        return garbage(where + ": a repeated phase");
      }
      if (value == "joining") {
        r.phase = RoundPhase::kJoining;
      } else if (value == "closed") {
        r.phase = RoundPhase::kClosed;
      } else if (value == "failed") {
        r.phase = RoundPhase::kFailed;
      } else {
        return garbage(where + ": unknown phase");
      }
    } else if (field == "restarts") {
      if (!once(4) || !number(value, 0, 1 << 30, &n)) {
        return garbage(where + ": a bad or repeated restart count");
      }
      r.restarts = static_cast<int32_t>(n);
    } else if (field == "node") {
      const size_t sp2 = value.find(' ');
      if (sp2 == std::string_view::npos ||
          !isRecordToken(value.substr(0, sp2)) ||
          !isRecordToken(value.substr(sp2 + 1))) {
        return garbage(where + ": a node needs an id and an address");
      }
      if (r.participants.size() >= kMaxRecordNodes) {
        return garbage("more than " + std::to_string(kMaxRecordNodes) +
                       " nodes");
      }
      RoundNode node{std::string(value.substr(0, sp2)),
                     std::string(value.substr(sp2 + 1))};
      if (participantIndex(r, node.id) >= 0) {
        return garbage(where + ": node '" + node.id + "' appears twice");
      }
      r.participants.push_back(std::move(node));
    } else if (field == "waiting") {
      if (!isRecordToken(value) || contains(r.waiting, std::string(value))) {
        return garbage(where + ": a bad or repeated waiting node");
      }
      if (r.waiting.size() >= kMaxRecordNodes) {
        return garbage("more than " + std::to_string(kMaxRecordNodes) +
                       " waiting nodes");
      }
      r.waiting.emplace_back(value);
    } else if (field == "note") {
      if (!once(5) || value.size() > kMaxRecordField ||
          std::any_of(value.begin(), value.end(), [](char c) {
            return static_cast<unsigned char>(c) < 0x20 ||
                   static_cast<unsigned char>(c) >= 0x7f;
          })) {
        return garbage(where + ": a bad or repeated note");
      }
      r.note = value;
    } else {
      return garbage(where + ": unknown field");
    }
  }
  if (lineNo == 0) {
    return garbage("it is empty");
  }
  for (bool s : seen) {
    if (!s) {
      return garbage(
          "a field is missing (run, nproc, round, phase, restarts, note)");
    }
  }
  if (r.phase != RoundPhase::kJoining && r.participants.empty() &&
      r.phase != RoundPhase::kFailed) {
    return garbage("a closed round without nodes");
  }
  *out = std::move(r);
  return Error();
}

std::string heartbeatKey(const std::string& nodeId) {
  return std::string(kKeyPrefix) + "hb/" + nodeId;
}

void Liveness::observe(store::Store& store, const std::vector<std::string>& ids,
                       RdzvClock::time_point now) {
  for (const auto& id : ids) {
    const std::string key = heartbeatKey(id);
    int64_t counter = -1;
    if (store.check({key})) {
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

// ---- c10d -------------------------------------------------------------------

std::string hostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') {
    return "node";
  }
  std::string s(buf);
  for (char& c : s) {
    if (!isRecordToken(std::string_view(&c, 1))) {
      c = '_';
    }
  }
  return s.substr(0, 200);
}

template <class Rep, class Period>
std::string secs(std::chrono::duration<Rep, Period> d) {
  return formatDuration(std::chrono::duration_cast<Duration>(d));
}

class C10dRendezvous final : public Rendezvous {
 public:
  C10dRendezvous(const ElasticOptions& options, std::string runLogDir,
                 auth::JobToken token, LogFn log)
      : runLogDir_(std::move(runLogDir)),
        token_(std::move(token)),
        log_(std::move(log)),
        liveness_(options.rdzvConf.keepAliveInterval.value_or(
                      kDefaultKeepAliveInterval) *
                  options.rdzvConf.keepAliveMaxAttempt.value_or(
                      kDefaultKeepAliveMaxAttempt)) {
    checkToken("--rdzv-id", options.rdzvId);
    const RdzvConf& conf = options.rdzvConf;
    joinTimeout_ = conf.joinTimeout.value_or(kDefaultJoinTimeout);
    readTimeout_ = conf.readTimeout.value_or(kDefaultReadTimeout);
    barrierTimeout_ =
        conf.exitBarrierTimeout.value_or(kDefaultExitBarrierTimeout);
    keepAlive_ = conf.keepAliveInterval.value_or(kDefaultKeepAliveInterval);
    params_.runId = options.rdzvId;
    params_.nproc = options.nprocPerNode;
    params_.minNodes = options.minNodes;
    params_.maxNodes = options.maxNodes;
    params_.lastCall = conf.lastCallTimeout.value_or(kDefaultLastCallTimeout);
    params_.maxRestarts = options.maxRestarts;
    const Endpoint& ep = options.rdzvEndpoint;
    endpointText_ = ep.toString();

    // Host: bind the endpoint if we may and can; else connect.
    if (conf.isHost.value_or(true)) {
      try {
        store::TCPStoreServerOptions so;
        so.host = ep.host;
        so.port = ep.port;
        so.jobToken = token_;
        server_ = std::make_unique<store::TCPStoreServer>(so);
        log_("hosting the c10d rendezvous store on " + endpointText_);
      } catch (const Exception& e) {
        if (conf.isHost.value_or(false)) {
          throw ConnectionError(Error::connection(
              "is_host=true but the rendezvous endpoint " + endpointText_ +
              " cannot be bound: " + e.error().message()));
        }
      }
    }
    store::TCPStoreOptions co;
    co.host = ep.host;
    co.port = ep.port;
    co.timeout = readTimeout_;
    co.connectTimeout = joinTimeout_;
    co.jobToken = token_;
    try {
      store_ = std::make_unique<store::TCPStore>(co);
    } catch (const ConnectionError& e) {
      throw ConnectionError(Error::connection(
          "cannot reach the c10d rendezvous endpoint " + endpointText_ +
          " (--rdzv-endpoint) within join_timeout " + secs(joinTimeout_) +
          ": " + e.error().message()));
    }
    self_.addr =
        options.localAddr ? *options.localAddr : localAddressToward(ep.host);
    checkToken("--local-addr", self_.addr);
    const auto nonce = auth::randomNonce();
    self_.id = hostName() + ":" + std::to_string(::getpid()) + ":" +
               toHex(std::span(nonce.data(), 4));
    // The first heartbeat before anyone can see us; then a thread.
    (void)store_->add(heartbeatKey(self_.id), 1);
    heartbeatStore_ = store_->clone(readTimeout_);
    heartbeat_ = std::thread([this] { beat(); });
  }

  ~C10dRendezvous() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (heartbeat_.joinable()) {
      heartbeat_.join();
    }
    heartbeatStore_.reset();
    store_.reset();
    if (server_) {
      server_->stop();
    }
  }

  RendezvousOutcome next(const std::function<bool()>& interrupted) override {
    const auto deadline = RdzvClock::now() + joinTimeout_;
    for (;;) {
      RoundJoin join(*store_, params_, self_, [this](const std::string& id) {
        return id != self_.id && liveness_.dead(id, RdzvClock::now());
      });
      RoundJoin::State state = RoundJoin::State::kStart;
      RoundJoin::State logged = state;
      while (state != RoundJoin::State::kReady) {
        if (interrupted()) {
          throw Interrupted{};
        }
        const auto now = RdzvClock::now();
        state = join.step(now);
        observe(join.record());
        if (state == RoundJoin::State::kJobFailed) {
          note_ = join.record().note;
          throw JobFailed{note_};
        }
        if (state != logged && state == RoundJoin::State::kWaiting) {
          log_("round " + std::to_string(join.record().round) +
               " is closed; on its waiting list until the next round");
        }
        logged = state;
        if (state == RoundJoin::State::kReady) {
          break;
        }
        if (now >= deadline) {
          throw TimeoutError(Error::timeout(
              "rendezvous '" + params_.runId + "' at " + endpointText_ +
              " did not complete within join_timeout " + secs(joinTimeout_) +
              ": " + join.describe()));
        }
        std::this_thread::sleep_for(kStepPause);
      }
      current_ = join.record();
      const int32_t g = join.groupRank();
      const auto n = static_cast<int32_t>(current_.participants.size());
      const std::string masterKey = roundKey(current_.round, "master");
      RendezvousOutcome o;
      o.groupRank = g;
      o.groupWorldSize = n;
      o.rankOffset = g * params_.nproc;
      o.worldSize = n * params_.nproc;
      o.restartCount = current_.restarts;
      o.runId = params_.runId;
      o.runLogDir = runLogDir_;
      o.jobToken = token_;
      if (g == 0) {
        o.masterAddr = self_.addr;
        o.masterPort = pickFreePort(self_.addr);
        store_->set(masterKey,
                    o.masterAddr + " " + std::to_string(o.masterPort));
      } else {
        // Group rank 0 publishes the workers' master; if the round moves on
        // meanwhile (it died), join the next one.
        const auto readDeadline = RdzvClock::now() + readTimeout_;
        bool moved = false;
        while (!store_->check({masterKey})) {
          if (interrupted()) {
            throw Interrupted{};
          }
          std::string text;
          const RoundRecord r = readRaw(&text);
          if (r.round != current_.round) {
            moved = true;
            break;
          }
          observe(r);
          if (liveness_.dead(current_.participants[0].id, RdzvClock::now())) {
            (void)propose(text,
                          nextRound(r, params_, true,
                                    "node " + current_.participants[0].id +
                                        " stopped heartbeating"));
          }
          if (RdzvClock::now() >= readDeadline) {
            throw TimeoutError(Error::timeout(
                "group rank 0 of round " + std::to_string(current_.round) +
                " (" + current_.participants[0].addr +
                ") published no master address within read_timeout " +
                secs(readTimeout_)));
          }
          std::this_thread::sleep_for(kStepPause);
        }
        if (moved) {
          continue;
        }
        const std::string m = store_->getString(masterKey);
        const size_t sp = m.rfind(' ');
        const auto port =
            sp == std::string::npos
                ? std::nullopt
                : parseDecimal(std::string_view(m).substr(sp + 1));
        if (!port || *port <= 0 || *port > 65535) {
          throwError(Error::protocol("rendezvous key '" + masterKey +
                                     "' is not 'ADDR PORT'"));
        }
        o.masterAddr = m.substr(0, sp);
        o.masterPort = static_cast<uint16_t>(*port);
      }
      log_("round " + std::to_string(current_.round) + ": group rank " +
           std::to_string(g) + " of " + std::to_string(n) + " nodes, world " +
           std::to_string(o.worldSize) + ", restart " +
           std::to_string(current_.restarts) + ", master " + o.masterAddr +
           ":" + std::to_string(o.masterPort));
      return o;
    }
  }

  GroupEvent poll() override { return check(true); }

  // What the round record and the heartbeats say. `scaleUp`: whether
  // waiting nodes may open a new round (not once a node of this round has
  // finished: its workers' work is done and must not run again for them).
  GroupEvent check(bool scaleUp) {
    std::string text;
    const RoundRecord rec = readRaw(&text);
    const RoundRecord* r = &rec;
    if (r->round != current_.round) {
      return eventOf(*r);
    }
    observe(*r);
    const auto now = RdzvClock::now();
    for (const auto& p : r->participants) {
      if (p.id != self_.id && liveness_.dead(p.id, now)) {
        log_("node " + p.id + " (" + p.addr + ") sent no heartbeat for " +
             secs(liveness_.bound()) + "; opening a new round");
        return propose(text,
                       nextRound(*r, params_, true,
                                 "node " + p.id + " stopped heartbeating"));
      }
    }
    size_t waitingAlive = 0;
    for (const auto& w : r->waiting) {
      waitingAlive += liveness_.dead(w, now) ? 0 : 1;
    }
    if (scaleUp && waitingAlive > 0 &&
        static_cast<int32_t>(r->participants.size()) < params_.maxNodes &&
        store_->add(roundKey(current_.round, "done"), 0) == 0) {
      log_(plural(waitingAlive, "node") +
           " waiting to join; opening a new round (scale up)");
      return propose(
          text,
          nextRound(*r, params_, false,
                    "scale up: " + plural(waitingAlive, "node") + " waiting"));
    }
    return GroupEvent::kNone;
  }

  GroupEvent reportFailure(const std::string& why) override {
    std::string text;
    const RoundRecord r = readRaw(&text);
    if (r.round != current_.round) {
      return eventOf(r);
    }
    return propose(text, nextRound(r, params_, true, why));
  }

  BarrierResult finish(const std::function<bool()>& interrupted) override {
    const std::string doneKey = roundKey(current_.round, "done");
    const std::string leftKey = roundKey(current_.round, "left");
    const auto n = static_cast<int64_t>(current_.participants.size());
    (void)store_->add(doneKey, 1);
    const auto deadline = RdzvClock::now() + barrierTimeout_;
    for (;;) {
      if (interrupted()) {
        throw Interrupted{};
      }
      const int64_t done = store_->add(doneKey, 0);
      if (done >= n) {
        (void)store_->add(leftKey, 1);
        if (server_) {
          // The host serves the store until every node has seen the
          // barrier pass (bounded: a node may die right after).
          const auto until = RdzvClock::now() + keepAlive_ * 2;
          while (store_->add(leftKey, 0) < n && RdzvClock::now() < until) {
            std::this_thread::sleep_for(kStepPause);
          }
        }
        return {};
      }
      const GroupEvent ev = check(false);
      if (ev != GroupEvent::kNone) {
        return {ev, ev == GroupEvent::kJobFailed
                        ? note_
                        : "a new round opened at the exit barrier"};
      }
      if (RdzvClock::now() >= deadline) {
        return {GroupEvent::kJobFailed,
                "exit barrier: " + std::to_string(done) + " of " +
                    std::to_string(n) +
                    " nodes finished within exit_barrier_timeout " +
                    secs(barrierTimeout_)};
      }
      std::this_thread::sleep_for(kStepPause);
    }
  }

  std::string failureNote() const override { return note_; }

 private:
  static constexpr std::chrono::milliseconds kStepPause{50};

  void observe(const RoundRecord& r) {
    std::vector<std::string> ids;
    for (const auto& p : r.participants) {
      if (p.id != self_.id) {
        ids.push_back(p.id);
      }
    }
    for (const auto& w : r.waiting) {
      if (w != self_.id) {
        ids.push_back(w);
      }
    }
    liveness_.observe(*store_, ids, RdzvClock::now());
  }

  GroupEvent eventOf(const RoundRecord& r) {
    if (r.phase == RoundPhase::kFailed) {
      note_ = r.note;
      return GroupEvent::kJobFailed;
    }
    if (r.round != current_.round) {
      return GroupEvent::kRestart;
    }
    return GroupEvent::kNone;
  }

  // Reads the record and its exact text (the compareSet's expectation).
  RoundRecord readRaw(std::string* text) {
    if (!store_->check({kRoundKey})) {
      throwError(garbage("it disappeared"));
    }
    *text = store_->getString(kRoundKey);
    RoundRecord r;
    throwIfError(decodeRoundRecord(*text, &r));
    return r;
  }

  // compareSets the record read as `expected` to `next`; the event of
  // whatever record is there afterwards (ours, or the one that beat us).
  GroupEvent propose(const std::string& expected, const RoundRecord& next) {
    const std::string now =
        store_->compareSet(kRoundKey, expected, encodeRoundRecord(next));
    RoundRecord after;
    throwIfError(decodeRoundRecord(now, &after));
    return eventOf(after);
  }

  void beat() {
    std::unique_lock lock(mu_);
    while (!stop_) {
      if (cv_.wait_for(lock, keepAlive_, [this] { return stop_; })) {
        return;
      }
      lock.unlock();
      try {
        (void)heartbeatStore_->add(heartbeatKey(self_.id), 1);
      } catch (const std::exception& e) {
        log_(std::string("heartbeat failed; the store is gone? ") + e.what());
        return;
      }
      lock.lock();
    }
  }

  std::string runLogDir_;
  auth::JobToken token_;
  LogFn log_;
  Liveness liveness_;
  RoundParams params_;
  RoundNode self_;
  std::string endpointText_;
  std::chrono::seconds joinTimeout_{};
  std::chrono::seconds readTimeout_{};
  std::chrono::seconds barrierTimeout_{};
  std::chrono::seconds keepAlive_{};
  std::unique_ptr<store::TCPStoreServer> server_;
  std::unique_ptr<store::TCPStore> store_;
  std::unique_ptr<store::Store> heartbeatStore_;
  RoundRecord current_;
  std::string note_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread heartbeat_;
};

}  // namespace

std::unique_ptr<Rendezvous> makeLocalRendezvous(const ElasticOptions& options,
                                                std::string runLogDir,
                                                auth::JobToken token) {
  return std::make_unique<LocalRendezvous>(options, std::move(runLogDir),
                                           std::move(token));
}

std::unique_ptr<Rendezvous> makeC10dRendezvous(const ElasticOptions& options,
                                               std::string runLogDir,
                                               auth::JobToken token,
                                               LogFn log) {
  return std::make_unique<C10dRendezvous>(options, std::move(runLogDir),
                                          std::move(token), std::move(log));
}

std::string localAddressToward(const std::string& endpointHost) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(endpointHost.c_str(), "9", &hints, &res) != 0) {
    return "127.0.0.1";
  }
  std::string out = "127.0.0.1";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    // A UDP connect sends nothing; it only picks the route.
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET6_ADDRSTRLEN] = {};
      const void* src =
          local.ss_family == AF_INET6
              ? static_cast<const void*>(
                    &reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
              : static_cast<const void*>(
                    &reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (::inet_ntop(local.ss_family, src, buf, sizeof(buf)) != nullptr) {
        out = buf;
        ::close(fd);
        break;
      }
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return out;
}

}  // namespace trellis::elastic
