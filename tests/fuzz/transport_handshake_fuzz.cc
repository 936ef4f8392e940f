// Fuzz target for the pipe handshake state machine (transport/handshake.h):
// one side of the handshake and of the same-host upgrade decision, fed the
// bytes a peer sent before it has proved anything.
//
// Input: byte 0 configures this side, the rest is the peer's byte stream.
//  bit 0    this side connects (else it accepts)
//  bit 1    a job token is configured (a fixed one)
//  bit 2    acceptor: the listener has an upgrade address
//  bit 3    upgrade: connector reports its shm connection up (else failed);
//           acceptor gets the honest bind (else one made of input bytes)
//  bits 4-5 delivery: 1, 2, 5 or 64 bytes at a time
//  bit 6    this side can use shm
// Nonces come from a counter, so a recorded honest transcript (the seeds)
// stays valid and reaches every state.
//
// Checked: feed() never consumes more than it is given, nothing once done;
// every message this side sends is well formed and of a type its role
// sends; the end state does not depend on how the bytes were split (but
// for bytes after a "switch" decision, caught only when already there);
// an established side agrees to what it offered; errors are DATA_LOSS,
// UNAUTHENTICATED or FAILED_PRECONDITION; an honest bind switches unless
// bytes wait on the first connection.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <trellis/transport/handshake.h>

namespace {

namespace transport = trellis::transport;
namespace wf = trellis::transport::wire_format;
namespace auth = trellis::auth;
using trellis::Code;
using State = transport::Handshake::State;

void require(bool cond) {
  if (!cond) {
    std::abort();
  }
}

struct Config {
  bool connector = false;
  bool token = false;
  bool upgradeAddress = false;
  bool upgradeGoesWell = false;
  size_t chunk = 1;
  bool shm = false;
};

Config parse(uint8_t b) {
  static constexpr size_t kChunks[] = {1, 2, 5, 64};
  Config c;
  c.connector = (b & 1) != 0;
  c.token = (b & 2) != 0;
  c.upgradeAddress = (b & 4) != 0;
  c.upgradeGoesWell = (b & 8) != 0;
  c.chunk = kChunks[(b >> 4) & 3];
  c.shm = (b & 64) != 0;
  return c;
}

const auth::JobToken& fixedToken() {
  static const auto token =
      auth::JobToken::fromString("fuzz-token-0123456789abcdef");
  return token;
}

auth::Nonce counterNonce(uint8_t n) {
  auth::Nonce out{};
  out.fill(n);
  return out;
}

// `firstNonce` lets a seed generator run an honest peer beside this side.
transport::HandshakeOptions makeOptions(const Config& c, bool connector,
                                        uint8_t firstNonce) {
  transport::HandshakeOptions o;
  o.connector = connector;
  std::vector<std::string> transports = {"uv"};
  if (c.shm) {
    transports.insert(transports.begin(), "shm");
  }
  o.local.transports = transports;
  o.local.channels = {"cma", "basic"};
  o.local.hostId = "fuzz-host";
  o.local.pid = connector ? 1 : 2;
  o.local.tokenConfigured = c.token;
  if (c.token) {
    o.token = fixedToken();
  }
  for (const auto& t : transports) {
    transport::Offer offer;
    offer.name = t;
    offer.sameHostOnly = t == "shm";
    o.transports.push_back(offer);
  }
  transport::Offer cma;
  cma.name = "cma";
  cma.sameHostOnly = true;
  cma.outOfBand = true;
  transport::Offer basic;
  basic.name = "basic";
  o.channels = {cma, basic};
  o.bootstrap = "uv";
  if (c.upgradeAddress && !connector) {
    o.upgradeAddress = "shm://fuzz-listener";
  }
  o.id = "fuzz.pipe0";
  o.peer = "uv://peer";
  auto counter = std::make_shared<uint8_t>(firstNonce);
  o.nonce = [counter] { return counterNonce((*counter)++); };
  return o;
}

void checkSent(const std::vector<uint8_t>& m, bool connector) {
  require(m.size() >= wf::kHandshakeHeaderBytes);
  const auto type = static_cast<wf::HandshakeType>(m[4]);
  size_t len = 0;
  require(wf::decodeHandshakeHeader(
              std::span<const uint8_t>(m).first(wf::kHandshakeHeaderBytes),
              type, &len)
              .ok());
  require(len == m.size() - wf::kHandshakeHeaderBytes);
  const auto body = std::span<const uint8_t>(m).subspan(9);
  if (connector) {
    if (type == wf::HandshakeType::kHello) {
      wf::Hello h;
      require(wf::decodeHello(body, type, &h).ok());
    } else if (type == wf::HandshakeType::kAuth) {
      wf::AuthMessage a;
      require(wf::decodeAuth(body, &a).ok());
    } else {
      std::string reason;
      require(type == wf::HandshakeType::kUpgradeFailed);
      require(wf::decodeUpgradeFailed(body, &reason).ok());
    }
    return;
  }
  if (type == wf::HandshakeType::kHelloReply) {
    wf::Hello h;
    require(wf::decodeHello(body, type, &h).ok());
  } else if (type == wf::HandshakeType::kAccept) {
    wf::AcceptMessage a;
    require(wf::decodeAccept(body, &a).ok());
  } else {
    wf::UpgradeDecision d;
    require(type == wf::HandshakeType::kUpgradeDecision);
    require(wf::decodeUpgradeDecision(body, &d).ok());
  }
}

struct Outcome {
  State state;
  Code code = Code::kOk;
  std::string message;
  std::vector<uint8_t> sent;
  bool switched = false;
};

Outcome drive(const Config& c, std::span<const uint8_t> stream, size_t chunk,
              std::span<const uint8_t> bindBytes) {
  transport::Handshake hs(makeOptions(c, c.connector, 1));
  Outcome out;
  auto collect = [&] {
    for (auto& m : hs.takeOutgoing()) {
      checkSent(m, c.connector);
      out.sent.insert(out.sent.end(), m.begin(), m.end());
    }
  };
  collect();
  std::vector<uint8_t> arrived;
  size_t pos = 0;
  bool acted = false;
  do {
    const size_t n = std::min(chunk, stream.size() - pos);
    arrived.insert(arrived.end(), stream.begin() + pos,
                   stream.begin() + pos + n);
    pos += n;
    while (true) {
      const bool wasDone = hs.done();
      const size_t used = hs.feed(arrived);
      require(used <= arrived.size());
      require(!wasDone || used == 0);
      if (used == 0) {
        break;
      }
      arrived.erase(arrived.begin(), arrived.begin() + used);
      collect();
      // The connector's shm connection comes up (or not) at once.
      if (hs.state() == State::kAwaitDecision && !acted) {
        acted = true;
        if (!hs.upgradeTarget().empty()) {
          if (c.upgradeGoesWell) {
            const auto bind = hs.upgradeConnected();
            wf::BindMessage b;
            require(
                wf::decodeBind(std::span<const uint8_t>(bind).subspan(9), &b)
                    .ok());
            require(b.token == *hs.upgradeToken());
            require(b.proof.has_value() == c.token);
          } else {
            hs.upgradeFailed("fuzz: connect failed");
          }
          collect();
        }
      }
    }
  } while (pos < stream.size());
  collect();
  if (hs.state() == State::kAwaitBind) {
    wf::BindMessage b;
    const bool honest = c.upgradeGoesWell;
    if (honest) {
      b.token = *hs.upgradeToken();
      if (c.token) {
        // The acceptor's first nonce is its challenge (nonceA).
        b.proof = auth::computeProof(fixedToken(), "upgrade", counterNonce(1),
                                     b.token);
      }
    } else {
      std::copy_n(bindBytes.begin(), std::min(bindBytes.size(), b.token.size()),
                  b.token.begin());
      if (bindBytes.size() > b.token.size()) {
        b.proof = auth::Mac{};
      }
    }
    const bool pending = !arrived.empty();
    const bool switched = hs.bind(b, "shm://peer", pending);
    if (honest) {
      require(switched == !pending);
    }
    require(hs.state() == State::kEstablished);
    collect();
    require(!hs.bind(b, "shm://peer", false));  // once only
  }
  out.state = hs.state();
  out.switched = hs.switched();
  if (hs.state() == State::kFailed) {
    out.code = hs.error().code();
    out.message = hs.error().message();
    require(out.code == Code::kDataLoss || out.code == Code::kUnauthenticated ||
            out.code == Code::kFailedPrecondition);
  }
  if (hs.state() == State::kEstablished) {
    const auto& n = hs.negotiated();
    require(n.transport == (hs.switched() ? "shm" : "uv"));
    require(n.channel == "cma" || n.channel == "basic");
    require(n.cudaChannel.empty());
    require(hs.feed(arrived) == 0);
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) {
    return 0;
  }
  const Config c = parse(data[0]);
  const std::span<const uint8_t> stream(data + 1, size - 1);
  const auto bindBytes = stream.last(std::min<size_t>(stream.size(), 33));
  const Outcome whole = drive(c, stream, stream.size() + 1, bindBytes);
  const Outcome split = drive(c, stream, c.chunk, bindBytes);
  if (whole.message.find("bytes after the upgrade decision") !=
      std::string::npos) {
    require(split.state == whole.state || split.switched);
    return 0;
  }
  require(split.state == whole.state);
  require(split.code == whole.code);
  require(split.switched == whole.switched);
  require(split.sent == whole.sent);
  return 0;
}
