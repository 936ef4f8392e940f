// Hostile and failing peers on the uv transport, driven by a raw TCP socket
// (or a forked process) that writes the wire format byte by byte.

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <signal.h>
#include <string>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include "transport_test_util.h"
#include <trellis/transport/wire_format.h>

namespace trellis::transport::testing {
namespace {

namespace wf = wire_format;

class UvHostileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto o = optionsFor(backend_, "server");
    o.handshakeTimeout = std::chrono::seconds(20);
    server_ = Context::create(o);
    listener_ = server_->listen({backend_.listenAddr});
    address_ = listener_->address("uv");
  }
  void TearDown() override {
    for (int fd : fds_) {
      ::close(fd);
    }
  }
  int connectRaw() {
    const int fd = rawConnect(address_);
    EXPECT_GE(fd, 0);
    fds_.push_back(fd);
    return fd;
  }
  // A well-behaved library peer still gets through afterwards.
  void expectListenerStillServes() {
    auto client = Context::create(optionsFor(backend_, "good"));
    auto c = client->connect(address_);
    auto s = acceptOne(*listener_);
    auto m = patterned("still-serving", {100}, {}, 4);
    writeAsync(*c, m.view()).wait(kWait);
    auto r = readAsync(s).wait(kWait);
    EXPECT_EQ(r.descriptor, "still-serving");
    EXPECT_EQ(r.payloads[0], m.payloads[0]);
  }
  // Expects the accepted pipe to fail with `code`, and the raw peer to be
  // disconnected.
  void expectPipeFails(int fd, Code code) {
    auto pipe = acceptOne(*listener_);
    auto r = readAsync(pipe);
    ASSERT_TRUE(r.waitFor(std::chrono::seconds(10)));
    EXPECT_EQ(r.error().code(), code) << r.error().what();
    EXPECT_TRUE(rawPeerClosed(fd, std::chrono::seconds(5)));
  }

  Backend backend_{"uv",      "uv",    "uv://127.0.0.1:0",
                   {"basic"}, "basic", std::nullopt};
  std::shared_ptr<Context> server_;
  std::shared_ptr<Listener> listener_;
  std::string address_;
  std::vector<int> fds_;
};

TEST_F(UvHostileTest, GarbageBytesAreAProtocolError) {
  const int fd = connectRaw();
  std::vector<uint8_t> junk(64);
  fillPattern(junk.data(), junk.size(), 77);
  rawSend(fd, junk);
  expectPipeFails(fd, Code::kDataLoss);
  expectListenerStillServes();
}

TEST_F(UvHostileTest, WrongMagicIsAProtocolError) {
  const int fd = connectRaw();
  wf::Hello h;
  auto bytes = wf::encodeHello(wf::HandshakeType::kHello, h);
  bytes[0] = 'X';
  rawSend(fd, bytes);
  expectPipeFails(fd, Code::kDataLoss);
  expectListenerStillServes();
}

TEST_F(UvHostileTest, WrongVersionIsAProtocolErrorAndThePeerLearnsOurs) {
  const int fd = connectRaw();
  wf::Hello h;
  h.version = wf::kProtocolVersion + 1;
  rawSend(fd, wf::encodeHello(wf::HandshakeType::kHello, h));
  auto pipe = acceptOne(*listener_);
  auto r = readAsync(pipe);
  ASSERT_TRUE(r.waitFor(std::chrono::seconds(10)));
  EXPECT_EQ(r.error().code(), Code::kDataLoss);
  EXPECT_NE(r.error().message().find("version"), std::string::npos);
  std::vector<uint8_t> header, body;
  ASSERT_TRUE(rawRecv(fd, wf::kHandshakeHeaderBytes, &header));
  size_t len = 0;
  ASSERT_TRUE(
      wf::decodeHandshakeHeader(header, wf::HandshakeType::kHelloReply, &len)
          .ok());
  ASSERT_TRUE(rawRecv(fd, len, &body));
  wf::Hello reply;
  ASSERT_TRUE(
      wf::decodeHello(body, wf::HandshakeType::kHelloReply, &reply).ok());
  EXPECT_EQ(reply.version, wf::kProtocolVersion);
  expectListenerStillServes();
}

TEST_F(UvHostileTest, OversizedHandshakeBodyIsRejectedBeforeReading) {
  const int fd = connectRaw();
  std::vector<uint8_t> bytes(wf::kMagic.begin(), wf::kMagic.end());
  bytes.push_back(static_cast<uint8_t>(wf::HandshakeType::kHello));
  for (int i = 0; i < 4; ++i) {
    bytes.push_back(0xff);  // 4 GiB body
  }
  rawSend(fd, bytes);
  expectPipeFails(fd, Code::kDataLoss);
  expectListenerStillServes();
}

TEST_F(UvHostileTest, OversizedFrameLengthsAreProtocolErrors) {
  // Layout length beyond the limit.
  {
    const int fd = connectRaw();
    ASSERT_TRUE(rawHandshake(fd));
    rawSend(fd, {0xff, 0xff, 0xff, 0x7f});
    expectPipeFails(fd, Code::kDataLoss);
  }
  // A payload length beyond the limit (16 GiB by default), in the layout.
  {
    const int fd = connectRaw();
    ASSERT_TRUE(rawHandshake(fd));
    rawSend(fd, rawFrameHead(4, {size_t{1} << 40}));
    expectPipeFails(fd, Code::kDataLoss);
  }
  // A descriptor length beyond the limit.
  {
    const int fd = connectRaw();
    ASSERT_TRUE(rawHandshake(fd));
    // Layout: type 1, descriptor length 2^34 (5-byte varint), no payloads,
    // no tensors; preceded by its 4-byte length.
    const std::vector<uint8_t> bytes = {8,    0,    0,    0,    1, 0x80,
                                        0x80, 0x80, 0x80, 0x40, 0, 0};
    rawSend(fd, bytes);
    expectPipeFails(fd, Code::kDataLoss);
  }
  expectListenerStillServes();
}

TEST_F(UvHostileTest, HalfWrittenFrameThenCloseIsAConnectionError) {
  // Half a layout: readDescriptor fails.
  {
    const int fd = connectRaw();
    ASSERT_TRUE(rawHandshake(fd));
    auto head = rawFrameHead(10, {100});
    head.resize(head.size() / 2 + 1);
    rawSend(fd, head);
    auto pipe = acceptOne(*listener_);
    auto r = readAsync(pipe);
    // Deliberate delay, not a wait for a state: lets the half frame be
    // read before the end of the stream arrives (the case under test).
    // Shutting down sooner only takes the easier path to the same error.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ::shutdown(fd, SHUT_RDWR);
    ASSERT_TRUE(r.waitFor(std::chrono::seconds(5)));
    EXPECT_EQ(r.error().code(), Code::kUnavailable) << r.error().what();
  }
  // Descriptor complete, payload half written: the read fails.
  {
    const int fd = connectRaw();
    ASSERT_TRUE(rawHandshake(fd));
    auto head = rawFrameHead(3, {100000});
    head.insert(head.end(), {'a', 'b', 'c'});
    head.resize(head.size() + 50000, 7);
    rawSend(fd, head);
    auto pipe = acceptOne(*listener_);
    Promise<Descriptor> dp;
    pipe->readDescriptor([dp](const Error& e, Descriptor d) mutable {
      e.ok() ? dp.setValue(std::move(d)) : dp.setError(e);
    });
    auto d = dp.getFuture().wait(kWait);
    EXPECT_EQ(d.descriptor, "abc");
    std::vector<uint8_t> buf(100000);
    Promise<void> rp;
    pipe->read(Allocation{{{buf.data(), buf.size()}}, {}},
               [rp](const Error& e) mutable {
                 e.ok() ? rp.setValue() : rp.setError(e);
               });
    // Deliberate delay, as above: the payload read is under way when the
    // stream ends; sooner gives the same ConnectionError.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ::shutdown(fd, SHUT_RDWR);
    EXPECT_THROW(rp.getFuture().wait(std::chrono::seconds(5)), ConnectionError);
  }
  expectListenerStillServes();
}

TEST_F(UvHostileTest, SilentPeerTimesOutTheHandshake) {
  auto o = optionsFor(backend_, "impatient");
  o.handshakeTimeout = std::chrono::milliseconds(300);
  auto ctx = Context::create(o);
  auto l = ctx->listen({backend_.listenAddr});
  const int fd = rawConnect(l->address("uv"));
  fds_.push_back(fd);
  auto pipe = acceptOne(*l);
  auto r = readAsync(pipe);
  ASSERT_TRUE(r.waitFor(std::chrono::seconds(10)));
  EXPECT_EQ(r.error().code(), Code::kDeadlineExceeded) << r.error().what();
  EXPECT_TRUE(rawPeerClosed(fd, std::chrono::seconds(5)));
}

long rssKb() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) {
      return std::stol(line.substr(6));
    }
  }
  return -1;
}

size_t openFds() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e :
       std::filesystem::directory_iterator("/proc/self/fd")) {
    ++n;
  }
  return n;
}

// Issue 14: a hostile-client probe against a job's RPC listener (garbage,
// slowloris, 1000 idle connections) grew its RSS by 39 MB: every pipe
// still in its handshake held a 32 KiB read stage, and glibc kept the
// memory after the connections closed. A peer that has not proved itself
// now costs a 512-byte stage.
TEST_F(UvHostileTest, ThousandIdleConnectionsCostLittleMemory) {
  constexpr int kIdle = 1000;
  rlimit lim{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &lim), 0);
  if (lim.rlim_cur < 3 * kIdle) {
    lim.rlim_cur = std::min<rlim_t>(lim.rlim_max, 3 * kIdle);
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }
  if (lim.rlim_cur < 3 * kIdle) {
    GTEST_SKIP() << "needs " << 3 * kIdle << " descriptors, may open "
                 << lim.rlim_cur;
  }
  const size_t fdsBefore = openFds();
  const long before = rssKb();
  for (int i = 0; i < kIdle; ++i) {
    connectRaw();
  }
  // Every connection accepted by the listener (its end is a descriptor of
  // this process too): bounded wait.
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (openFds() < fdsBefore + 2 * kIdle &&
         std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_GE(openFds(), fdsBefore + 2 * kIdle);
  const long grew = rssKb() - before;
  std::printf("%d idle connections: RSS +%ld KiB\n", kIdle, grew);
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  // With 32 KiB each this was over 32 MiB; sanitizers' shadow memory and
  // redzones make the figure meaningless there.
  EXPECT_LT(grew, 12 * 1024);
#endif
  for (int fd : fds_) {
    ::close(fd);
  }
  fds_.clear();
  // The listener handed out a pipe for each (failed now); then it still
  // serves a real peer.
  for (int i = 0; i < kIdle; ++i) {
    (void)acceptOne(*listener_);
  }
  expectListenerStillServes();
}

TEST_F(UvHostileTest, PeerProcessSigkilledMidMessage) {
  constexpr size_t kPayload = 64u << 20;
  constexpr size_t kSent = 4u << 20;
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Child: raw syscalls and the wire encoders only (no threads here).
    const int fd = rawConnect(address_);
    if (fd < 0 || !rawHandshake(fd)) {
      _exit(3);
    }
    auto bytes = rawFrameHead(4, {kPayload});
    bytes.insert(bytes.end(), {'k', 'i', 'l', 'l'});
    bytes.resize(bytes.size() + kSent, 0x5a);
    rawSend(fd, bytes);
    ::raise(SIGSTOP);
    _exit(4);
  }
  auto pipe = acceptOne(*listener_);
  Promise<Descriptor> dp;
  pipe->readDescriptor([dp](const Error& e, Descriptor d) mutable {
    e.ok() ? dp.setValue(std::move(d)) : dp.setError(e);
  });
  auto d = dp.getFuture().wait(kWait);
  ASSERT_EQ(d.payloadLengths.at(0), kPayload);
  std::vector<uint8_t> buf(kPayload);
  Promise<void> rp;
  pipe->read(Allocation{{{buf.data(), buf.size()}}, {}},
             [rp](const Error& e) mutable {
               e.ok() ? rp.setValue() : rp.setError(e);
             });
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, WUNTRACED), child);
  ASSERT_TRUE(WIFSTOPPED(status));
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(rp.getFuture().wait(std::chrono::seconds(5)), ConnectionError);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(buf[kSent - 1], 0x5a);  // what arrived landed in place
  expectListenerStillServes();
}

}  // namespace
}  // namespace trellis::transport::testing
