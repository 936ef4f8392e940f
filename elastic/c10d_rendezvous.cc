// The c10d rendezvous (docs/elastic.md, "Several nodes: the c10d
// rendezvous"): one agent hosts a Trellis TCPStore at the endpoint, every
// agent connects to it, and the rounds run as store_rendezvous.h says.
// The static rendezvous of several nodes is the same with a fixed world:
// node rank 0 hosts the store at --master-addr:--master-port and every
// node's group rank is its --node-rank.
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

// Connects to the rendezvous store at `ep` and sets up the counter
// heartbeats over a connection of their own. `what` names the store in
// the error ("the c10d rendezvous endpoint H:P (--rdzv-endpoint)").
void connectRoundStore(RoundStore& parts, const Endpoint& ep,
                       const std::string& what,
                       std::chrono::milliseconds readTimeout,
                       std::chrono::milliseconds joinTimeout,
                       const auth::JobToken& token) {
  store::TCPStoreOptions co;
  co.host = ep.host;
  co.port = ep.port;
  co.timeout = readTimeout;
  co.connectTimeout = joinTimeout;
  co.jobToken = token;
  std::unique_ptr<store::TCPStore> tcp;
  try {
    tcp = std::make_unique<store::TCPStore>(co);
  } catch (const ConnectionError& e) {
    throw ConnectionError(Error::connection(
        "cannot reach " + what + " within join_timeout " +
        formatDuration(joinTimeout) + ": " + e.error().message()));
  }
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

}  // namespace

std::unique_ptr<Rendezvous> makeC10dRendezvous(const ElasticOptions& options,
                                               std::string runLogDir,
                                               auth::JobToken token, LogFn log,
                                               bool shareWithWorkers) {
  checkToken("--rdzv-id", options.rdzvId);
  const RdzvConf& conf = options.rdzvConf;
  const auto joinTimeout = conf.joinTimeout.value_or(kDefaultJoinTimeout);
  const auto readTimeout = conf.readTimeout.value_or(kDefaultReadTimeout);
  const Endpoint& ep = options.rdzvEndpoint;
  const std::string endpointText = ep.toString();
  RoundStore parts;
  // Host: bind the endpoint if we may and can; else connect.
  if (conf.isHost.value_or(true)) {
    try {
      store::TCPStoreServerOptions so;
      so.host = ep.host;
      so.port = ep.port;
      so.jobToken = token;
      parts.server = std::make_unique<store::TCPStoreServer>(so);
      log("hosting the c10d rendezvous store on " + endpointText);
    } catch (const Exception& e) {
      if (conf.isHost.value_or(false)) {
        throw ConnectionError(Error::connection(
            "is_host=true but the rendezvous endpoint " + endpointText +
            " cannot be bound: " + e.error().message()));
      }
      // Said, because what follows is a silent wait of up to join_timeout
      // for a store there: when the port is held by something that is not
      // this job's store, this line is the only clue.
      log("cannot bind the c10d rendezvous endpoint here (" +
          e.error().message() + "); joining the store at " + endpointText);
    }
  }
  connectRoundStore(
      parts, ep,
      "the c10d rendezvous endpoint " + endpointText + " (--rdzv-endpoint)",
      readTimeout, joinTimeout, token);
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

std::unique_ptr<Rendezvous> makeStaticRendezvous(const ElasticOptions& options,
                                                 std::string runLogDir,
                                                 auth::JobToken token,
                                                 LogFn log) {
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
    store::TCPStoreServerOptions so;
    so.host = ep.host;
    so.port = ep.port;
    so.jobToken = token;
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
                    readTimeout, joinTimeout, token);
  parts.fixedGroupRank = o.nodeRank;
  return makeStoreRendezvous(o, std::move(runLogDir), std::move(token),
                             std::move(log), std::move(parts));
}

}  // namespace trellis::elastic
