#include <cstring>
#include <unistd.h>

#include <trellis/core/check.h>
#include <trellis/core/logging.h>
#include <trellis/transport/context_impl.h>
#include <trellis/transport/pipe.h>

namespace trellis::transport {

namespace wf = wire_format;

namespace {

// Bytes read ahead of the consumer; also bounds per-pipe memory at rest.
constexpr size_t kStageBytes = 32 << 10;
// The stage of a pipe still in its handshake: enough for the header and a
// typical hello (needBytes grows it for a larger message, within the
// limits). A peer that connects and never proves the token costs this, not
// kStageBytes: 1000 such connections held 32 MiB, which glibc kept after
// they closed (a hostile-client probe grew a job's RSS by 39 MB).
constexpr size_t kHandshakeStageBytes = 512;
// A segment at least this long is read straight into its destination.
constexpr size_t kDirectThreshold = 16 << 10;

}  // namespace

// ---- public handle ---------------------------------------------------------

Pipe::Pipe(std::shared_ptr<PipeImpl> impl) : impl_(std::move(impl)) {}
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
  std::lock_guard<std::mutex> lock(infoMu_);
  return peer_;
}
std::string PipeImpl::transportName() const {
  std::lock_guard<std::mutex> lock(infoMu_);
  return negotiated_.transport;
}
std::string PipeImpl::channelName() const {
  std::lock_guard<std::mutex> lock(infoMu_);
  return negotiated_.channel;
}
std::string PipeImpl::channelName(DeviceType type) const {
  std::lock_guard<std::mutex> lock(infoMu_);
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
    std::lock_guard<std::mutex> lock(infoMu_);
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
    std::lock_guard<std::mutex> lock(infoMu_);
    peer_ = conn_->peerAddress();
  }
  stage_.resize(kHandshakeStageBytes);
  updateReading();
}

void PipeImpl::updateReading() {
  if (conn_ == nullptr || life_.failed() || readEnd_) {
    return;
  }
  const bool full = stageBegin_ == 0 && stageEnd_ == stage_.size();
  if (!full && !reading_) {
    reading_ = true;
    conn_->startReading(this);
  } else if (full && reading_) {
    reading_ = false;
    conn_->stopReading();
  }
}

void PipeImpl::readBuffer(char** base, size_t* length) {
  if (state_ == State::kEstablished && buffered() == 0) {
    uint8_t* dst = nullptr;
    size_t rem = 0;
    if (rx_ == Rx::kDescriptor) {
      dst = reinterpret_cast<uint8_t*>(descriptor_.data()) + descriptorFilled_;
      rem = descriptor_.size() - descriptorFilled_;
    } else if (rx_ == Rx::kBody && segIndex_ < segments_.size()) {
      dst = segments_[segIndex_].data + segOffset_;
      rem = segments_[segIndex_].length - segOffset_;
    }
    if (rem >= kDirectThreshold) {
      direct_ = true;
      *base = reinterpret_cast<char*>(dst);
      *length = rem;
      return;
    }
  }
  direct_ = false;
  if (buffered() == 0) {
    stageBegin_ = stageEnd_ = 0;
  } else if (stageEnd_ == stage_.size() && stageBegin_ > 0) {
    std::memmove(stage_.data(), stage_.data() + stageBegin_, buffered());
    stageEnd_ -= stageBegin_;
    stageBegin_ = 0;
  }
  *base = reinterpret_cast<char*>(stage_.data() + stageEnd_);
  *length = stage_.size() - stageEnd_;
}

void PipeImpl::onRead(size_t n) {
  auto self = shared_from_this();
  if (direct_) {
    direct_ = false;
    if (rx_ == Rx::kDescriptor) {
      descriptorFilled_ += n;
    } else {
      segOffset_ += n;
    }
  } else {
    stageEnd_ += n;
  }
  process();
}

void PipeImpl::onReadError(const Error& error) {
  auto self = shared_from_this();
  reading_ = false;
  if (state_ == State::kEstablished && error.code() == Code::kUnavailable) {
    // The end of the stream: every byte the peer sent is in the stage or
    // already in the reader's buffers, and stays readable (a peer that
    // writes and then closes must be heard out); process() fails the pipe
    // once nothing more can be served from it.
    peerClosedFromLoop(
        error.withContext(id_ + ": connection to " + peerAddress() + " lost"));
    process();
    return;
  }
  std::string where;
  if (state_ != State::kEstablished) {
    where = " during the handshake";
  } else if (rx_ != Rx::kHeader || buffered() > 0) {
    where = " in the middle of a message";
  }
  failFromLoop(error.withContext(id_ + ": connection to " + peerAddress() +
                                 " lost" + where));
}

bool PipeImpl::needBytes(size_t n) {
  if (buffered() >= n) {
    return true;
  }
  if (n > stage_.size()) {
    // Only for a layout, whose length was checked against the limits.
    std::vector<uint8_t> bigger(n);
    std::memcpy(bigger.data(), stageData(), buffered());
    stageEnd_ = buffered();
    stageBegin_ = 0;
    stage_.swap(bigger);
  } else if (stageBegin_ + n > stage_.size()) {
    std::memmove(stage_.data(), stageData(), buffered());
    stageEnd_ = buffered();
    stageBegin_ = 0;
  }
  return false;
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

void PipeImpl::checkEndOfStream() {
  if (!readEnd_ || state_ != State::kEstablished) {
    return;
  }
  // Waiting for the user (a descriptor not yet asked for, a read not yet
  // posted) or for a channel's copy: what is here can still be served.
  if (rx_ == Rx::kDescriptorReady || rx_ == Rx::kAwaitRead ||
      rx_ == Rx::kOutOfBand) {
    return;
  }
  if (rx_ != Rx::kHeader || buffered() > 0) {
    failFromLoop(
        Error(readEndError_.code(),
              readEndError_.message() + " in the middle of a message"));
    return;
  }
  failFromLoop(readEndError_);
}

void PipeImpl::peerClosedFromLoop(const Error& error) {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  if (readEnd_) {
    return;
  }
  readEnd_ = true;
  readEndError_ = error;
  conn_->close();
  reading_ = false;
  stopWritesFromLoop(error);
  // close() fails the writes the connection still held.
  std::vector<std::shared_ptr<WriteOp>> ops(inflightWrites_.begin(),
                                            inflightWrites_.end());
  for (auto& op : ops) {
    finishWrite(op, error);
  }
  awaitingPeer_.clear();
}

void PipeImpl::stopWritesFromLoop(const Error& error) {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  if (writeError_.ok()) {
    writeError_ = error;
  }
  // Writes the connection is done with but whose completion frame will not
  // come, and writes not yet handed to it.
  std::vector<std::shared_ptr<WriteOp>> ops(awaitingPeer_.begin(),
                                            awaitingPeer_.end());
  awaitingPeer_.clear();
  for (auto& op : ops) {
    if (op->wireDone) {
      finishWrite(op, error);
    }
  }
  auto queued = std::move(queuedWrites_);
  queuedWrites_.clear();
  for (auto& op : queued) {
    inflightWrites_.push_back(op);
    finishWrite(op, error);
  }
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
  std::lock_guard<std::mutex> lock(infoMu_);
  peer_ = conn_->peerAddress();
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
    std::lock_guard<std::mutex> lock(infoMu_);
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

bool PipeImpl::stepFrame() {
  switch (rx_) {
    case Rx::kHeader: {
      if (!needBytes(wf::kFrameHeaderBytes)) {
        return false;
      }
      Error e = wf::decodeFrameHeader(
          std::span<const uint8_t>(stageData(), wf::kFrameHeaderBytes),
          ctx_->limits(), &layoutLength_);
      if (!e.ok()) {
        failFromLoop(e.withContext(id_ + " (peer " + peerAddress() + ")"));
        return false;
      }
      consume(wf::kFrameHeaderBytes);
      rx_ = Rx::kLayout;
      return true;
    }
    case Rx::kLayout: {
      if (!needBytes(layoutLength_)) {
        return false;
      }
      Error e =
          wf::decodeLayout(std::span<const uint8_t>(stageData(), layoutLength_),
                           ctx_->limits(), &layout_);
      if (e.ok() && layout_.type == wf::kFrameCompletion) {
        consume(layoutLength_);
        rx_ = Rx::kHeader;
        onCompletion(layout_);
        return !life_.failed();
      }
      for (size_t i = 0; e.ok() && i < layout_.outOfBand.size(); ++i) {
        if (!layout_.outOfBand[i].present) {
          continue;
        }
        const Device& d = layout_.tensors[i].device;
        Channel* ch = channelFor(d);
        if (ch == nullptr || !ch->drivesOutOfBand()) {
          e = Error::protocol(
              "tensor " + std::to_string(i) + ": out-of-band record for a " +
              d.toString() + " tensor, but " +
              (ch == nullptr ? std::string("no channel for that device type")
                             : "channel " + ch->name()) +
              " was negotiated, which carries none");
        }
      }
      for (size_t i = 0; e.ok() && i < layout_.tensors.size(); ++i) {
        const bool oob =
            i < layout_.outOfBand.size() && layout_.outOfBand[i].present;
        const Device& d = layout_.tensors[i].device;
        if (!oob && d.type != DeviceType::kCpu) {
          // Only empty ones (the decoder refuses the rest): still, the
          // device must be one this pipe carries.
          if (cudaChannel_ == nullptr) {
            e = Error::protocol("tensor " + std::to_string(i) + " on " +
                                d.toString() +
                                ", but no channel for CUDA tensors was "
                                "negotiated");
          }
        }
      }
      if (!e.ok()) {
        failFromLoop(e.withContext(id_ + " (peer " + peerAddress() + ")"));
        return false;
      }
      consume(layoutLength_);
      // Sized only now that the length passed the limits.
      descriptor_.assign(layout_.descriptorLength, '\0');
      descriptorFilled_ = 0;
      rx_ = Rx::kDescriptor;
      return true;
    }
    case Rx::kDescriptor: {
      const size_t want = descriptor_.size() - descriptorFilled_;
      const size_t n = std::min(want, buffered());
      if (n > 0) {
        std::memcpy(descriptor_.data() + descriptorFilled_, stageData(), n);
        consume(n);
        descriptorFilled_ += n;
      }
      if (descriptorFilled_ == descriptor_.size()) {
        rx_ = Rx::kDescriptorReady;
        return true;
      }
      return false;
    }
    case Rx::kDescriptorReady: {
      if (descriptorCbs_.empty()) {
        return false;
      }
      serveDescriptor();
      return true;
    }
    case Rx::kAwaitRead:
    case Rx::kOutOfBand:
      return false;
    case Rx::kBody: {
      bool progress = false;
      while (segIndex_ < segments_.size()) {
        auto& seg = segments_[segIndex_];
        if (segOffset_ == seg.length) {
          ++segIndex_;
          segOffset_ = 0;
          continue;
        }
        const size_t n = std::min(seg.length - segOffset_, buffered());
        if (n == 0) {
          break;
        }
        std::memcpy(seg.data + segOffset_, stageData(), n);
        consume(n);
        segOffset_ += n;
        progress = true;
      }
      if (segIndex_ == segments_.size()) {
        finishBody();
        return true;
      }
      return progress;
    }
  }
  return false;
}

void PipeImpl::serveDescriptor() {
  auto cb = descriptorCbs_.pop();
  --pendingOps_;
  Descriptor d;
  d.descriptor = std::move(descriptor_);
  descriptor_.clear();
  d.payloadLengths = layout_.payloadLengths;
  d.tensors = layout_.tensors;
  rx_ = Rx::kAwaitRead;
  ctx_->loop().deliver([cb = std::move(cb), d = std::move(d)]() mutable {
    cb(Error(), std::move(d));
  });
}

void PipeImpl::finishBody() {
  segments_.clear();
  segIndex_ = segOffset_ = 0;
  if (outOfBand_.empty()) {
    finishRead(Error());
    return;
  }
  rx_ = Rx::kOutOfBand;
  startOutOfBand();
}

Channel* PipeImpl::channelFor(const Device& device) const {
  return device.type == DeviceType::kCuda ? cudaChannel_.get() : channel_.get();
}

void PipeImpl::startOutOfBand() {
  const std::string who = "peer " + peerAddress();
  // Records are checked before any copy starts: a lying one fails this read
  // only, and the stream stays in step.
  for (const auto& r : outOfBand_) {
    Error e = channelFor(r.device)->checkOutOfBandRecord(r.record, peerPid_);
    if (!e.ok()) {
      outOfBandError_ =
          e.withContext(id_ + ": read: tensor " + std::to_string(r.tensor) +
                        " (" + who + ")");
      outOfBandPending_ = 1;
      onOutOfBandDone(r.tensor, Error());
      return;
    }
  }
  outOfBandPending_ = outOfBand_.size();
  auto loop = ctx_->sharedLoop();
  for (const auto& r : outOfBand_) {
    // The callback may come on any thread, even inline: it only hops back.
    // It owns the pipe until then, so the read's callback (which must wait
    // for the copy, since the copy writes into the caller's buffer) always
    // fires; the reference moves into the task so that it is dropped on
    // the loop, never on a channel's thread.
    auto self = shared_from_this();
    const size_t tensor = r.tensor;
    channelFor(r.device)->readOutOfBand(
        r.record, r.dst, r.device, who,
        [loop, self = std::move(self), tensor](const Error& e) mutable {
          loop->defer([self = std::move(self), tensor, e] {
            self->onOutOfBandDone(tensor, e);
          });
        });
  }
}

void PipeImpl::onOutOfBandDone(size_t tensor, const Error& error) {
  if (!error.ok() && outOfBandError_.ok()) {
    outOfBandError_ =
        error.withContext(id_ + ": read: tensor " + std::to_string(tensor));
  }
  if (outOfBandPending_ == 0 || --outOfBandPending_ > 0) {
    return;
  }
  const Error e = outOfBandError_;
  outOfBandError_ = Error();
  outOfBand_.clear();
  if (life_.failed()) {
    // failFromLoop kept the read's callback for this moment.
    auto cb = std::move(readCb_);
    readCb_ = nullptr;
    if (cb) {
      ctx_->loop().deliver(
          [cb = std::move(cb), err = life_.error()] { cb(err); });
    }
    return;
  }
  // The writer's callback waits for this, whatever the outcome; the stream
  // stays in step either way, so only this read fails.
  sendCompletion(e);
  finishRead(e);
  process();
}

void PipeImpl::sendCompletion(const Error& error) {
  if (!writeError_.ok() || readEnd_) {
    return;  // the peer is gone and waits for nothing
  }
  auto frame = std::make_shared<std::vector<uint8_t>>(
      wf::encodeCompletion(error.code(), error.message()));
  const IoBuf b{frame->data(), frame->size()};
  std::weak_ptr<PipeImpl> weak = shared_from_this();
  conn_->write(&b, 1, [weak, frame](const Error& e) {
    auto self = weak.lock();
    if (self == nullptr || e.ok()) {
      return;
    }
    const Error err = e.withContext(self->id_ + ": completion write");
    if (self->state_ == State::kEstablished && e.code() == Code::kUnavailable) {
      self->stopWritesFromLoop(err);
    } else {
      self->failFromLoop(err);
    }
  });
}

void PipeImpl::finishRead(const Error& error) {
  rx_ = Rx::kHeader;
  auto cb = std::move(readCb_);
  readCb_ = nullptr;
  --pendingOps_;
  ctx_->loop().deliver([cb = std::move(cb), error] { cb(error); });
}

void PipeImpl::onCompletion(const wf::FrameLayout& completion) {
  if (awaitingPeer_.empty()) {
    failFromLoop(Error::protocol(id_ + " (peer " + peerAddress() +
                                 "): completion frame with no out-of-band "
                                 "write waiting for one"));
    return;
  }
  auto op = std::move(awaitingPeer_.front());
  awaitingPeer_.pop_front();
  op->peerDone = true;
  if (completion.completionCode != Code::kOk) {
    op->peerError = Error(completion.completionCode,
                          id_ + ": write: peer " + peerAddress() +
                              " failed to read the out-of-band tensors: " +
                              completion.completionReason);
  }
  if (op->wireDone) {
    finishWrite(op, op->peerError);
  }
}

Error PipeImpl::describeTensors(const Message& m,
                                std::vector<wf::OutOfBand>* records) const {
  size_t total = 0;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const auto& t = m.tensors[i];
    Channel* ch = channelFor(t.device);
    const std::string what =
        "tensor " + std::to_string(i) + " on " + t.device.toString();
    if (ch == nullptr) {
      return Error::invalidArgument(
          what + ": no channel for " + t.device.toString() +
          " tensors was negotiated with this peer (cpu channel: " +
          channel_->name() + ")");
    }
    wf::OutOfBand o;
    if (ch->drivesOutOfBand() && ch->sendsOutOfBand(t)) {
      Error e = ch->describeOutOfBand(t, &o.record);
      if (!e.ok()) {
        return e.withContext(what);
      }
      if (o.record.size() > wf::kMaxOutOfBandRecordBytes) {
        return Error::invalidArgument(
            what + ": channel " + ch->name() + " described it in " +
            std::to_string(o.record.size()) + " bytes, over the limit of " +
            std::to_string(wf::kMaxOutOfBandRecordBytes));
      }
      total += o.record.size();
      o.present = true;
    } else if (t.device.type != DeviceType::kCpu && t.length > 0) {
      return Error::invalidArgument(what + ": channel " + ch->name() +
                                    " does not carry it");
    }
    records->push_back(std::move(o));
  }
  if (total > wf::kMaxOutOfBandBytesPerFrame) {
    return Error::invalidArgument(
        "out-of-band records of one message add up to " +
        std::to_string(total) + " bytes, over the limit of " +
        std::to_string(wf::kMaxOutOfBandBytesPerFrame));
  }
  return Error();
}

void PipeImpl::submitWrite(const std::shared_ptr<WriteOp>& op) {
  const Message& m = op->message;
  op->head.clear();
  std::vector<wf::OutOfBand> outOfBand;
  outOfBand.reserve(m.tensors.size());
  Error e = writeError_;
  if (e.ok()) {
    e = describeTensors(m, &outOfBand);
    if (!e.ok()) {
      e = e.withContext(id_ + ": write");
    }
  }
  if (!e.ok()) {
    // This write only.
    inflightWrites_.push_back(op);
    finishWrite(op, e);
    return;
  }
  for (const auto& o : outOfBand) {
    op->awaitsPeer = op->awaitsPeer || o.present;
  }
  if (op->awaitsPeer) {
    wf::encodeFrameHead(m, &op->head, &outOfBand);
    awaitingPeer_.push_back(op);
  } else {
    wf::encodeFrameHead(m, &op->head);
  }
  std::vector<IoBuf> iov;
  iov.reserve(2 + m.payloads.size() + m.tensors.size());
  iov.push_back(IoBuf{op->head.data(), op->head.size()});
  if (!m.descriptor.empty()) {
    iov.push_back(IoBuf{m.descriptor.data(), m.descriptor.size()});
  }
  for (const auto& p : m.payloads) {
    if (p.length > 0) {
      iov.push_back(IoBuf{p.data, p.length});
    }
  }
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const auto& t = m.tensors[i];
    if (t.length > 0 && !(op->awaitsPeer && outOfBand[i].present)) {
      iov.push_back(IoBuf{t.data, t.length});
    }
  }
  inflightWrites_.push_back(op);
  std::weak_ptr<PipeImpl> weak = shared_from_this();
  conn_->write(iov.data(), iov.size(), [weak, op](const Error& e) {
    if (auto self = weak.lock()) {
      self->completeWrite(op, e);
    }
  });
}

void PipeImpl::completeWrite(const std::shared_ptr<WriteOp>& op,
                             const Error& error) {
  if (op->done) {
    return;
  }
  if (!error.ok()) {
    const Error e = error.withContext(id_ + ": write to " + peerAddress());
    if (state_ == State::kEstablished && error.code() == Code::kUnavailable) {
      // The peer is gone, but what it wrote before may still be on its way
      // in: the read side goes on until the end of the stream.
      stopWritesFromLoop(e);
      finishWrite(op, e);
      return;
    }
    failFromLoop(e);
    return;
  }
  op->wireDone = true;
  if (!op->awaitsPeer || op->peerDone) {
    finishWrite(op, op->peerError);
  } else if (!writeError_.ok()) {
    finishWrite(op, writeError_);  // no completion frame will come
  }
}

void PipeImpl::finishWrite(const std::shared_ptr<WriteOp>& op,
                           const Error& error) {
  if (op->done) {
    return;
  }
  op->done = true;
  for (auto it = inflightWrites_.begin(); it != inflightWrites_.end(); ++it) {
    if (*it == op) {
      inflightWrites_.erase(it);
      break;
    }
  }
  --pendingOps_;
  auto cb = std::move(op->cb);
  op->message = Message();
  ctx_->loop().deliver([cb = std::move(cb), error] { cb(error); });
}

void PipeImpl::failFromLoop(const Error& error) {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  auto self = shared_from_this();
  life_.fail(error, [&] { teardownFromLoop(error); });
}

void PipeImpl::teardownFromLoop(const Error& error) {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
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
  if (handshake_ && handshake_->upgradeToken() && !connector_) {
    ctx_->dropUpgrade(*handshake_->upgradeToken());
  }
  if (upgradeConn_ != nullptr) {
    upgradeConn_->close();
    upgradeConn_ = nullptr;
  }
  if (conn_ != nullptr) {
    conn_->close();
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
  for (auto& cb : writes) {
    loop.deliver([cb = std::move(cb), error] { cb(error); });
  }
  descriptorCbs_.failAll(loop, error);
  if (readCb) {
    loop.deliver([cb = std::move(readCb), error] { cb(error); });
  }
  ctx_->removePipeFromLoop(this);
}

void PipeImpl::write(Message message, Pipe::WriteCallback cb) {
  TRELLIS_CHECK(cb != nullptr, "Pipe::write needs a callback");
  auto self = shared_from_this();
  ctx_->loop().run([self, message = std::move(message),
                    cb = std::move(cb)]() mutable {
    auto& loop = self->ctx_->loop();
    if (self->life_.refuse(cb)) {
      return;
    }
    if (!self->writeError_.ok()) {
      loop.deliver([cb = std::move(cb), e = self->writeError_] { cb(e); });
      return;
    }
    // Which tensors each channel carries is known once the handshake is
    // done (submitWrite checks again then).
    Error e = wf::checkOutgoing(message, self->ctx_->limits());
    if (e.ok() &&
        self->pendingOps_ >= self->ctx_->limits().maxPendingOperations) {
      e = Error(Code::kResourceExhausted,
                self->id_ + ": too many pending operations (limit " +
                    std::to_string(self->ctx_->limits().maxPendingOperations) +
                    ")");
    }
    if (!e.ok()) {
      loop.deliver([cb = std::move(cb),
                    e = e.withContext(self->id_ + ": write")] { cb(e); });
      return;
    }
    auto op = std::make_shared<WriteOp>();
    op->message = std::move(message);
    op->cb = std::move(cb);
    ++self->pendingOps_;
    if (self->state_ == State::kEstablished) {
      self->submitWrite(op);
    } else {
      self->queuedWrites_.push_back(std::move(op));
    }
  });
}

void PipeImpl::readDescriptor(Pipe::ReadDescriptorCallback cb) {
  TRELLIS_CHECK(cb != nullptr, "Pipe::readDescriptor needs a callback");
  auto self = shared_from_this();
  ctx_->loop().run([self, cb = std::move(cb)]() mutable {
    auto& loop = self->ctx_->loop();
    if (self->life_.refuse(cb, Descriptor())) {
      return;
    }
    if (self->pendingOps_ >= self->ctx_->limits().maxPendingOperations) {
      Error e(Code::kResourceExhausted,
              self->id_ + ": too many pending operations");
      loop.deliver([cb = std::move(cb), e] { cb(e, Descriptor()); });
      return;
    }
    ++self->pendingOps_;
    self->descriptorCbs_.push(std::move(cb));
    self->process();
  });
}

void PipeImpl::read(Allocation allocation, Pipe::ReadCallback cb) {
  TRELLIS_CHECK(cb != nullptr, "Pipe::read needs a callback");
  auto self = shared_from_this();
  ctx_->loop().run([self, allocation = std::move(allocation),
                    cb = std::move(cb)]() mutable {
    auto& loop = self->ctx_->loop();
    if (self->life_.refuse(cb)) {
      return;
    }
    auto reject = [&](const std::string& why) {
      loop.deliver([cb = std::move(cb),
                    e = Error::invalidArgument(self->id_ + ": read: " + why)] {
        cb(e);
      });
    };
    if (self->rx_ != Rx::kAwaitRead) {
      reject(self->rx_ == Rx::kBody
                 ? "a read is already in progress"
                 : "no descriptor is waiting: call readDescriptor() and wait "
                   "for its callback first");
      return;
    }
    const auto& lay = self->layout_;
    if (allocation.payloads.size() != lay.payloadLengths.size() ||
        allocation.tensors.size() != lay.tensors.size()) {
      reject("allocation has " + std::to_string(allocation.payloads.size()) +
             " payloads and " + std::to_string(allocation.tensors.size()) +
             " tensors; the descriptor announced " +
             std::to_string(lay.payloadLengths.size()) + " and " +
             std::to_string(lay.tensors.size()));
      return;
    }
    std::vector<Segment> segs;
    segs.reserve(allocation.payloads.size() + allocation.tensors.size());
    auto check = [&](const Allocation::Buffer& b, size_t want,
                     const std::string& what) -> bool {
      if (b.length != want) {
        reject(what + " buffer has " + std::to_string(b.length) +
               " bytes; the descriptor announced " + std::to_string(want));
        return false;
      }
      if (want > 0 && b.data == nullptr) {
        reject(what + " buffer is null");
        return false;
      }
      if (want > 0) {
        segs.push_back(Segment{static_cast<uint8_t*>(b.data), want});
      }
      return true;
    };
    for (size_t i = 0; i < allocation.payloads.size(); ++i) {
      if (!check(allocation.payloads[i], lay.payloadLengths[i],
                 "payload " + std::to_string(i))) {
        return;
      }
    }
    std::vector<OutOfBandRead> oob;
    for (size_t i = 0; i < allocation.tensors.size(); ++i) {
      const size_t before = segs.size();
      if (!check(allocation.tensors[i], lay.tensors[i].length,
                 "tensor " + std::to_string(i))) {
        return;
      }
      if (i < lay.outOfBand.size() && lay.outOfBand[i].present &&
          segs.size() > before) {
        // Its bytes are not in the stream: its channel copies them once the
        // inline bytes are in.
        segs.pop_back();
        oob.push_back(OutOfBandRead{i, allocation.tensors[i],
                                    lay.tensors[i].device,
                                    lay.outOfBand[i].record});
      }
    }
    self->segments_ = std::move(segs);
    self->outOfBand_ = std::move(oob);
    self->segIndex_ = 0;
    self->segOffset_ = 0;
    self->readCb_ = std::move(cb);
    ++self->pendingOps_;
    self->rx_ = Rx::kBody;
    self->process();
  });
}

void PipeImpl::close() {
  auto self = shared_from_this();
  ctx_->loop().run([self] {
    self->failFromLoop(Error::cancelled(self->id_ + ": pipe closed"));
  });
}

}  // namespace trellis::transport
