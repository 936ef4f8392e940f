#include <cstring>
#include <unistd.h>

#include <trellis/core/check.h>
#include <trellis/core/logging.h>
#include <trellis/transport/pipe_impl.h>

namespace trellis::transport {

namespace wf = wire_format;

// ---- public handle ---------------------------------------------------------

Pipe::Pipe(Passkey, std::shared_ptr<PipeImpl> impl) : impl_(std::move(impl)) {}
Pipe::~Pipe() {
  destructorNoThrow(impl_->id(), [this] { impl_->close(); });
}
void Pipe::write(Message message, WriteCallback cb) {
  impl_->write(std::move(message), std::move(cb));
}
void Pipe::readDescriptor(ReadDescriptorCallback cb) {
  impl_->readDescriptor(std::move(cb));
}
void Pipe::read(Allocation allocation, ReadCallback cb) {
  impl_->read(std::move(allocation), std::move(cb));
}
bool Pipe::tryWriteNow(const Message& message) {
  return impl_->tryWriteNow(message);
}

void Pipe::close() { impl_->close(); }
const std::string& Pipe::id() const { return impl_->id(); }
std::string Pipe::peerAddress() const { return impl_->peerAddress(); }
std::string Pipe::transportName() const { return impl_->transportName(); }
std::string Pipe::channelName() const { return impl_->channelName(); }
std::string Pipe::channelName(DeviceType type) const {
  return impl_->channelName(type);
}

// ---- PipeImpl --------------------------------------------------------------

PipeImpl::PipeImpl(std::shared_ptr<ContextImpl> ctx, std::string id,
                   bool connector)
    : ctx_(std::move(ctx)),
      id_(std::move(id)),
      connector_(connector),
      life_(ctx_->loop()) {}

PipeImpl::~PipeImpl() = default;

std::string PipeImpl::peerAddress() const {
  MutexLock lock(infoMu_);
  return peer_;
}
std::string PipeImpl::transportName() const {
  MutexLock lock(infoMu_);
  return negotiated_.transport;
}
std::string PipeImpl::channelName() const {
  MutexLock lock(infoMu_);
  return negotiated_.channel;
}
std::string PipeImpl::channelName(DeviceType type) const {
  MutexLock lock(infoMu_);
  return type == DeviceType::kCuda ? negotiated_.cudaChannel
                                   : negotiated_.channel;
}

void PipeImpl::connectFromLoop(const std::string& address) {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  auto self = shared_from_this();
  ctx_->addPipeFromLoop(self);
  if (ctx_->closedFromLoop()) {
    failFromLoop(Error::cancelled(id_ + ": context is closed"));
    return;
  }
  {
    MutexLock lock(infoMu_);
    peer_ = address;
  }
  const size_t sep = address.find("://");
  const std::string name =
      sep == std::string::npos ? std::string() : address.substr(0, sep);
  auto transport = ctx_->transport(name);
  if (transport == nullptr) {
    failFromLoop(Error::invalidArgument(
        id_ + ": address '" + address +
        "' names no transport enabled in this context (expected e.g. "
        "uv://127.0.0.1:port)"));
    return;
  }
  const Duration timeout = ctx_->options().handshakeTimeout;
  if (timeout > Duration::zero()) {
    std::weak_ptr<PipeImpl> weak = self;
    timer_ = LoopTimer::start(ctx_->loop(), timeout, [weak, timeout] {
      if (auto p = weak.lock()) {
        p->timer_ = nullptr;
        p->failFromLoop(Error::timeout(
            p->id_ + ": connect and handshake did not complete within " +
            formatDuration(timeout)));
      }
    });
  }
  transport->connect(
      ctx_->loop(), address,
      [self, name](const Error& error, std::shared_ptr<Connection> conn) {
        if (self->life_.failed()) {
          if (conn) {
            conn->close();
          }
          return;
        }
        if (!error.ok()) {
          self->failFromLoop(error.withContext(self->id_));
          return;
        }
        self->attach(std::move(conn), name);
        self->startHandshake();
        self->process();
      });
}

void PipeImpl::acceptFromLoop(std::shared_ptr<Connection> conn,
                              const std::string& transport) {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  auto self = shared_from_this();
  ctx_->addPipeFromLoop(self);
  const Duration timeout = ctx_->options().handshakeTimeout;
  if (timeout > Duration::zero()) {
    std::weak_ptr<PipeImpl> weak = self;
    timer_ = LoopTimer::start(ctx_->loop(), timeout, [weak, timeout] {
      if (auto p = weak.lock()) {
        p->timer_ = nullptr;
        p->failFromLoop(Error::timeout(
            p->id_ + ": handshake with " + p->peerAddress() +
            " did not complete within " + formatDuration(timeout)));
      }
    });
  }
  attach(std::move(conn), transport);
  startHandshake();
  process();
}

void PipeImpl::attach(std::shared_ptr<Connection> conn,
                      const std::string& transport) {
  conn_ = std::move(conn);
  bootstrap_ = transport;
  {
    MutexLock lock(infoMu_);
    peer_ = conn_->peerAddress();
  }
  stage_.resize(kHandshakeStageBytes);
  updateReading();
}

void PipeImpl::updateReading() {
  if (conn_ == nullptr || life_.failed() || readEnd_) {
    return;
  }
  const bool full =
      (stageBegin_ == 0 && stageEnd_ == stage_.size()) || stageWant() == 0;
  if (!full && !reading_) {
    reading_ = true;
    conn_->startReading(this);
  } else if (full && reading_) {
    reading_ = false;
    conn_->stopReading();
  }
}

void PipeImpl::process() {
  if (processing_) {
    again_ = true;
    return;
  }
  auto self = shared_from_this();
  processing_ = true;
  do {
    again_ = false;
    while (!life_.failed() && step()) {
    }
  } while (again_ && !life_.failed());
  processing_ = false;
  checkEndOfStream();
  updateReading();
}

bool PipeImpl::step() {
  switch (state_) {
    case State::kConnecting:
      return false;
    case State::kHandshake:
      return stepHandshake();
    case State::kEstablished:
      return stepFrame();
  }
  return false;
}

void PipeImpl::startHandshake() {
  HandshakeOptions o;
  o.connector = connector_;
  o.local = ctx_->localHello();
  o.token = ctx_->token();
  o.transports = ctx_->transportOffers();
  o.channels = ctx_->channelOffers();
  o.bootstrap = bootstrap_;
  o.upgradeAddress = upgradeAddress_;
  o.id = id_;
  o.peer = peerAddress();
  handshake_ = std::make_unique<Handshake>(std::move(o));
  state_ = State::kHandshake;
  handshakeMoved(handshake_->state());
}

bool PipeImpl::stepHandshake() {
  const auto before = handshake_->state();
  const size_t used =
      handshake_->feed(std::span<const uint8_t>(stageData(), buffered()));
  consume(used);
  handshakeMoved(before);
  if (life_.failed() || state_ != State::kHandshake) {
    return !life_.failed();
  }
  if (used == 0) {
    needBytes(handshake_->wanted());
    return false;
  }
  return true;
}

void PipeImpl::handshakeMoved(Handshake::State before) {
  for (auto& bytes : handshake_->takeOutgoing()) {
    sendRaw(std::move(bytes));
  }
  const auto now = handshake_->state();
  if (now == Handshake::State::kFailed) {
    failFromLoop(handshake_->error());
    return;
  }
  if (now == before) {
    return;
  }
  switch (now) {
    case Handshake::State::kAwaitBind:
      offerUpgrade();
      break;
    case Handshake::State::kAwaitDecision:
      tryUpgrade();
      break;
    case Handshake::State::kEstablished:
      if (before == Handshake::State::kAwaitBind) {
        stayedOnBootstrap();
      } else if (before == Handshake::State::kAwaitDecision) {
        followDecision();
      }
      established();
      break;
    default:
      break;
  }
}

void PipeImpl::established() {
  const Negotiated& n = handshake_->negotiated();
  state_ = State::kEstablished;
  // Keeps what is buffered; process(), which runs after this, starts
  // reading again if the small stage had filled.
  if (stage_.size() < kStageBytes) {
    stage_.resize(kStageBytes);
  }
  if (timer_ != nullptr) {
    timer_->cancel();
    timer_ = nullptr;
  }
  {
    MutexLock lock(infoMu_);
    negotiated_ = n;
  }
  peerPid_ = handshake_->remote().pid;
  channel_ = ctx_->channel(n.channel);
  cudaChannel_ = n.cudaChannel.empty() ? nullptr : ctx_->channel(n.cudaChannel);
  TRELLIS_LOG_DEBUG("{}: established with {} over {}+{} (cuda: {})", id_,
                    peerAddress(), n.transport, n.channel,
                    n.cudaChannel.empty() ? "none" : n.cudaChannel);
  rx_ = Rx::kHeader;
  auto queued = std::move(queuedWrites_);
  queuedWrites_.clear();
  for (auto& op : queued) {
    if (life_.failed()) {
      break;
    }
    submitWrite(op);
  }
  openWriteNow();
}

void PipeImpl::sendRaw(std::vector<uint8_t> bytes) {
  auto buf = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  const IoBuf b{buf->data(), buf->size()};
  std::weak_ptr<PipeImpl> weak = shared_from_this();
  conn_->write(&b, 1, [weak, buf](const Error& e) {
    auto self = weak.lock();
    if (self && !e.ok()) {
      self->failFromLoop(e.withContext(self->id_ + ": handshake write"));
    }
  });
}

void PipeImpl::failFromLoop(const Error& error) {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  auto self = shared_from_this();
  life_.fail(error, [&] { teardownFromLoop(error); });
}

void PipeImpl::teardownFromLoop(const Error& error) {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  closeWriteNow();
  if (error.code() == Code::kCancelled) {
    TRELLIS_LOG_DEBUG("{}", error.what());
  } else {
    TRELLIS_LOG_INFO("{}", error.what());
  }
  if (timer_ != nullptr) {
    timer_->cancel();
    timer_ = nullptr;
  }
  if (upgradeTimer_ != nullptr) {
    upgradeTimer_->cancel();
    upgradeTimer_ = nullptr;
  }
  if (peerEndTimer_ != nullptr) {
    // A read held for the peer's end (holdForPeerEnd): no copy runs, so
    // it fails below with the rest.
    peerEndTimer_->cancel();
    peerEndTimer_ = nullptr;
    heldError_ = Error();
  }
  if (handshake_ && handshake_->upgradeToken() && !connector_) {
    ctx_->dropUpgrade(*handshake_->upgradeToken());
  }
  if (upgradeConn_ != nullptr) {
    upgradeConn_->close();
    upgradeConn_ = nullptr;
  }
  if (conn_ != nullptr) {
    // A channel copying out of the peer's memory (cma) reads a buffer the
    // peer lends only until it learns that this pipe ended, which it
    // learns from this connection: it is closed once those copies are
    // done (onOutOfBandDone), never under them.
    if (outOfBandPending_ == 0) {
      conn_->close();
    }
    reading_ = false;
  }
  std::vector<Pipe::WriteCallback> writes;
  for (auto* q : {&queuedWrites_, &inflightWrites_}) {
    for (auto& op : *q) {
      if (!op->done) {
        op->done = true;
        writes.push_back(std::move(op->cb));
        op->message = Message();
      }
    }
    q->clear();
  }
  awaitingPeer_.clear();
  Pipe::ReadCallback readCb;
  if (outOfBandPending_ == 0) {
    // Else a channel is still copying into the read's buffers: its
    // callback waits (onOutOfBandDone) so the caller frees nothing early.
    readCb = std::move(readCb_);
    readCb_ = nullptr;
    outOfBand_.clear();
  }
  pendingOps_ = 0;
  segments_.clear();
  descriptor_.clear();
  descriptor_.shrink_to_fit();
  std::vector<uint8_t>().swap(stage_);
  stageBegin_ = stageEnd_ = 0;
  auto& loop = ctx_->loop();
  if (conn_ != nullptr && outOfBandPending_ > 0) {
    // The connection stays open for this pipe's own copies and may still
    // write these messages' bytes (or lend their tensors to the peer):
    // their callbacks wait until it has closed (onOutOfBandDone).
    for (auto& cb : writes) {
      heldWriteCbs_.push_back(std::move(cb));
    }
    writes.clear();
  }
  for (auto& cb : writes) {
    loop.deliver([cb = std::move(cb), error] { cb(error); });
  }
  descriptorCbs_.failAll(loop, error);
  if (readCb) {
    loop.deliver([cb = std::move(readCb), error] { cb(error); });
  }
  ctx_->removePipeFromLoop(this);
}

void PipeImpl::close() {
  {
    // At once: no tryWriteNow() gets through once close() has returned.
    MutexLock lock(nowMu_);
    closing_ = true;
    nowConn_ = nullptr;
  }
  auto self = shared_from_this();
  ctx_->loop().run([self] {
    self->failFromLoop(Error::cancelled(self->id_ + ": pipe closed"));
  });
}

}  // namespace trellis::transport
