// Context options, environment filters, negotiation and the wire format.

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "transport_test_util.h"
#include <trellis/transport/basic/factory.h>
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
  // A non-empty CUDA tensor never travels inline: as an inline frame the
  // layout is refused; with a record for it, it decodes.
  std::vector<uint8_t> head;
  wf::encodeFrameHead(m, &head);
  wf::FrameLayout inlined;
  EXPECT_EQ(wf::decodeLayout(std::span<const uint8_t>(head).subspan(4),
                             Limits(), &inlined)
                .code(),
            Code::kDataLoss);
  std::vector<wf::OutOfBand> oob = {{}, {true, "opaque record"}};
  head.clear();
  wf::encodeFrameHead(m, &head, &oob);
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
  ASSERT_EQ(lay.outOfBand.size(), 2u);
  EXPECT_FALSE(lay.outOfBand[0].present);
  EXPECT_TRUE(lay.outOfBand[1].present);
  EXPECT_EQ(lay.outOfBand[1].record, "opaque record");
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

// ---- one channel per device type ------------------------------------------

// A stand-in for cuda_ipc: carries tensors labelled cuda:N (host memory of
// this process) out of band, copying on a thread of its own, so that the
// per-device-type negotiation and routing run without a GPU.
class FakeCudaChannel : public Channel {
 public:
  ~FakeCudaChannel() override {
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(mu_);
      threads.swap(threads_);
    }
    for (auto& t : threads) {
      if (t.get_id() == std::this_thread::get_id()) {
        t.detach();
      } else {
        t.join();
      }
    }
  }
  std::string name() const override { return "fakecuda"; }
  Error viable() const override { return Error(); }
  bool sameHostOnly() const override { return true; }
  bool supportsDevice(const Device& d) const override {
    return d.type == DeviceType::kCuda;
  }
  bool inlineThroughConnection() const override { return false; }
  bool drivesOutOfBand() const override { return true; }
  bool sendsOutOfBand(const Message::Tensor& t) const override {
    return t.device.type == DeviceType::kCuda && t.length > 0;
  }
  Error describeOutOfBand(const Message::Tensor& t,
                          std::string* record) const override {
    const auto address = reinterpret_cast<uintptr_t>(t.data);
    const uint64_t length = t.length;
    record->assign(reinterpret_cast<const char*>(&address), sizeof(address));
    record->append(reinterpret_cast<const char*>(&length), sizeof(length));
    return Error();
  }
  void readOutOfBand(const std::string& record, const Allocation::Buffer& dst,
                     const Device& device, const std::string& /*who*/,
                     OutOfBandCallback done) const override {
    uintptr_t address = 0;
    uint64_t length = 0;
    if (record.size() != sizeof(address) + sizeof(length) ||
        device.type != DeviceType::kCuda) {
      done(Error::protocol("fakecuda: bad record"));
      return;
    }
    std::memcpy(&address, record.data(), sizeof(address));
    std::memcpy(&length, record.data() + sizeof(address), sizeof(length));
    if (length != dst.length) {
      done(Error::protocol("fakecuda: length differs"));
      return;
    }
    reads_.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu_);
    threads_.emplace_back([address, dst, done = std::move(done)] {
      std::memcpy(dst.data, reinterpret_cast<const void*>(address), dst.length);
      done(Error());
    });
  }
  int reads() const { return reads_.load(); }

 private:
  mutable std::mutex mu_;
  mutable std::vector<std::thread> threads_;
  mutable std::atomic<int> reads_{0};
};

ContextOptions uvOnly(std::string name) {
  ContextOptions o;
  o.name = std::move(name);
  o.tokenFromEnvironment = false;
  o.transports = {"uv"};
  return o;
}

TEST(NegotiationTest, OneChannelPerDeviceType) {
  std::vector<Offer> transports = {{"uv", false, true}};
  // name, same host only, drivable, cpu, cuda, out of band
  std::vector<Offer> channels = {{"gpu", true, true, false, true, true},
                                 {"cma", true, true, true, false, true},
                                 {"basic", false, true, true, false, false}};
  wf::Hello remote;
  remote.transports = {"uv"};
  remote.channels = {"basic", "cma", "gpu"};
  Negotiated n;
  ASSERT_TRUE(negotiate(transports, channels, remote, true, "uv", &n).ok());
  EXPECT_EQ(n.channel, "cma");
  EXPECT_EQ(n.cudaChannel, "gpu");
  // Another host: neither same-host channel.
  ASSERT_TRUE(negotiate(transports, channels, remote, false, "uv", &n).ok());
  EXPECT_EQ(n.channel, "basic");
  EXPECT_EQ(n.cudaChannel, "");
  // The peer lacks it: no CUDA channel, the CPU one as before.
  remote.channels = {"basic", "cma"};
  ASSERT_TRUE(negotiate(transports, channels, remote, true, "uv", &n).ok());
  EXPECT_EQ(n.channel, "cma");
  EXPECT_EQ(n.cudaChannel, "");
  // A CUDA-only channel never serves CPU tensors.
  remote.channels = {"gpu"};
  EXPECT_EQ(negotiate(transports, channels, remote, true, "uv", &n).code(),
            Code::kFailedPrecondition);
}

TEST(PerDeviceChannels, CudaTensorsGoByTheCudaChannelCpuOnesByTheCpuOne) {
  auto serverGpu = std::make_shared<FakeCudaChannel>();
  auto clientGpu = std::make_shared<FakeCudaChannel>();
  auto server = Context::create(uvOnly("server"));
  auto client = Context::create(uvOnly("client"));
  // Above cuda_ipc (200), which a CUDA build offers where a GPU is visible.
  server->registerChannel(250, serverGpu);
  client->registerChannel(250, clientGpu);
  auto l = server->listen({"uv://127.0.0.1:0"});
  auto c = client->connect(l->address("uv"));
  auto s = acceptOne(*l);
  auto m = patterned("mixed", {100}, {300000, 5000, 70000}, 4);
  Message view = m.view();
  view.tensors[1].device = Device::cuda(1);
  auto w = writeAsync(*c, view);
  auto r = readAsync(s).wait(kWait);
  w.wait(kWait);
  EXPECT_EQ(c->channelName(), "cma");
  EXPECT_EQ(s->channelName(DeviceType::kCpu), "cma");
  EXPECT_EQ(c->channelName(DeviceType::kCuda), "fakecuda");
  EXPECT_EQ(s->channelName(DeviceType::kCuda), "fakecuda");
  EXPECT_EQ(r.payloads.at(0), m.payloads.at(0));
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(r.tensors.at(i), m.tensors.at(i)) << "tensor " << i;
  }
  EXPECT_EQ(serverGpu->reads(), 1);
  EXPECT_EQ(clientGpu->reads(), 0);
  // And back the other way.
  auto w2 = writeAsync(*s, view);
  auto r2 = readAsync(c).wait(kWait);
  w2.wait(kWait);
  EXPECT_EQ(r2.tensors.at(1), m.tensors.at(1));
  EXPECT_EQ(clientGpu->reads(), 1);
}

TEST(PerDeviceChannels, WithoutACudaChannelCudaWritesFailAndNothingElse) {
  auto server = Context::create(uvOnly("server"));
  // No cuda_ipc either, which a CUDA build offers where a GPU is visible.
  ContextOptions cpuOnly = uvOnly("client");
  cpuOnly.channels = {"basic", "cma"};
  auto client = Context::create(cpuOnly);
  server->registerChannel(50, std::make_shared<FakeCudaChannel>());
  auto l = server->listen({"uv://127.0.0.1:0"});
  auto c = client->connect(l->address("uv"));
  auto s = acceptOne(*l);
  // Queued before the handshake is done and failed once it is.
  auto m = patterned("gpu", {}, {64}, 5);
  Message view = m.view();
  view.tensors[0].device = Device::cuda(3);
  auto w = writeAsync(*c, view);
  EXPECT_THROW(w.wait(kWait), InvalidArgumentError);
  EXPECT_NE(w.error().message().find("cuda:3"), std::string::npos)
      << w.error().what();
  EXPECT_EQ(c->channelName(DeviceType::kCuda), "");
  EXPECT_EQ(s->channelName(DeviceType::kCuda), "");
  EXPECT_EQ(c->channelName(), "cma");
  // Same, once established; the pipe goes on in both directions.
  auto w2 = writeAsync(*s, view);
  EXPECT_THROW(w2.wait(kWait), InvalidArgumentError);
  auto cpu = patterned("cpu", {7}, {300000}, 6);
  auto w3 = writeAsync(*c, cpu.view());
  auto r = readAsync(s).wait(kWait);
  w3.wait(kWait);
  EXPECT_EQ(r.descriptor, "cpu");
  EXPECT_EQ(r.tensors.at(0), cpu.tensors.at(0));
}

// ---- expected work: brief polling, never idle polling -----------------------

TEST(ExpectedWorkTest, PollingLoopsLoseNothingAndStopPollingWhenIdle) {
  auto server = Context::create(uvOnly("server"));
  auto client = Context::create(uvOnly("client"));
  auto l = server->listen({"uv://127.0.0.1:0"});
  auto c = client->connect(l->address("uv"));
  auto s = acceptOne(*l);
  // Both loops expect work, as an RPC callee's does while a request runs:
  // writes from this thread then reach them while they poll, without the
  // async wake-up. Every message must still arrive, in order.
  server->beginExpectedWork();
  client->beginExpectedWork();
  for (int i = 0; i < 2000; ++i) {
    const size_t size = i % 7 == 0 ? 70000 : 8;
    auto m = patterned("m" + std::to_string(i), {size}, {},
                       static_cast<uint32_t>(i));
    auto w = writeAsync(*c, m.view());
    auto r = readAsync(s).wait(kWait);
    w.wait(kWait);
    ASSERT_EQ(r.descriptor, m.descriptor);
    ASSERT_EQ(r.payloads, m.payloads);
    writeAsync(*s, m.view()).wait(kWait);
    ASSERT_EQ(readAsync(c).wait(kWait).descriptor, m.descriptor);
  }
  // Still expecting, but nothing comes: the loops poll for the budget
  // (50 µs by default) after their last work and then sleep.
  auto r1 = readAsync(s);
  auto r2 = readAsync(c);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const double before = processCpuSeconds();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const double used = processCpuSeconds() - before;
  EXPECT_LT(used, 0.1) << "CPU seconds used over 1 s by loops with nothing "
                          "to do";
  // Sleeping loops still wake for work.
  writeAsync(*c, patterned("wake", {}, {}, 0).view()).wait(kWait);
  EXPECT_EQ(r1.wait(kWait).descriptor, "wake");
  server->endExpectedWork();
  client->endExpectedWork();
  writeAsync(*s, patterned("wake2", {}, {}, 0).view()).wait(kWait);
  EXPECT_EQ(r2.wait(kWait).descriptor, "wake2");
}

}  // namespace
}  // namespace trellis::transport::testing
