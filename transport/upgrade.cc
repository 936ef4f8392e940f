// The same-host upgrade's I/O (docs/transport.md, "Same-host upgrade"):
// the listener's automatic shm:// address and the bind read on each
// connection to it, and the pipe's side around the decisions its handshake
// (handshake.h) takes: registering and bounding the offer, connecting and
// binding over shm, and moving to the new connection.
#include <trellis/core/check.h>
#include <trellis/core/logging.h>
#include <trellis/transport/listener_impl.h>
#include <trellis/transport/pipe_impl.h>

namespace trellis::transport {

namespace wf = wire_format;

// ---- listener side ---------------------------------------------------------

// Reads the one bind message of a connection to a listener's upgrade address
// and hands the connection to the pipe whose token it names. Anything else
// (garbage, an unknown token, silence past the bound) closes that
// connection only.
class UpgradeBinder final : public std::enable_shared_from_this<UpgradeBinder>,
                            private ReadSink {
 public:
  UpgradeBinder(std::shared_ptr<ListenerImpl> listener,
                std::shared_ptr<Connection> conn)
      : listener_(std::move(listener)), conn_(std::move(conn)) {}

  void start() {
    std::weak_ptr<UpgradeBinder> weak = shared_from_this();
    timer_ = LoopTimer::start(listener_->ctx_->loop(), kBindTimeout, [weak] {
      if (auto self = weak.lock()) {
        self->timer_ = nullptr;
        self->finish(Error::timeout("no bind message within " +
                                    formatDuration(kBindTimeout)));
      }
    });
    buf_.resize(wire_format::kHandshakeHeaderBytes);
    conn_->startReading(this);
  }

  void close() { finish(Error::cancelled("listener closed")); }

 private:
  static constexpr Duration kBindTimeout = std::chrono::seconds(10);

  void readBuffer(char** base, size_t* length) override {
    *base = reinterpret_cast<char*>(buf_.data() + filled_);
    *length = buf_.size() - filled_;
  }
  void onRead(size_t n) override {
    auto self = shared_from_this();
    filled_ += n;
    if (filled_ < buf_.size()) {
      return;
    }
    if (!haveHeader_) {
      size_t len = 0;
      Error e = wire_format::decodeHandshakeHeader(
          buf_, wire_format::HandshakeType::kBind, &len);
      if (!e.ok()) {
        finish(e);
        return;
      }
      haveHeader_ = true;
      if (len > 0) {
        buf_.assign(len, 0);
        filled_ = 0;
        return;
      }
      buf_.clear();
    }
    wire_format::BindMessage bind;
    Error e = wire_format::decodeBind(buf_, &bind);
    if (!e.ok()) {
      finish(e);
      return;
    }
    conn_->stopReading();
    auto pipe = listener_->ctx_->takeUpgrade(bind.token);
    if (pipe == nullptr) {
      finish(Error::protocol("bind names no pipe waiting for an upgrade"));
      return;
    }
    auto conn = std::move(conn_);
    conn_ = nullptr;
    finish(Error());
    pipe->bindUpgrade(std::move(conn), bind);
  }
  void onReadError(const Error& error) override {
    auto self = shared_from_this();
    finish(error);
  }

  void finish(const Error& error) {
    if (done_) {
      return;
    }
    done_ = true;
    if (timer_ != nullptr) {
      timer_->cancel();
      timer_ = nullptr;
    }
    if (conn_ != nullptr) {
      conn_->close();
      conn_ = nullptr;
    }
    if (!error.ok() && error.code() != Code::kCancelled) {
      TRELLIS_LOG_WARN("{}: upgrade connection refused: {}", listener_->id_,
                       error.what());
    }
    listener_->binders_.erase(shared_from_this());
  }

  std::shared_ptr<ListenerImpl> listener_;
  std::shared_ptr<Connection> conn_;
  LoopTimer* timer_ = nullptr;
  std::vector<uint8_t> buf_;
  size_t filled_ = 0;
  bool haveHeader_ = false;
  bool done_ = false;
};

void ListenerImpl::listenForUpgrades() {
  // Only for listeners reachable over something other than shm, and only if
  // this context may and can use shm; a failure only costs the upgrade.
  auto shm = ctx_->transport("shm");
  if (shm == nullptr || addresses_.count("shm") != 0) {
    return;
  }
  std::weak_ptr<ListenerImpl> weak = shared_from_this();
  std::unique_ptr<ConnectionListener> cl;
  Error e = shm->listen(
      ctx_->loop(), "shm://",
      [weak](const Error& err, std::shared_ptr<Connection> conn) {
        if (auto self = weak.lock()) {
          self->onUpgradeConnection(err, std::move(conn));
        } else if (conn) {
          conn->close();
        }
      },
      &cl);
  if (!e.ok()) {
    TRELLIS_LOG_INFO("{}: no same-host upgrade address: {}", id_, e.what());
    return;
  }
  upgradeAddress_ = cl->address();
  upgradeListener_ = std::move(cl);
}

void ListenerImpl::onUpgradeConnection(const Error& error,
                                       std::shared_ptr<Connection> conn) {
  constexpr size_t kMaxBinders = 64;
  if (!error.ok()) {
    TRELLIS_LOG_WARN("{}: upgrade listener: {}", id_, error.what());
    return;
  }
  if (life_.failed() || binders_.size() >= kMaxBinders) {
    conn->close();
    return;
  }
  auto b = std::make_shared<UpgradeBinder>(shared_from_this(), std::move(conn));
  binders_.insert(b);
  b->start();
}

void ListenerImpl::closeUpgradesFromLoop() {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  if (upgradeListener_ != nullptr) {
    upgradeListener_->close();
    upgradeListener_.reset();
  }
  auto binders = binders_;
  for (auto& b : binders) {
    b->close();
  }
}

// ---- pipe side -------------------------------------------------------------

// Acceptor: the accept offered the upgrade; wait (bounded) for the bind on
// the upgrade listener or the connector's "upgrade failed".
void PipeImpl::offerUpgrade() {
  // Within the handshake bound, so that a late bind ends in "stay", not in
  // a handshake timeout.
  Duration bindWait = std::chrono::seconds(10);
  const Duration handshake = ctx_->options().handshakeTimeout;
  if (handshake > Duration::zero()) {
    bindWait = std::min(bindWait, handshake / 2);
  }
  ctx_->registerUpgrade(*handshake_->upgradeToken(), shared_from_this());
  std::weak_ptr<PipeImpl> weak = shared_from_this();
  upgradeTimer_ = LoopTimer::start(ctx_->loop(), bindWait, [weak, bindWait] {
    auto p = weak.lock();
    if (p == nullptr) {
      return;
    }
    p->upgradeTimer_ = nullptr;
    if (!p->life_.failed() &&
        p->handshake_->state() == Handshake::State::kAwaitBind) {
      p->handshake_->stay("no bound shm connection within " +
                          formatDuration(bindWait));
      p->handshakeMoved(Handshake::State::kAwaitBind);
      p->process();
    }
  });
}

// Acceptor: the handshake ended on the first connection after offering the
// upgrade.
void PipeImpl::stayedOnBootstrap() {
  if (upgradeTimer_ != nullptr) {
    upgradeTimer_->cancel();
    upgradeTimer_ = nullptr;
  }
  ctx_->dropUpgrade(*handshake_->upgradeToken());
  TRELLIS_LOG_INFO("{}: same-host upgrade to shm not done ({}); staying on {}",
                   id_, handshake_->stayReason(), bootstrap_);
}

void PipeImpl::bindUpgrade(std::shared_ptr<Connection> conn,
                           const wf::BindMessage& bind) {
  auto self = shared_from_this();
  if (life_.failed() || state_ != State::kHandshake ||
      handshake_->state() != Handshake::State::kAwaitBind) {
    conn->close();
    return;
  }
  if (!handshake_->bind(bind, conn->peerAddress(), buffered() != 0)) {
    conn->close();
    handshakeMoved(Handshake::State::kAwaitBind);
    process();
    return;
  }
  if (upgradeTimer_ != nullptr) {
    upgradeTimer_->cancel();
    upgradeTimer_ = nullptr;
  }
  // The decision goes over the old connection, which closes once it is
  // written; nothing else is read from it.
  auto old = conn_;
  old->stopReading();
  reading_ = false;
  for (auto& decision : handshake_->takeOutgoing()) {
    auto bytes = std::make_shared<std::vector<uint8_t>>(std::move(decision));
    const IoBuf b{bytes->data(), bytes->size()};
    old->write(&b, 1, [old, bytes](const Error&) { old->close(); });
  }
  moveTo(std::move(conn));
  established();
  process();
}

// Connector: the accept offered an upgrade. Whatever happens here, the
// acceptor decides (over the first connection) and the pipe follows.
void PipeImpl::tryUpgrade() {
  const std::string& target = handshake_->upgradeTarget();
  auto shm = ctx_->transport("shm");
  if (target.empty() || shm == nullptr) {
    TRELLIS_LOG_INFO("{}: same-host upgrade to shm failed ({}); staying on {}",
                     id_, handshake_->upgradeRefusal(), bootstrap_);
    return;
  }
  std::weak_ptr<PipeImpl> weak = shared_from_this();
  shm->connect(
      ctx_->loop(), target,
      [weak](const Error& e, const std::shared_ptr<Connection>& conn) {
        auto self = weak.lock();
        if (self == nullptr || self->life_.failed() ||
            self->state_ != State::kHandshake ||
            self->handshake_->state() != Handshake::State::kAwaitDecision) {
          if (conn) {
            conn->close();
          }
          return;
        }
        if (!e.ok()) {
          self->upgradeFailed("connect: " + e.message());
          return;
        }
        auto bytes = std::make_shared<std::vector<uint8_t>>(
            self->handshake_->upgradeConnected());
        const IoBuf b{bytes->data(), bytes->size()};
        self->upgradeConn_ = conn;
        conn->write(&b, 1, [bytes](const Error&) {});
      });
}

void PipeImpl::upgradeFailed(const std::string& why) {
  TRELLIS_LOG_INFO("{}: same-host upgrade to shm failed ({}); staying on {}",
                   id_, why, bootstrap_);
  handshake_->upgradeFailed(why);
  handshakeMoved(handshake_->state());
}

// Connector: the acceptor's decision arrived; the handshake has checked it.
void PipeImpl::followDecision() {
  if (!handshake_->switched()) {
    if (upgradeConn_ != nullptr) {
      upgradeConn_->close();
      upgradeConn_ = nullptr;
    }
    TRELLIS_LOG_INFO("{} (peer {}): peer keeps the pipe on {}", id_,
                     peerAddress(), bootstrap_);
    return;
  }
  conn_->stopReading();
  conn_->close();
  reading_ = false;
  auto next = std::move(upgradeConn_);
  upgradeConn_ = nullptr;
  moveTo(std::move(next));
}

void PipeImpl::moveTo(std::shared_ptr<Connection> conn) {
  conn_ = std::move(conn);
  bootstrap_ = "shm";
  MutexLock lock(infoMu_);
  peer_ = conn_->peerAddress();
}

}  // namespace trellis::transport
