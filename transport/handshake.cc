#include <algorithm>
#include <utility>

#include <trellis/core/check.h>
#include <trellis/transport/handshake.h>

namespace trellis::transport {

namespace wf = wire_format;

namespace {

constexpr size_t kHeader = wf::kHandshakeHeaderBytes;
constexpr const char* kShm = "shm";

std::string joinNames(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) {
    out += (out.empty() ? "" : ", ") + s;
  }
  return out;
}

bool contains(const std::vector<std::string>& list, const std::string& name) {
  return std::find(list.begin(), list.end(), name) != list.end();
}

}  // namespace

Error negotiate(const std::vector<Offer>& localTransports,
                const std::vector<Offer>& localChannels,
                const wf::Hello& remote, bool sameHost,
                const std::string& bootstrap, Negotiated* out) {
  auto usable = [&](const Offer& o,
                    const std::vector<std::string>& remoteList) {
    return contains(remoteList, o.name) && (!o.sameHostOnly || sameHost);
  };
  const Offer* transport = nullptr;
  for (const auto& t : localTransports) {
    if (t.name == bootstrap && usable(t, remote.transports)) {
      transport = &t;
      break;
    }
  }
  if (transport == nullptr) {
    return Error(Code::kFailedPrecondition,
                 "transport '" + bootstrap +
                     "' is not enabled on both sides "
                     "(peer offers: " +
                     joinNames(remote.transports) + ")");
  }
  const Offer* cpu = nullptr;
  const Offer* cuda = nullptr;
  for (const auto& c : localChannels) {
    if (!usable(c, remote.channels)) {
      continue;
    }
    if (cpu == nullptr && c.inlineChannel && c.cpu) {
      cpu = &c;
    }
    if (cuda == nullptr && c.cuda && c.outOfBand) {
      cuda = &c;
    }
  }
  if (cpu != nullptr) {
    *out = Negotiated{transport->name, cpu->name,
                      cuda != nullptr ? cuda->name : std::string()};
    return Error();
  }
  std::vector<std::string> mine;
  for (const auto& c : localChannels) {
    mine.push_back(c.name);
  }
  return Error(Code::kFailedPrecondition,
               "no channel for CPU tensors usable by both sides (this side: " +
                   joinNames(mine) + "; peer: " + joinNames(remote.channels) +
                   (sameHost ? "; same host" : "; different hosts") + ")");
}

Handshake::Handshake(HandshakeOptions options) : o_(std::move(options)) {
  if (!o_.nonce) {
    o_.nonce = [] { return auth::randomNonce(); };
  }
  who_ = o_.id + " (peer " + o_.peer + ")";
  for (const auto& t : o_.transports) {
    shmHere_ = shmHere_ || t.name == kShm;
  }
  if (o_.connector) {
    send(wf::encodeHello(wf::HandshakeType::kHello, o_.local));
    state_ = State::kAwaitHelloReply;
  } else {
    state_ = State::kAwaitHello;
  }
}

std::vector<std::vector<uint8_t>> Handshake::takeOutgoing() {
  auto out = std::move(outgoing_);
  outgoing_.clear();
  return out;
}

wf::HandshakeType Handshake::expected() const {
  switch (state_) {
    case State::kAwaitHello:
      return wf::HandshakeType::kHello;
    case State::kAwaitHelloReply:
      return wf::HandshakeType::kHelloReply;
    case State::kAwaitAuth:
      return wf::HandshakeType::kAuth;
    case State::kAwaitBind:
      return wf::HandshakeType::kUpgradeFailed;
    case State::kAwaitDecision:
      return wf::HandshakeType::kUpgradeDecision;
    default:
      return wf::HandshakeType::kAccept;
  }
}

size_t Handshake::feed(std::span<const uint8_t> in) {
  if (done()) {
    return 0;
  }
  if (in.size() < kHeader) {
    wanted_ = kHeader;
    return 0;
  }
  size_t body = 0;
  Error e = wf::decodeHandshakeHeader(in.first(kHeader), expected(), &body);
  if (!e.ok()) {
    fail(e.withContext(who_));
    return 0;
  }
  wanted_ = kHeader + body;
  if (in.size() < wanted_) {
    return 0;
  }
  const size_t used = wanted_;
  wanted_ = kHeader;
  const auto msg = in.subspan(kHeader, body);
  switch (state_) {
    case State::kAwaitHello:
      onHello(msg);
      break;
    case State::kAwaitHelloReply:
      onHelloReply(msg);
      break;
    case State::kAwaitAuth:
      onAuth(msg);
      break;
    case State::kAwaitAccept:
      onAccept(msg);
      break;
    case State::kAwaitBind:
      onUpgradeFailed(msg);
      break;
    case State::kAwaitDecision:
      onDecision(msg, in.size() - used);
      break;
    case State::kEstablished:
    case State::kFailed:
      break;
  }
  return used;
}

Error Handshake::tokenConfigMismatch() const {
  return Error::auth(who_ + ": job token configured on " +
                     (o_.token ? "this side but not on the peer"
                               : "the peer but not on this side"));
}

void Handshake::onHello(std::span<const uint8_t> body) {
  wf::Hello hello;
  hello.version = 0;
  Error e = wf::decodeHello(body, wf::HandshakeType::kHello, &hello);
  wf::Hello mine = o_.local;
  myNonce_ = o_.nonce();
  mine.nonce = myNonce_;
  if (!e.ok()) {
    if (hello.version != 0 && hello.version != wf::kProtocolVersion) {
      // Let the peer see our version and fail with a clear message too.
      send(wf::encodeHello(wf::HandshakeType::kHelloReply, mine));
    }
    fail(e.withContext(who_));
    return;
  }
  remote_ = std::move(hello);
  send(wf::encodeHello(wf::HandshakeType::kHelloReply, mine));
  if (remote_.tokenConfigured != o_.token.has_value()) {
    fail(tokenConfigMismatch());
    return;
  }
  state_ = State::kAwaitAuth;
}

void Handshake::onHelloReply(std::span<const uint8_t> body) {
  wf::Hello hello;
  Error e = wf::decodeHello(body, wf::HandshakeType::kHelloReply, &hello);
  if (!e.ok()) {
    fail(e.withContext(who_));
    return;
  }
  remote_ = std::move(hello);
  peerNonce_ = remote_.nonce;
  if (remote_.tokenConfigured != o_.token.has_value()) {
    fail(tokenConfigMismatch());
    return;
  }
  wf::AuthMessage a;
  myNonce_ = o_.nonce();
  a.nonce = myNonce_;
  if (o_.token) {
    a.proof = auth::computeProof(*o_.token, "connector", peerNonce_, myNonce_);
  }
  send(wf::encodeAuth(a));
  state_ = State::kAwaitAccept;
}

void Handshake::onAuth(std::span<const uint8_t> body) {
  wf::AuthMessage a;
  Error e = wf::decodeAuth(body, &a);
  if (!e.ok()) {
    fail(e.withContext(who_));
    return;
  }
  peerNonce_ = a.nonce;
  wf::AcceptMessage acc;
  if (o_.token) {
    Error v = a.proof ? auth::verifyProof(*o_.token, "connector", myNonce_,
                                          a.nonce, *a.proof, o_.peer)
                      : Error::auth("peer sent no job token proof");
    if (!v.ok()) {
      acc.status = wf::AcceptStatus::kAuthFailed;
      acc.reason = "job token proof rejected";
      send(wf::encodeAccept(acc));
      fail(v.withContext(who_));
      return;
    }
    acc.proof = auth::computeProof(*o_.token, "acceptor", a.nonce, myNonce_);
  } else if (a.proof) {
    fail(Error::protocol(
        who_ + ": peer sent a token proof although neither side has a token"));
    return;
  }
  const bool sameHost = remote_.hostId == o_.local.hostId;
  Negotiated n;
  Error ne = negotiate(o_.transports, o_.channels, remote_, sameHost,
                       o_.bootstrap, &n);
  if (!ne.ok()) {
    acc.status = wf::AcceptStatus::kNoCommonTransport;
    acc.reason = ne.message();
    acc.proof.reset();
    send(wf::encodeAccept(acc));
    fail(ne.withContext(who_));
    return;
  }
  acc.transport = n.transport;
  acc.channel = n.channel;
  acc.cudaChannel = n.cudaChannel;
  if (!o_.upgradeAddress.empty() && o_.bootstrap != kShm &&
      contains(remote_.transports, kShm) && sameHost && shmHere_) {
    upgradeToken_ = o_.nonce();
    acc.upgradeAddress = o_.upgradeAddress;
    acc.upgradeToken = upgradeToken_;
    send(wf::encodeAccept(acc));
    negotiated_ = n;
    state_ = State::kAwaitBind;
    return;
  }
  send(wf::encodeAccept(acc));
  establish(n);
}

void Handshake::onAccept(std::span<const uint8_t> body) {
  wf::AcceptMessage acc;
  Error e = wf::decodeAccept(body, &acc);
  if (!e.ok()) {
    fail(e.withContext(who_));
    return;
  }
  if (acc.status == wf::AcceptStatus::kAuthFailed) {
    fail(Error::auth(who_ +
                     ": peer rejected this side's job token: " + acc.reason));
    return;
  }
  if (acc.status == wf::AcceptStatus::kNoCommonTransport) {
    fail(Error(Code::kFailedPrecondition,
               who_ + ": no common transport/channel: " + acc.reason));
    return;
  }
  if (o_.token) {
    Error v = acc.proof ? auth::verifyProof(*o_.token, "acceptor", myNonce_,
                                            peerNonce_, *acc.proof, o_.peer)
                        : Error::auth("peer sent no job token proof");
    if (!v.ok()) {
      fail(v.withContext(who_));
      return;
    }
  } else if (acc.proof) {
    fail(Error::protocol(who_ + ": unexpected token proof"));
    return;
  }
  bool channelOk = false;
  bool cudaOk = acc.cudaChannel.empty();
  for (const auto& c : o_.channels) {
    channelOk =
        channelOk || (c.name == acc.channel && c.inlineChannel && c.cpu);
    cudaOk = cudaOk || (c.name == acc.cudaChannel && c.cuda && c.outOfBand);
  }
  if (acc.transport != o_.bootstrap || !channelOk || !cudaOk) {
    fail(Error::protocol(
        who_ + ": peer chose transport '" + acc.transport + "', channel '" +
        acc.channel + "' and cuda channel '" + acc.cudaChannel +
        "', which this side did not offer for this connection"));
    return;
  }
  const Negotiated chosen{acc.transport, acc.channel, acc.cudaChannel};
  if (acc.upgradeAddress.empty()) {
    establish(chosen);
    return;
  }
  // Whatever happens from here, the acceptor decides (over this
  // connection) and this side follows.
  negotiated_ = chosen;
  upgradeToken_ = acc.upgradeToken;
  state_ = State::kAwaitDecision;
  Error why = wf::checkUpgradeAddress(acc.upgradeAddress);
  if (why.ok() && remote_.hostId != o_.local.hostId) {
    why = Error::protocol("peer offered an shm upgrade from another host");
  }
  if (why.ok() && !shmHere_) {
    why = Error(Code::kFailedPrecondition,
                "shm is not enabled or not viable on this side");
  }
  if (!why.ok()) {
    upgradeRefusal_ = why.message();
    send(wf::encodeUpgradeFailed(upgradeRefusal_));
    return;
  }
  upgradeTarget_ = acc.upgradeAddress;
}

std::vector<uint8_t> Handshake::upgradeConnected() {
  TRELLIS_CHECK(state_ == State::kAwaitDecision && !upgradeTarget_.empty() &&
                    upgradeToken_.has_value() && !bound_,
                "Handshake::upgradeConnected without an upgrade to bind");
  wf::BindMessage b;
  b.token = *upgradeToken_;
  if (o_.token) {
    b.proof = auth::computeProof(*o_.token, "upgrade", peerNonce_, b.token);
  }
  bound_ = true;
  return wf::encodeBind(b);
}

void Handshake::upgradeFailed(const std::string& why) {
  if (state_ != State::kAwaitDecision) {
    return;
  }
  send(wf::encodeUpgradeFailed(why));
}

void Handshake::onDecision(std::span<const uint8_t> body, size_t after) {
  wf::UpgradeDecision d;
  Error e = wf::decodeUpgradeDecision(body, &d);
  if (!e.ok()) {
    fail(e.withContext(who_));
    return;
  }
  if (d == wf::UpgradeDecision::kStay) {
    establish(negotiated_);
    return;
  }
  if (!bound_) {
    fail(Error::protocol(
        who_ + ": peer switched to shm, but no shm connection was bound"));
    return;
  }
  if (after != 0) {
    fail(Error::protocol(who_ + ": bytes after the upgrade decision on " +
                         o_.bootstrap));
    return;
  }
  switched_ = true;
  negotiated_.transport = kShm;
  establish(negotiated_);
}

void Handshake::onUpgradeFailed(std::span<const uint8_t> body) {
  std::string reason;
  Error e = wf::decodeUpgradeFailed(body, &reason);
  if (!e.ok()) {
    fail(e.withContext(who_));
    return;
  }
  stay("the peer could not upgrade: " + reason);
}

bool Handshake::bind(const wf::BindMessage& bind, const std::string& bindPeer,
                     bool bootstrapBytesPending) {
  if (state_ != State::kAwaitBind) {
    return false;
  }
  Error v;
  if (!upgradeToken_ || bind.token != *upgradeToken_) {
    v = Error::protocol("bind names another pipe's token");
  } else if (o_.token) {
    v = bind.proof ? auth::verifyProof(*o_.token, "upgrade", myNonce_,
                                       *upgradeToken_, *bind.proof, bindPeer)
                   : Error::auth("bind carries no job token proof");
  } else if (bind.proof) {
    v = Error::protocol("bind carries a proof although no token is set");
  }
  if (!v.ok() || bootstrapBytesPending) {
    stay(v.ok() ? "bytes after the accept on " + o_.bootstrap
                : "bind rejected: " + v.message());
    return false;
  }
  send(wf::encodeUpgradeDecision(wf::UpgradeDecision::kSwitch));
  switched_ = true;
  negotiated_.transport = kShm;
  establish(negotiated_);
  return true;
}

void Handshake::stay(const std::string& why) {
  if (state_ != State::kAwaitBind) {
    return;
  }
  stayReason_ = why;
  send(wf::encodeUpgradeDecision(wf::UpgradeDecision::kStay));
  establish(negotiated_);
}

void Handshake::send(std::vector<uint8_t> bytes) {
  outgoing_.push_back(std::move(bytes));
}

void Handshake::establish(const Negotiated& n) {
  negotiated_ = n;
  state_ = State::kEstablished;
}

void Handshake::fail(const Error& error) {
  if (state_ == State::kFailed) {
    return;
  }
  error_ = error;
  state_ = State::kFailed;
}

}  // namespace trellis::transport
