// The handshake state machine (transport/handshake.h) on its own: two
// machines wired back to back, bytes delivered whole or one at a time, and
// hand-made messages for what an honest peer never sends.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <trellis/transport/handshake.h>

namespace trellis::transport::testing {
namespace {

namespace wf = wire_format;
using State = Handshake::State;

constexpr size_t kWhole = std::numeric_limits<size_t>::max();

struct SideConfig {
  std::string hostId = "host-a";
  std::optional<auth::JobToken> token;
  std::vector<std::string> transports = {"shm", "uv"};
  std::vector<std::string> channels = {"cma", "basic"};
  std::string upgradeAddress;
};

Offer transportOffer(const std::string& name) {
  Offer o;
  o.name = name;
  o.sameHostOnly = name == "shm";
  return o;
}

Offer channelOffer(const std::string& name) {
  Offer o;
  o.name = name;
  o.sameHostOnly = name == "cma";
  o.outOfBand = name == "cma";
  return o;
}

HandshakeOptions options(bool connector, const SideConfig& c) {
  HandshakeOptions o;
  o.connector = connector;
  o.local.transports = c.transports;
  o.local.channels = c.channels;
  o.local.hostId = c.hostId;
  o.local.pid = connector ? 100 : 200;
  o.local.tokenConfigured = c.token.has_value();
  o.token = c.token;
  for (const auto& t : c.transports) {
    o.transports.push_back(transportOffer(t));
  }
  for (const auto& ch : c.channels) {
    o.channels.push_back(channelOffer(ch));
  }
  o.bootstrap = "uv";
  o.upgradeAddress = c.upgradeAddress;
  o.id = connector ? "c.pipe0" : "a.pipe0";
  o.peer = "uv://peer";
  auto counter = std::make_shared<uint8_t>(connector ? 0 : 128);
  o.nonce = [counter] {
    auth::Nonce n{};
    n.fill(++*counter);
    return n;
  };
  return o;
}

// One end: bytes the peer sent that have not arrived yet, and those that
// arrived but the machine has not consumed.
struct End {
  explicit End(HandshakeOptions o) : hs(std::move(o)) {}
  Handshake hs;
  std::vector<uint8_t> inFlight;
  std::vector<uint8_t> arrived;

  // Lets up to `chunk` more bytes arrive and feeds the machine.
  bool receive(size_t chunk) {
    const size_t n = std::min(chunk, inFlight.size());
    arrived.insert(arrived.end(), inFlight.begin(), inFlight.begin() + n);
    inFlight.erase(inFlight.begin(), inFlight.begin() + n);
    bool moved = n > 0;
    while (size_t used = hs.feed(arrived)) {
      arrived.erase(arrived.begin(), arrived.begin() + used);
      moved = true;
    }
    return moved;
  }
};

bool sendTo(Handshake& from, End& to) {
  bool moved = false;
  for (auto& m : from.takeOutgoing()) {
    to.inFlight.insert(to.inFlight.end(), m.begin(), m.end());
    moved = true;
  }
  return moved;
}

struct Wire {
  Wire(const SideConfig& c, const SideConfig& a)
      : connector(options(true, c)), acceptor(options(false, a)) {}
  End connector;
  End acceptor;

  // Delivers both ways until nothing moves.
  void run(size_t chunk = kWhole) {
    bool moved = true;
    while (moved) {
      moved = sendTo(connector.hs, acceptor);
      moved = sendTo(acceptor.hs, connector) || moved;
      moved = connector.receive(chunk) || moved;
      moved = acceptor.receive(chunk) || moved;
    }
  }
};

wf::BindMessage decodeBindBytes(const std::vector<uint8_t>& bytes) {
  size_t len = 0;
  EXPECT_TRUE(
      wf::decodeHandshakeHeader(std::span<const uint8_t>(bytes).first(9),
                                wf::HandshakeType::kBind, &len)
          .ok());
  wf::BindMessage b;
  EXPECT_TRUE(
      wf::decodeBind(std::span<const uint8_t>(bytes).subspan(9), &b).ok());
  return b;
}

class HandshakeChunks : public ::testing::TestWithParam<size_t> {};

TEST_P(HandshakeChunks, DifferentHostsAgreeOnUvAndBasic) {
  SideConfig c;
  SideConfig a;
  a.hostId = "host-b";
  Wire w(c, a);
  w.run(GetParam());
  ASSERT_EQ(w.connector.hs.state(), State::kEstablished);
  ASSERT_EQ(w.acceptor.hs.state(), State::kEstablished);
  EXPECT_EQ(w.connector.hs.negotiated().transport, "uv");
  EXPECT_EQ(w.connector.hs.negotiated().channel, "basic");
  EXPECT_EQ(w.acceptor.hs.negotiated().channel, "basic");
  EXPECT_FALSE(w.connector.hs.switched());
  EXPECT_EQ(w.acceptor.hs.remote().pid, 100u);
  EXPECT_EQ(w.connector.hs.remote().pid, 200u);
  EXPECT_TRUE(w.connector.arrived.empty());
  EXPECT_TRUE(w.acceptor.arrived.empty());
}

TEST_P(HandshakeChunks, MatchingTokensAuthenticateOnOneHost) {
  SideConfig c;
  c.token = auth::JobToken::fromString("a-job-token-of-some-length");
  SideConfig a = c;
  Wire w(c, a);
  w.run(GetParam());
  ASSERT_EQ(w.connector.hs.state(), State::kEstablished);
  ASSERT_EQ(w.acceptor.hs.state(), State::kEstablished);
  EXPECT_EQ(w.connector.hs.negotiated().channel, "cma");
  EXPECT_EQ(w.acceptor.hs.negotiated().channel, "cma");
}

TEST_P(HandshakeChunks, SameHostUpgradeSwitchesBothSidesToShm) {
  SideConfig c;
  c.token = auth::JobToken::fromString("a-job-token-of-some-length");
  SideConfig a = c;
  a.upgradeAddress = "shm://listener-1";
  Wire w(c, a);
  w.run(GetParam());
  ASSERT_EQ(w.acceptor.hs.state(), State::kAwaitBind);
  ASSERT_EQ(w.connector.hs.state(), State::kAwaitDecision);
  ASSERT_TRUE(w.acceptor.hs.upgradeToken().has_value());
  EXPECT_EQ(w.connector.hs.upgradeToken(), w.acceptor.hs.upgradeToken());
  EXPECT_EQ(w.connector.hs.upgradeTarget(), "shm://listener-1");
  const auto bind = decodeBindBytes(w.connector.hs.upgradeConnected());
  EXPECT_TRUE(w.acceptor.hs.bind(bind, "shm://peer", false));
  EXPECT_EQ(w.acceptor.hs.state(), State::kEstablished);
  w.run(GetParam());
  ASSERT_EQ(w.connector.hs.state(), State::kEstablished);
  EXPECT_TRUE(w.connector.hs.switched());
  EXPECT_TRUE(w.acceptor.hs.switched());
  EXPECT_EQ(w.connector.hs.negotiated().transport, "shm");
  EXPECT_EQ(w.acceptor.hs.negotiated().transport, "shm");
  EXPECT_EQ(w.connector.hs.negotiated().channel, "cma");
}

INSTANTIATE_TEST_SUITE_P(Delivery, HandshakeChunks,
                         ::testing::Values(kWhole, size_t{1}, size_t{7}),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return info.param == kWhole
                                      ? std::string("whole")
                                      : "chunks_of_" +
                                            std::to_string(info.param);
                         });

TEST(Handshake, WrongTokenFailsBothSidesWithAuthErrors) {
  SideConfig c;
  c.token = auth::JobToken::fromString("a-job-token-of-some-length");
  SideConfig a;
  a.token = auth::JobToken::fromString("another-token-entirely");
  Wire w(c, a);
  w.run();
  ASSERT_EQ(w.acceptor.hs.state(), State::kFailed);
  ASSERT_EQ(w.connector.hs.state(), State::kFailed);
  EXPECT_EQ(w.acceptor.hs.error().code(), Code::kUnauthenticated);
  EXPECT_EQ(w.connector.hs.error().code(), Code::kUnauthenticated);
  EXPECT_NE(w.connector.hs.error().message().find("rejected"),
            std::string::npos);
}

TEST(Handshake, TokenOnOneSideOnlyIsAnAuthErrorOnBoth) {
  SideConfig c;
  c.token = auth::JobToken::fromString("a-job-token-of-some-length");
  Wire w(c, SideConfig{});
  w.run();
  EXPECT_EQ(w.acceptor.hs.error().code(), Code::kUnauthenticated);
  EXPECT_EQ(w.connector.hs.error().code(), Code::kUnauthenticated);
}

TEST(Handshake, NoCommonChannelIsAFailedPreconditionOnBoth) {
  SideConfig c;
  c.channels = {"cma"};
  SideConfig a;
  a.channels = {"basic"};
  Wire w(c, a);
  w.run();
  EXPECT_EQ(w.acceptor.hs.error().code(), Code::kFailedPrecondition);
  EXPECT_EQ(w.connector.hs.error().code(), Code::kFailedPrecondition);
}

TEST(Handshake, BadMagicFailsAsSoonAsTheHeaderIsIn) {
  Handshake hs(options(false, SideConfig{}));
  const std::vector<uint8_t> header = {'X', 'R', 'L', 'S', 1, 0, 16, 0, 0};
  EXPECT_EQ(hs.feed(std::span<const uint8_t>(header).first(8)), 0u);
  EXPECT_EQ(hs.state(), State::kAwaitHello);
  EXPECT_EQ(hs.feed(header), 0u);
  EXPECT_EQ(hs.state(), State::kFailed);
  EXPECT_EQ(hs.error().code(), Code::kDataLoss);
  EXPECT_TRUE(hs.takeOutgoing().empty());
  EXPECT_EQ(hs.feed(header), 0u);  // final
}

TEST(Handshake, AnotherVersionGetsOurHelloAndFails) {
  Handshake hs(options(false, SideConfig{}));
  wf::Hello old;
  old.version = 1;
  old.transports = {"uv"};
  old.channels = {"basic"};
  const auto bytes = wf::encodeHello(wf::HandshakeType::kHello, old);
  EXPECT_EQ(hs.feed(bytes), bytes.size());
  EXPECT_EQ(hs.state(), State::kFailed);
  EXPECT_EQ(hs.error().code(), Code::kDataLoss);
  const auto out = hs.takeOutgoing();
  ASSERT_EQ(out.size(), 1u);
  size_t len = 0;
  EXPECT_TRUE(
      wf::decodeHandshakeHeader(std::span<const uint8_t>(out[0]).first(9),
                                wf::HandshakeType::kHelloReply, &len)
          .ok());
}

TEST(Handshake, BytesAfterTheHandshakeAreLeftForFrames) {
  SideConfig a;
  a.hostId = "host-b";
  Wire w(SideConfig{}, a);
  w.run();
  ASSERT_EQ(w.connector.hs.state(), State::kEstablished);
  const std::vector<uint8_t> frame = {4, 0, 0, 0, 1, 0, 0, 0};
  EXPECT_EQ(w.connector.hs.feed(frame), 0u);
  EXPECT_EQ(w.acceptor.hs.feed(frame), 0u);
}

// Gets a connector to kAwaitAccept against a real acceptor, then hands it
// `accept` instead of the acceptor's.
Handshake connectorFacing(const wf::AcceptMessage& accept) {
  SideConfig a;
  a.hostId = "host-b";
  Wire w(SideConfig{}, a);
  sendTo(w.connector.hs, w.acceptor);
  w.acceptor.receive(kWhole);  // hello -> hello reply
  sendTo(w.acceptor.hs, w.connector);
  w.connector.receive(kWhole);  // hello reply -> auth
  EXPECT_EQ(w.connector.hs.state(), State::kAwaitAccept);
  w.connector.hs.takeOutgoing();
  const auto bytes = wf::encodeAccept(accept);
  EXPECT_EQ(w.connector.hs.feed(bytes), bytes.size());
  return std::move(w.connector.hs);
}

TEST(Handshake, ConnectorRefusesAChoiceItDidNotOffer) {
  wf::AcceptMessage acc;
  acc.transport = "uv";
  acc.channel = "fancy";
  auto hs = connectorFacing(acc);
  EXPECT_EQ(hs.state(), State::kFailed);
  EXPECT_EQ(hs.error().code(), Code::kDataLoss);
  acc.channel = "basic";
  acc.transport = "shm";
  EXPECT_EQ(connectorFacing(acc).error().code(), Code::kDataLoss);
  acc.transport = "uv";
  EXPECT_EQ(connectorFacing(acc).state(), State::kEstablished);
}

TEST(Handshake, UpgradeFromAnotherHostIsRefusedAndReported) {
  wf::AcceptMessage acc;
  acc.transport = "uv";
  acc.channel = "basic";
  acc.upgradeAddress = "shm://x";
  acc.upgradeToken = auth::Nonce{};
  auto hs = connectorFacing(acc);
  EXPECT_EQ(hs.state(), State::kAwaitDecision);
  EXPECT_TRUE(hs.upgradeTarget().empty());
  EXPECT_NE(hs.upgradeRefusal().find("another host"), std::string::npos);
  const auto out = hs.takeOutgoing();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0][4], static_cast<uint8_t>(wf::HandshakeType::kUpgradeFailed));
  // The acceptor still decides; "stay" establishes on uv.
  const auto stay = wf::encodeUpgradeDecision(wf::UpgradeDecision::kStay);
  EXPECT_EQ(hs.feed(stay), stay.size());
  EXPECT_EQ(hs.state(), State::kEstablished);
  EXPECT_FALSE(hs.switched());
}

struct UpgradeWire : Wire {
  UpgradeWire() : Wire(config(), withAddress(config())) {}
  static SideConfig config() { return SideConfig{}; }
  static SideConfig withAddress(SideConfig c) {
    c.upgradeAddress = "shm://listener-1";
    return c;
  }
};

TEST(HandshakeUpgrade, ConnectFailureMakesBothStayOnUv) {
  UpgradeWire w;
  w.run();
  ASSERT_EQ(w.connector.hs.state(), State::kAwaitDecision);
  w.connector.hs.upgradeFailed("connect: refused");
  w.run();
  ASSERT_EQ(w.acceptor.hs.state(), State::kEstablished);
  ASSERT_EQ(w.connector.hs.state(), State::kEstablished);
  EXPECT_FALSE(w.acceptor.hs.switched());
  EXPECT_FALSE(w.connector.hs.switched());
  EXPECT_EQ(w.connector.hs.negotiated().transport, "uv");
  EXPECT_NE(w.acceptor.hs.stayReason().find("connect: refused"),
            std::string::npos);
}

TEST(HandshakeUpgrade, AcceptorThatGivesUpStaysAndTheConnectorFollows) {
  UpgradeWire w;
  w.run();
  const auto bind = decodeBindBytes(w.connector.hs.upgradeConnected());
  w.acceptor.hs.stay("no bound shm connection within 10s");
  EXPECT_FALSE(w.acceptor.hs.bind(bind, "shm://peer", false));  // too late
  w.run();
  ASSERT_EQ(w.connector.hs.state(), State::kEstablished);
  EXPECT_FALSE(w.connector.hs.switched());
}

TEST(HandshakeUpgrade, WrongBindsAndEarlyBytesKeepThePipeOnUv) {
  {
    UpgradeWire w;
    w.run();
    auto bind = decodeBindBytes(w.connector.hs.upgradeConnected());
    bind.token[0] ^= 1;
    EXPECT_FALSE(w.acceptor.hs.bind(bind, "shm://peer", false));
    EXPECT_NE(w.acceptor.hs.stayReason().find("bind rejected"),
              std::string::npos);
  }
  {
    UpgradeWire w;
    w.run();
    auto bind = decodeBindBytes(w.connector.hs.upgradeConnected());
    bind.proof = auth::Mac{};  // no token configured: no proof expected
    EXPECT_FALSE(w.acceptor.hs.bind(bind, "shm://peer", false));
  }
  {
    UpgradeWire w;
    w.run();
    const auto bind = decodeBindBytes(w.connector.hs.upgradeConnected());
    EXPECT_FALSE(w.acceptor.hs.bind(bind, "shm://peer", true));
    EXPECT_NE(w.acceptor.hs.stayReason().find("bytes after the accept"),
              std::string::npos);
    w.run();
    EXPECT_EQ(w.connector.hs.state(), State::kEstablished);
    EXPECT_FALSE(w.connector.hs.switched());
  }
}

TEST(HandshakeUpgrade, SwitchWithoutABoundConnectionIsAProtocolError) {
  UpgradeWire w;
  w.run();
  const auto sw = wf::encodeUpgradeDecision(wf::UpgradeDecision::kSwitch);
  w.connector.hs.feed(sw);
  EXPECT_EQ(w.connector.hs.state(), State::kFailed);
  EXPECT_EQ(w.connector.hs.error().code(), Code::kDataLoss);
}

TEST(HandshakeUpgrade, BytesAfterTheSwitchAreAProtocolError) {
  UpgradeWire w;
  w.run();
  w.connector.hs.upgradeConnected();
  auto sw = wf::encodeUpgradeDecision(wf::UpgradeDecision::kSwitch);
  sw.push_back(0);
  w.connector.hs.feed(sw);
  EXPECT_EQ(w.connector.hs.state(), State::kFailed);
  EXPECT_NE(w.connector.hs.error().message().find("bytes after"),
            std::string::npos);
}

TEST(HandshakeUpgrade, NoOfferToAConnectorWithoutShm) {
  SideConfig c;
  c.transports = {"uv"};
  Wire w(c, UpgradeWire::withAddress(SideConfig{}));
  w.run();
  EXPECT_EQ(w.acceptor.hs.state(), State::kEstablished);
  EXPECT_FALSE(w.acceptor.hs.upgradeToken().has_value());
  EXPECT_EQ(w.connector.hs.state(), State::kEstablished);
}

}  // namespace
}  // namespace trellis::transport::testing
