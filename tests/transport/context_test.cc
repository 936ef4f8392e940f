// Context options, environment filters, negotiation and the wire format.

#include <algorithm>
#include <cstdlib>

#include "transport_test_util.h"
#include <trellis/transport/basic_channel.h>
#include <trellis/transport/context_impl.h>
#include <trellis/transport/wire_format.h>

namespace trellis::transport::testing {
namespace {

namespace wf = wire_format;

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      old_ = old;
    }
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(TransportOptionsTest, NameListsAreParsedStrictly) {
  const std::vector<std::string> known = {"uv", "shm"};
  EXPECT_EQ(parseNameList("V", "uv", known), (std::vector<std::string>{"uv"}));
  EXPECT_EQ(parseNameList("V", " shm , uv ,shm", known),
            (std::vector<std::string>{"shm", "uv"}));
  EXPECT_FALSE(parseNameList("V", "", known).has_value());
  try {
    parseNameList("TRELLIS_TRANSPORTS", "uv,tcp", known);
    FAIL() << "expected InvalidArgumentError";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("TRELLIS_TRANSPORTS"),
              std::string::npos);
    EXPECT_NE(std::string(e.what()).find("'tcp'"), std::string::npos);
  }
  EXPECT_THROW(parseNameList("V", "uv,,shm", known), InvalidArgumentError);
}

TEST(TransportOptionsTest, UnknownEnvironmentEntryFailsCreate) {
  ScopedEnv env("TRELLIS_CHANNELS", "basic,carrier-pigeon");
  try {
    Context::create();
    FAIL() << "expected InvalidArgumentError";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("TRELLIS_CHANNELS"),
              std::string::npos);
    EXPECT_NE(std::string(e.what()).find("carrier-pigeon"), std::string::npos);
  }
}

TEST(TransportOptionsTest, UnknownOptionEntryFailsCreate) {
  ContextOptions o;
  o.transports = {"uv", "ib"};
  EXPECT_THROW(Context::create(o), InvalidArgumentError);
}

TEST(TransportOptionsTest, EnvironmentRestrictsTheChoice) {
  auto contains = [](const std::vector<std::string>& v, const char* name) {
    return std::find(v.begin(), v.end(), name) != v.end();
  };
  {
    ScopedEnv env("TRELLIS_TRANSPORTS", "shm");
    auto ctx = Context::create();
    EXPECT_FALSE(contains(ctx->transportNames(), "uv"));
    EXPECT_THROW(ctx->listen({"uv://127.0.0.1:0"}), InvalidArgumentError);
  }
  {
    ScopedEnv env("TRELLIS_CHANNELS", "cma");
    auto ctx = Context::create();
    EXPECT_FALSE(contains(ctx->channelNames(), "basic"));
  }
  auto ctx = Context::create();
  EXPECT_TRUE(contains(ctx->transportNames(), "uv"));
  EXPECT_TRUE(contains(ctx->channelNames(), "basic"));
}

TEST(TransportOptionsTest, NoCommonChannelFailsTheHandshake) {
  ContextOptions s;
  s.tokenFromEnvironment = false;
  ContextOptions c = s;
  c.channels = {"cuda_ipc"};  // known but not registered: offers nothing
  auto server = Context::create(s);
  auto client = Context::create(c);
  auto l = server->listen({"uv://127.0.0.1:0"});
  auto cp = client->connect(l->address("uv"));
  auto sp = acceptOne(*l);
  auto r = readAsync(sp);
  ASSERT_TRUE(r.waitFor(kWait));
  EXPECT_EQ(r.error().code(), Code::kFailedPrecondition) << r.error().what();
  auto w = writeAsync(*cp, Message());
  ASSERT_TRUE(w.waitFor(kWait));
  EXPECT_EQ(w.error().code(), Code::kFailedPrecondition) << w.error().what();
}

TEST(TransportOptionsTest, ListenRejectsBadAddresses) {
  auto ctx = Context::create();
  EXPECT_THROW(ctx->listen({"uv://127.0.0.1"}), InvalidArgumentError);
  EXPECT_THROW(ctx->listen({"uv://not-an-ip:0"}), InvalidArgumentError);
  EXPECT_THROW(ctx->listen({"tcp://127.0.0.1:0"}), InvalidArgumentError);
  EXPECT_THROW(ctx->listen({"uv://127.0.0.1:0", "uv://[::1]:0"}),
               InvalidArgumentError);
  EXPECT_THROW(ctx->listen({}), InvalidArgumentError);
  auto l = ctx->listen({"uv://[::1]:0"});
  EXPECT_EQ(l->address("uv").rfind("uv://[::1]:", 0), 0u);
  EXPECT_NE(l->address("uv"), "uv://[::1]:0");
  EXPECT_THROW(l->address("shm"), NotFoundError);
  // Binding a port in use: EADDRINUSE maps to ALREADY_EXISTS.
  EXPECT_THROW(ctx->listen({l->address("uv")}), AlreadyExistsError);
}

TEST(TransportOptionsTest, RegistrationAfterUseFails) {
  auto ctx = Context::create();
  auto l = ctx->listen({"uv://127.0.0.1:0"});
  EXPECT_THROW(ctx->registerChannel(1, basic::create()),
               FailedPreconditionError);
}

TEST(TransportOptionsTest, ContextsCloseAndJoinFromAnywhere) {
  auto ctx = Context::create();
  EXPECT_FALSE(ctx->join(std::chrono::milliseconds(20)));  // still running
  ctx->close();
  ctx->close();
  EXPECT_TRUE(ctx->join(std::chrono::seconds(10)));
  // Destroyed without close(): the destructor closes and joins.
  auto other = Context::create();
  other.reset();
}

// ---- negotiation ---------------------------------------------------------

TEST(NegotiationTest, PrefersSameHostChannelsOnlyOnOneHost) {
  std::vector<Offer> transports = {{"uv", false, true}};
  std::vector<Offer> channels = {{"fastlocal", true, true},
                                 {"basic", false, true}};
  wf::Hello remote;
  remote.transports = {"uv"};
  remote.channels = {"basic", "fastlocal"};
  Negotiated n;
  ASSERT_TRUE(negotiate(transports, channels, remote, true, "uv", &n).ok());
  EXPECT_EQ(n.channel, "fastlocal");
  ASSERT_TRUE(negotiate(transports, channels, remote, false, "uv", &n).ok());
  EXPECT_EQ(n.channel, "basic");
}

TEST(NegotiationTest, SkipsOutOfBandChannelsAndUnsharedOnes) {
  std::vector<Offer> transports = {{"uv", false, true}};
  std::vector<Offer> channels = {{"cma", true, false}, {"basic", false, true}};
  wf::Hello remote;
  remote.transports = {"uv"};
  remote.channels = {"cma", "basic"};
  Negotiated n;
  ASSERT_TRUE(negotiate(transports, channels, remote, true, "uv", &n).ok());
  EXPECT_EQ(n.channel, "basic");
  remote.channels = {"cma"};
  EXPECT_EQ(negotiate(transports, channels, remote, true, "uv", &n).code(),
            Code::kFailedPrecondition);
  remote.channels = {"basic"};
  remote.transports = {"shm"};
  EXPECT_EQ(negotiate(transports, channels, remote, true, "uv", &n).code(),
            Code::kFailedPrecondition);
}

TEST(NegotiationTest, HostIdIsStable) {
  EXPECT_FALSE(localHostId().empty());
  EXPECT_EQ(localHostId(), localHostId());
}

// ---- wire format ---------------------------------------------------------

TEST(WireFormatTest, HandshakeMessagesRoundTrip) {
  wf::Hello h;
  h.transports = {"uv", "shm"};
  h.channels = {"basic"};
  h.hostId = "boot/ns";
  h.pid = 4242;
  h.tokenConfigured = true;
  h.nonce[3] = 9;
  auto bytes = wf::encodeHello(wf::HandshakeType::kHelloReply, h);
  size_t len = 0;
  ASSERT_TRUE(
      wf::decodeHandshakeHeader(std::span<const uint8_t>(bytes.data(), 9),
                                wf::HandshakeType::kHelloReply, &len)
          .ok());
  ASSERT_EQ(len, bytes.size() - 9);
  wf::Hello back;
  ASSERT_TRUE(wf::decodeHello(std::span<const uint8_t>(bytes).subspan(9),
                              wf::HandshakeType::kHelloReply, &back)
                  .ok());
  EXPECT_EQ(back.transports, h.transports);
  EXPECT_EQ(back.hostId, h.hostId);
  EXPECT_EQ(back.pid, 4242u);
  EXPECT_TRUE(back.tokenConfigured);
  EXPECT_EQ(back.nonce, h.nonce);
  // Wrong type in the header.
  EXPECT_EQ(wf::decodeHandshakeHeader(std::span<const uint8_t>(bytes.data(), 9),
                                      wf::HandshakeType::kHello, &len)
                .code(),
            Code::kDataLoss);
  // Every truncation fails cleanly.
  for (size_t cut = 9; cut < bytes.size(); ++cut) {
    wf::Hello t;
    EXPECT_FALSE(
        wf::decodeHello(std::span<const uint8_t>(bytes.data() + 9, cut - 9),
                        wf::HandshakeType::kHelloReply, &t)
            .ok());
  }
  wf::AcceptMessage acc;
  acc.status = wf::AcceptStatus::kAuthFailed;
  acc.reason = "nope";
  acc.proof = auth::Mac{};
  auto ab = wf::encodeAccept(acc);
  wf::AcceptMessage accBack;
  ASSERT_TRUE(
      wf::decodeAccept(std::span<const uint8_t>(ab).subspan(9), &accBack).ok());
  EXPECT_EQ(accBack.status, wf::AcceptStatus::kAuthFailed);
  EXPECT_EQ(accBack.reason, "nope");
  EXPECT_TRUE(accBack.proof.has_value());
}

TEST(WireFormatTest, FrameLayoutRoundTripsAndIsBounded) {
  static const uint8_t b[8] = {};
  Message m;
  m.descriptor = "desc";
  m.payloads = {{b, 8}, {b, 0}};
  m.tensors = {{b, 3, Device::cpu()}, {b, 5, Device::cuda(2)}};
  std::vector<uint8_t> head;
  wf::encodeFrameHead(m, &head);
  Limits limits;
  size_t layoutLen = 0;
  ASSERT_TRUE(wf::decodeFrameHeader(std::span<const uint8_t>(head.data(), 4),
                                    limits, &layoutLen)
                  .ok());
  wf::FrameLayout lay;
  ASSERT_TRUE(
      wf::decodeLayout(std::span<const uint8_t>(head).subspan(4), limits, &lay)
          .ok());
  EXPECT_EQ(lay.descriptorLength, 4u);
  EXPECT_EQ(lay.payloadLengths, (std::vector<size_t>{8, 0}));
  ASSERT_EQ(lay.tensors.size(), 2u);
  EXPECT_EQ(lay.tensors[1].device, Device::cuda(2));
  EXPECT_EQ(Device::cuda(2).toString(), "cuda:2");
  // Tighter limits reject the same layout.
  Limits tight;
  tight.maxPayloadBytes = 7;
  EXPECT_EQ(
      wf::decodeLayout(std::span<const uint8_t>(head).subspan(4), tight, &lay)
          .code(),
      Code::kDataLoss);
  tight = Limits();
  tight.maxTensorsPerMessage = 1;
  EXPECT_FALSE(
      wf::decodeLayout(std::span<const uint8_t>(head).subspan(4), tight, &lay)
          .ok());
  // Outgoing checks mirror them.
  EXPECT_EQ(wf::checkOutgoing(m, tight).code(), Code::kInvalidArgument);
  EXPECT_TRUE(wf::checkOutgoing(m, Limits()).ok());
}

}  // namespace
}  // namespace trellis::transport::testing
