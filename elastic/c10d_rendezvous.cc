// The c10d rendezvous (docs/elastic.md, "Several nodes: the c10d
// rendezvous"): one agent hosts a Trellis TCPStore at the endpoint, every
// agent connects to it, and the rounds run as store_rendezvous.h says.
// The static rendezvous of several nodes is the same with a fixed world:
// node rank 0 hosts the store at --master-addr:--master-port and every
// node's group rank is its --node-rank.
#include <algorithm>
#include <random>
#include <thread>

#include <trellis/core/deadline.h>
#include <trellis/elastic/change_store.h>
#include <trellis/elastic/rendezvous.h>
#include <trellis/elastic/store_rendezvous.h>
#include <trellis/store/tcp_store.h>

namespace trellis::elastic {

using namespace detail;

namespace {

// How long a node waits for a move of another node before it looks at the
// clock and the heartbeats again (the last-call timer, dead nodes): the
// 50 ms it used to sleep between looks, now cut short by the move itself.
constexpr std::chrono::milliseconds kAwaitBound{50};

// The options of a store server at `ep` that admits holders of `token`.
store::TCPStoreServerOptions serverAt(const Endpoint& ep,
                                      const auth::JobToken& token) {
  store::TCPStoreServerOptions so;
  so.host = ep.host;
  so.port = ep.port;
  so.jobToken = token;
  return so;
}

// A client of the store at `ep`, connected (and authenticated) within
// `window`; a ConnectionError when nobody answered in time.
std::unique_ptr<store::TCPStore> connectStore(
    const Endpoint& ep, std::chrono::milliseconds readTimeout,
    std::chrono::milliseconds window, const auth::JobToken& token) {
  store::TCPStoreOptions co;
  co.host = ep.host;
  co.port = ep.port;
  co.timeout = readTimeout;
  co.connectTimeout = window;
  co.jobToken = token;
  return std::make_unique<store::TCPStore>(co);
}

// Sets up the round store over `tcp`, and the counter heartbeats over a
// connection of their own.
void useRoundStore(RoundStore& parts, std::unique_ptr<store::TCPStore> tcp,
                   std::chrono::milliseconds readTimeout) {
  // Heartbeats are never waited on: a plain handle, no change ticks.
  std::shared_ptr<store::Store> hb = tcp->clone(readTimeout);
  parts.beat = [hb](const std::string& id, bool) {
    (void)hb->add(heartbeatKey(id), 1);
  };
  auto changes = std::make_unique<ChangeStore>(std::move(tcp));
  ChangeStore* watcher = changes.get();
  parts.awaitChange = [watcher](const std::string& key,
                                const std::string& seen) {
    (void)watcher->waitForChange(key, seen, kAwaitBound);
  };
  parts.store = std::move(changes);
  parts.liveness = LivenessMode::kCounter;
}

// The error when join_timeout passed before the store answered; `why` is
// the last connect's error (each is bounded by a slice of join_timeout,
// connectInSlices).
std::string cannotReach(const std::string& what,
                        std::chrono::milliseconds joinTimeout,
                        const std::string& why) {
  return "cannot reach " + what + " within join_timeout " +
         formatDuration(joinTimeout) + "; last try: " + why;
}

// Connects to the rendezvous store at `ep`, retrying until join_timeout
// and looking for a signal about every second (connectInSlices). `what`
// names the store in the error ("the c10d rendezvous endpoint H:P
// (--rdzv-endpoint)").
void connectRoundStore(RoundStore& parts, const Endpoint& ep,
                       const std::string& what,
                       std::chrono::milliseconds readTimeout,
                       std::chrono::milliseconds joinTimeout,
                       const auth::JobToken& token,
                       const Interruption& interrupted) {
  std::unique_ptr<store::TCPStore> tcp;
  try {
    connectInSlices(
        [&](std::chrono::milliseconds window) {
          tcp = connectStore(ep, readTimeout, window, token);
        },
        Deadline::fromTimeout(joinTimeout), interrupted);
  } catch (const ConnectionError& e) {
    throw ConnectionError(
        Error::connection(cannotReach(what, joinTimeout, e.error().message())));
  }
  useRoundStore(parts, std::move(tcp), readTimeout);
}

// How long an agent that could not host the store first tries to join it
// before it tries to host again; later tries take connectInSlices' windows
// (kConnectSlice, so that it also looks for a signal that often).
constexpr std::chrono::milliseconds kFirstProbe{500};

// is_host unset: host the store at `ep`, or join the one there, whichever
// works first, until join_timeout. Hosting is tried again whenever nobody
// answers at the endpoint, not once: two agents that bind the same endpoint
// at the same moment can both be refused. Each sets SO_REUSEADDR, so both
// binds succeed; listen() then fails with EADDRINUSE on each when it sees
// the other's socket in the listening state for an instant (Linux marks a
// socket listening before it checks the port). On this project's VM, two
// processes racing so both lost in 22 and 24 of 3,000 rounds (two runs);
// agents that then only waited to join would wait, silent, for a store
// nobody hosts.
void hostOrJoin(RoundStore& parts, const Endpoint& ep,
                const std::string& endpointText, const std::string& what,
                std::chrono::milliseconds readTimeout,
                std::chrono::milliseconds joinTimeout,
                const auth::JobToken& token, const LogFn& log,
                const Interruption& interrupted) {
  const store::TCPStoreServerOptions so = serverAt(ep, token);
  const Deadline deadline = Deadline::fromTimeout(joinTimeout);
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> pauseMs(0, 50);
  int tries = 0;
  std::string hostError;
  // One try: host, or else join within `window`.
  const auto hostOrConnect = [&](std::chrono::milliseconds window) {
    ++tries;
    try {
      parts.server = std::make_unique<store::TCPStoreServer>(so);
      log("hosting the c10d rendezvous store on " + endpointText +
          (tries == 1 ? std::string()
                      : " (try " + std::to_string(tries) +
                            ": nobody answered there before)"));
      return;
    } catch (const Exception& e) {
      hostError = e.error().message();
    }
    if (tries == 1) {
      // Said, because what follows is a silent wait of up to join_timeout
      // for a store there: when the port is held by something that is not
      // this job's store, this line is the only clue.
      log("cannot bind the c10d rendezvous endpoint here (" + hostError +
          "); joining the store at " + endpointText);
      window = std::min(window, kFirstProbe);
    }
    try {
      useRoundStore(parts, connectStore(ep, readTimeout, window, token),
                    readTimeout);
    } catch (const ConnectionError&) {
      // Agents that lost a race together do not try again in step.
      std::this_thread::sleep_for(std::min<Duration>(
          std::chrono::milliseconds(pauseMs(rng)), deadline.remaining()));
      throw;
    }
  };
  try {
    connectInSlices(hostOrConnect, deadline, interrupted);
  } catch (const ConnectionError& e) {
    throw ConnectionError(
        Error::connection(cannotReach(what, joinTimeout, e.error().message()) +
                          "; hosting it here failed too: " + hostError));
  }
  if (parts.server) {
    connectRoundStore(parts, ep, what, readTimeout, joinTimeout, token,
                      interrupted);
  }
}

}  // namespace

std::unique_ptr<Rendezvous> makeC10dRendezvous(const ElasticOptions& options,
                                               std::string runLogDir,
                                               auth::JobToken token, LogFn log,
                                               const Interruption& interrupted,
                                               bool shareWithWorkers) {
  checkToken("--rdzv-id", options.rdzvId);
  const RdzvConf& conf = options.rdzvConf;
  const auto joinTimeout = conf.joinTimeout.value_or(kDefaultJoinTimeout);
  const auto readTimeout = conf.readTimeout.value_or(kDefaultReadTimeout);
  const Endpoint& ep = options.rdzvEndpoint;
  const std::string endpointText = ep.toString();
  const std::string what =
      "the c10d rendezvous endpoint " + endpointText + " (--rdzv-endpoint)";
  RoundStore parts;
  if (!conf.isHost.has_value()) {
    hostOrJoin(parts, ep, endpointText, what, readTimeout, joinTimeout, token,
               log, interrupted);
  } else {
    if (*conf.isHost) {
      const store::TCPStoreServerOptions so = serverAt(ep, token);
      try {
        parts.server = std::make_unique<store::TCPStoreServer>(so);
      } catch (const Exception& e) {
        throw ConnectionError(Error::connection(
            "is_host=true but the rendezvous endpoint " + endpointText +
            " cannot be bound: " + e.error().message()));
      }
      log("hosting the c10d rendezvous store on " + endpointText);
    }
    connectRoundStore(parts, ep, what, readTimeout, joinTimeout, token,
                      interrupted);
  }
  if (shareWithWorkers) {
    // torchrun's agent store: the workers use this store too, under
    // /worker/attempt_<N>/round_<R> (core/worker_env.h), far from
    // trellis/rdzv/. It lives as long as the hosting agent, across every
    // restart and round.
    parts.workerStore = WorkerStoreEndpoint{
        ep.host,
        ep.port != 0 || !parts.server ? ep.port : parts.server->port()};
  }
  return makeStoreRendezvous(options, std::move(runLogDir), std::move(token),
                             std::move(log), std::move(parts));
}

std::unique_ptr<Rendezvous> makeStaticRendezvous(
    const ElasticOptions& options, std::string runLogDir, auth::JobToken token,
    LogFn log, const Interruption& interrupted) {
  checkToken("--rdzv-id", options.rdzvId);
  if (options.minNodes != options.maxNodes) {
    throw InvalidArgumentError(Error::invalidArgument(
        "a static rendezvous has a fixed number of nodes (--nnodes N)"));
  }
  // torchrun's static rendezvous is bounded by `timeout`; join_timeout
  // means the same here, and wins when both are given.
  ElasticOptions o = options;
  if (!o.rdzvConf.joinTimeout && o.rdzvConf.timeout) {
    o.rdzvConf.joinTimeout = o.rdzvConf.timeout;
  }
  const RdzvConf& conf = o.rdzvConf;
  const auto joinTimeout = conf.joinTimeout.value_or(kDefaultJoinTimeout);
  const auto readTimeout = conf.readTimeout.value_or(kDefaultReadTimeout);
  const Endpoint& ep = o.rdzvEndpoint;
  const std::string endpointText = ep.toString();
  RoundStore parts;
  if (o.nodeRank == 0) {
    const store::TCPStoreServerOptions so = serverAt(ep, token);
    try {
      parts.server = std::make_unique<store::TCPStoreServer>(so);
    } catch (const Exception& e) {
      throw ConnectionError(Error::connection(
          "--node-rank 0 hosts the static rendezvous store at " + endpointText +
          " (--master-addr, --master-port) but cannot bind it: " +
          e.error().message()));
    }
    log("hosting the static rendezvous store on " + endpointText);
  }
  connectRoundStore(parts, ep,
                    "the static rendezvous store of node rank 0 at " +
                        endpointText + " (--master-addr, --master-port)",
                    readTimeout, joinTimeout, token, interrupted);
  parts.fixedGroupRank = o.nodeRank;
  return makeStoreRendezvous(o, std::move(runLogDir), std::move(token),
                             std::move(log), std::move(parts));
}

}  // namespace trellis::elastic
