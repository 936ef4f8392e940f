// The etcd rendezvous (docs/elastic.md, "The etcd rendezvous"): the rounds
// of the c10d rendezvous (store_rendezvous.h) in an etcd server, through
// EtcdStore, with etcd leases for liveness.
#include <trellis/core/deadline.h>
#include <trellis/elastic/etcd_store.h>
#include <trellis/elastic/rendezvous.h>
#include <trellis/elastic/store_rendezvous.h>

namespace trellis::elastic {

namespace {

constexpr std::chrono::milliseconds kAwaitBound{200};

// A node's lease and its heartbeat key, kept alive from the heartbeat
// thread (the agent's thread only reads others' keys).
class LeaseHeart {
 public:
  LeaseHeart(std::unique_ptr<store::Store> store, std::chrono::seconds ttl,
             LogFn log)
      : store_(std::move(store)), ttl_(ttl), log_(std::move(log)) {}

  void operator()(const std::string& id, bool first) {
    auto& etcd = static_cast<EtcdStore&>(*store_);
    if (first) {
      attach(etcd, id);
      return;
    }
    try {
      if (etcd.keepAlive(lease_) <= 0) {
        // Expired while we could not reach etcd: the others have seen this
        // node dead and moved on; a fresh lease lets it join the next round.
        log_("the etcd lease of this node expired; granting a new one");
        attach(etcd, id);
      }
      failing_ = false;
    } catch (const Exception& e) {
      // Keep trying every interval: etcd may come back before the TTL.
      if (!failing_) {
        log_("etcd keep-alive failed (retrying every interval): " +
             e.error().message());
      }
      failing_ = true;
    }
  }

 private:
  void attach(EtcdStore& etcd, const std::string& id) {
    lease_ = etcd.grantLease(ttl_);
    etcd.setWithLease(heartbeatKey(id), "alive", lease_);
  }

  std::unique_ptr<store::Store> store_;
  std::chrono::seconds ttl_;
  LogFn log_;
  // Touched by the constructing thread once, then only by the heartbeat
  // thread (std::thread's start orders the two).
  int64_t lease_ = 0;
  bool failing_ = false;
};

}  // namespace

std::unique_ptr<Rendezvous> makeEtcdRendezvous(
    const ElasticOptions& options, std::string runLogDir, auth::JobToken token,
    LogFn log, const Interruption& interrupted) {
  detail::checkToken("--rdzv-id", options.rdzvId);
  const RdzvConf& conf = options.rdzvConf;
  if (conf.isHost.has_value()) {
    throw InvalidArgumentError(Error::invalidArgument(
        "--rdzv-conf is_host: only the c10d rendezvous hosts a store; etcd "
        "is its own server"));
  }
  const auto joinTimeout = conf.joinTimeout.value_or(kDefaultJoinTimeout);
  const auto readTimeout = conf.readTimeout.value_or(kDefaultReadTimeout);
  const auto interval =
      conf.keepAliveInterval.value_or(kDefaultKeepAliveInterval);
  const auto ttl =
      interval * conf.keepAliveMaxAttempt.value_or(kDefaultKeepAliveMaxAttempt);
  const Endpoint& ep = options.rdzvEndpoint;

  EtcdStoreOptions so;
  so.host = ep.host;
  so.port = ep.port;
  so.prefix = "/trellis/rdzv/" + options.rdzvId + "/";
  so.strip = kKeyPrefix;
  so.timeout = readTimeout;
  RoundStore parts;
  std::unique_ptr<EtcdStore> etcd;
  try {
    connectInSlices(
        [&](std::chrono::milliseconds window) {
          so.connectTimeout = window;
          etcd = std::make_unique<EtcdStore>(so);
        },
        Deadline::fromTimeout(joinTimeout), interrupted);
  } catch (const ConnectionError& e) {
    throw ConnectionError(Error::connection(
        "cannot reach the etcd rendezvous endpoint " + ep.toString() +
        " (--rdzv-endpoint) within join_timeout " +
        formatDuration(joinTimeout) + "; last try: " + e.error().message()));
  }
  // The keep-alives go through a handle with a timeout of one interval, so
  // a slow etcd cannot hold the heartbeat thread past its next beat.
  auto heart = std::make_shared<LeaseHeart>(etcd->clone(interval), ttl, log);
  parts.beat = [heart](const std::string& id, bool first) {
    (*heart)(id, first);
  };
  // Between rendezvous moves: a Watch on the key the node waits on, so a
  // move by another node wakes it at once; bounded, so the last-call timer,
  // expired leases and signals are still seen within kAwaitBound.
  EtcdStore* watcher = etcd.get();
  parts.awaitChange = [watcher](const std::string& key,
                                const std::string& seen) {
    (void)watcher->waitForChange(key, seen, kAwaitBound);
  };
  parts.store = std::move(etcd);
  parts.liveness = LivenessMode::kLease;
  log("etcd rendezvous at " + ep.toString() + ", keys under " + so.prefix +
      ", lease TTL " + formatDuration(ttl));
  return makeStoreRendezvous(options, std::move(runLogDir), std::move(token),
                             std::move(log), std::move(parts));
}

}  // namespace trellis::elastic
