// The rendezvous over a store that c10d and etcd share (docs/elastic.md,
// "Several nodes: the c10d rendezvous", "The etcd rendezvous"): every agent
// joins rounds through RoundJoin (rendezvous.h), heartbeats on a thread of
// its own, and watches the round while its workers run. The backends
// (c10d_rendezvous.cc, etcd_rendezvous.cc) bring the store.
#include <algorithm>
#include <optional>
#include <span>
#include <thread>
#include <unistd.h>

#include <trellis/core/auth.h>
#include <trellis/core/deadline.h>
#include <trellis/core/mutex.h>
#include <trellis/core/net.h>
#include <trellis/core/text.h>
#include <trellis/core/thread_name.h>
#include <trellis/elastic/agent.h>
#include <trellis/elastic/rendezvous.h>
#include <trellis/elastic/store_rendezvous.h>
#include <trellis/store/tcp_store.h>

namespace trellis::elastic {

using namespace detail;

namespace {

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

bool isPrintableLine(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return static_cast<unsigned char>(c) >= 0x20 &&
           static_cast<unsigned char>(c) < 0x7f;
  });
}

template <class Rep, class Period>
std::string secs(std::chrono::duration<Rep, Period> d) {
  return formatDuration(std::chrono::duration_cast<Duration>(d));
}

class StoreRendezvous final : public Rendezvous {
 public:
  StoreRendezvous(const ElasticOptions& options, std::string runLogDir,
                  auth::JobToken token, LogFn log, RoundStore parts)
      : runLogDir_(std::move(runLogDir)),
        token_(std::move(token)),
        log_(std::move(log)),
        liveness_(options.rdzvConf.keepAliveInterval.value_or(
                      kDefaultKeepAliveInterval) *
                      options.rdzvConf.keepAliveMaxAttempt.value_or(
                          kDefaultKeepAliveMaxAttempt),
                  parts.liveness) {
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
    server_ = std::move(parts.server);
    workerStore_ = std::move(parts.workerStore);
    store_ = std::move(parts.store);
    beat_ = std::move(parts.beat);
    awaitChange_ = std::move(parts.awaitChange);
    // --local-addr, else TRELLIS_LOCAL_ADDR / TRELLIS_IFNAME, else the
    // local address of the route toward the endpoint (core/net.h), so a
    // multi-homed host names the interface its peers reach it on, as every
    // other layer would.
    self_.addr =
        net::chooseLocalAddress(options.localAddr.value_or(""), ep.host);
    checkToken("--local-addr", self_.addr);
    const auto nonce = auth::randomNonce();
    self_.id = hostName() + ":" + std::to_string(::getpid()) + ":" +
               toHex(std::span(nonce.data(), 4));
    fixedGroupRank_ = parts.fixedGroupRank;
    if (fixedGroupRank_) {
      claimNodeRank(*fixedGroupRank_);
    }
    // The first heartbeat before anyone can see us; then a thread.
    beat_(self_.id, true);
    heartbeat_ = std::thread([this] {
      setThreadName("rdzv-heartbeat");
      beat();
    });
  }

  ~StoreRendezvous() override {
    {
      MutexLock lock(mu_);
      stop_ = true;
    }
    cv_.notifyAll();
    if (heartbeat_.joinable()) {
      heartbeat_.join();
    }
    beat_ = nullptr;
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
        pause(kRoundKey, join.recordText());
      }
      current_ = join.record();
      // static: the node's --node-rank, claimed at start (every rank
      // 0..N-1 is claimed once by the N nodes of the closed round).
      const int32_t g = fixedGroupRank_ ? *fixedGroupRank_ : join.groupRank();
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
      o.round = current_.round;
      if (workerStore_) {
        // The workers meet in the store the agents use (c10d): its
        // endpoint, which every node reached; nothing to publish.
        o.useAgentStore = true;
        o.masterAddr = workerStore_->addr;
        o.masterPort = workerStore_->port;
      } else if (g == 0) {
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
          // (static: group rank 0 is not participants[0]; the read timeout
          // bounds the wait, and poll() sees the dead node later.)
          if (!fixedGroupRank_ &&
              liveness_.dead(current_.participants[0].id, RdzvClock::now())) {
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
          pause(masterKey, "");
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
        if (!isRecordToken(o.masterAddr)) {
          throwError(Error::protocol("rendezvous key '" + masterKey +
                                     "' holds no valid address"));
        }
        o.masterPort = static_cast<uint16_t>(*port);
      }
      log_("round " + std::to_string(current_.round) + ": group rank " +
           std::to_string(g) + " of " + std::to_string(n) + " nodes, world " +
           std::to_string(o.worldSize) + ", restart " +
           std::to_string(current_.restarts) + ", master " +
           net::bracketIfIpv6(o.masterAddr) + ":" +
           std::to_string(o.masterPort) +
           (o.useAgentStore ? " (the rendezvous store, shared with the "
                              "workers)"
                            : ""));
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
        log_("node " + p.id + " (" + p.addr + ") " +
             (liveness_.mode() == LivenessMode::kLease
                  ? "is gone: its etcd lease (TTL " + secs(liveness_.bound()) +
                        ") expired"
                  : "sent no heartbeat for " + secs(liveness_.bound())) +
             "; opening a new round");
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
          for (int64_t left = store_->add(leftKey, 0);
               left < n && RdzvClock::now() < until;
               left = store_->add(leftKey, 0)) {
            pause(leftKey, std::to_string(left));
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
      pause(doneKey, std::to_string(done));
    }
  }

  std::string failureNote() const override { return note_; }

 private:
  static constexpr std::chrono::milliseconds kStepPause{50};
  static constexpr std::chrono::milliseconds kObserveEvery{100};

  // Between moves: until `key` stops holding `seen` (the backend's Watch),
  // or a short pause.
  void pause(const std::string& key, const std::string& seen) {
    if (awaitChange_) {
      awaitChange_(key, seen);
    } else {
      std::this_thread::sleep_for(kStepPause);
    }
  }

  void observe(const RoundRecord& r) {
    // Between moves a node wakes at every write of any other (the change
    // ticks, etcd's Watch): one look at the heartbeats per kObserveEvery is
    // plenty against a bound of seconds, and the store serves every node.
    const auto now = RdzvClock::now();
    if (observedAt_ && now - *observedAt_ < kObserveEvery) {
      return;
    }
    observedAt_ = now;
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
    liveness_.observe(*store_, ids, now);
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
    for (;;) {
      {
        MutexLock lock(mu_);
        const auto until = Clock::now() + keepAlive_;
        while (!stop_ && Clock::now() < until) {
          cv_.waitUntil(mu_, until);
        }
        if (stop_) {
          return;
        }
      }
      try {
        beat_(self_.id, false);
      } catch (const std::exception& e) {
        log_(std::string("heartbeat failed; the store is gone? ") + e.what());
        return;
      }
    }
  }

  std::string runLogDir_;
  auth::JobToken token_;
  LogFn log_;
  Liveness liveness_;
  std::optional<RdzvClock::time_point> observedAt_;
  RoundParams params_;
  RoundNode self_;
  std::string endpointText_;
  std::chrono::seconds joinTimeout_{};
  std::chrono::seconds readTimeout_{};
  std::chrono::seconds barrierTimeout_{};
  std::chrono::seconds keepAlive_{};
  std::unique_ptr<store::TCPStoreServer> server_;
  std::optional<WorkerStoreEndpoint> workerStore_;
  std::optional<int32_t> fixedGroupRank_;

  // static: "trellis/rdzv/static/node<R>" holds the id of the node that
  // runs with --node-rank R; a second one is refused naming the first.
  void claimNodeRank(int32_t rank) {
    const std::string key =
        std::string(kKeyPrefix) + "static/node" + std::to_string(rank);
    const std::string mine = self_.id + " " + self_.addr;
    const std::string now = store_->compareSet(key, "", mine);
    if (now != mine) {
      const std::string other =
          now.substr(0, std::min<size_t>(now.size(), 200));
      throw InvalidArgumentError(Error::invalidArgument(
          "--node-rank " + std::to_string(rank) +
          " is already taken by another node of run '" + params_.runId + "' (" +
          (isPrintableLine(other) ? other : "?") +
          "): every node of a static rendezvous needs its own --node-rank"));
    }
  }
  std::unique_ptr<store::Store> store_;
  std::function<void(const std::string&, bool)> beat_;
  std::function<void(const std::string&, const std::string&)> awaitChange_;
  RoundRecord current_;
  std::string note_;
  Mutex mu_;
  CondVar cv_;
  bool stop_ TRELLIS_GUARDED_BY(mu_) = false;
  std::thread heartbeat_;
};

}  // namespace

void connectInSlices(
    const std::function<void(std::chrono::milliseconds window)>& connect,
    const Deadline& deadline, const Interruption& interrupted) {
  for (;;) {
    if (interrupted()) {
      throw Interrupted{};
    }
    try {
      connect(std::clamp(
          std::chrono::ceil<std::chrono::milliseconds>(deadline.remaining()),
          std::chrono::milliseconds(1), kConnectSlice));
      return;
    } catch (const ConnectionError&) {
      if (deadline.expired()) {
        throw;
      }
    }
  }
}

std::unique_ptr<Rendezvous> makeStoreRendezvous(const ElasticOptions& options,
                                                std::string runLogDir,
                                                auth::JobToken token, LogFn log,
                                                RoundStore parts) {
  return std::make_unique<StoreRendezvous>(options, std::move(runLogDir),
                                           std::move(token), std::move(log),
                                           std::move(parts));
}

}  // namespace trellis::elastic
