// The shm transport beyond the shared contract (contract_test.cc runs that
// for shm too): the ring itself, rings much smaller than the messages, a
// hostile peer in the shared memory and in the setup, a peer process
// killed mid-message, viability failure, and no CPU burned while idle.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <functional>
#include <memory>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "peer_process.h"
#include "transport_test_util.h"
#include <trellis/transport/channel.h>
#include <trellis/transport/connection.h>
#include <trellis/transport/loop.h>
#include <trellis/transport/shm/factory.h>
#include <trellis/transport/shm/ring.h>
#include <trellis/transport/transport.h>

extern char** environ;

namespace trellis::transport::testing {
namespace {

using shm::RingControl;
using shm::RingReader;
using shm::RingWriter;

const Backend kShm{"shm", "shm", "shm://", {"basic"}, "basic", std::nullopt};

// ---- the ring alone ------------------------------------------------------

struct LocalRing {
  explicit LocalRing(size_t capacity) : data(capacity) {
    std::memset(&control, 0, sizeof(control));
  }
  RingControl control;
  std::vector<char> data;
};

TEST(ShmRing, WrapAroundKeepsBytesInOrder) {
  constexpr size_t kCap = 4096;
  LocalRing ring(kCap);
  RingWriter w(&ring.control, ring.data.data(), kCap);
  RingReader r(&ring.control, ring.data.data(), kCap);
  std::vector<uint8_t> src(3 * kCap);
  fillPattern(src.data(), src.size(), 7);
  std::vector<uint8_t> out;
  size_t written = 0;
  size_t step = 1;
  // Odd chunk sizes walk the head and tail across the end many times.
  while (out.size() < 50 * kCap) {
    size_t free = 0;
    ASSERT_TRUE(w.space(&free).ok());
    const size_t off = written % src.size();
    const size_t n = std::min({step, free, src.size() - off});
    written += w.write(src.data() + off, n);
    size_t avail = 0;
    ASSERT_TRUE(r.available(&avail).ok());
    ASSERT_LE(avail, kCap);
    std::vector<uint8_t> buf(std::min(avail, step * 2 / 3 + 1));
    const size_t got = r.read(buf.data(), buf.size());
    out.insert(out.end(), buf.begin(), buf.begin() + got);
    step = step * 7 % 5003 + 1;
  }
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(out[i], src[i % src.size()]) << "byte " << i;
  }
  EXPECT_GT(w.head(), 10 * kCap);  // wrapped many times
}

TEST(ShmRing, FullRingStopsTheWriter) {
  LocalRing ring(4096);
  RingWriter w(&ring.control, ring.data.data(), 4096);
  size_t free = 0;
  ASSERT_TRUE(w.space(&free).ok());
  std::vector<char> big(10000, 'x');
  EXPECT_EQ(w.write(big.data(), big.size()), 4096u);
  ASSERT_TRUE(w.space(&free).ok());
  EXPECT_EQ(free, 0u);
  EXPECT_EQ(w.write(big.data(), 1), 0u);
}

// Copies larger than the publishing chunk (128 KiB) and than the ring
// itself, with the two ends on two threads as in two processes: the chunked
// publishing of head and tail must keep every byte in order across wraps.
TEST(ShmRing, ConcurrentEndsStreamCopiesLargerThanTheRing) {
  constexpr size_t kCap = size_t{1} << 20;
  constexpr size_t kTotal = size_t{40} << 20;
  LocalRing ring(kCap);
  RingWriter w(&ring.control, ring.data.data(), kCap);
  RingReader r(&ring.control, ring.data.data(), kCap);
  std::vector<uint8_t> src(kTotal);
  fillPattern(src.data(), src.size(), 11);
  std::vector<uint8_t> dst(kTotal);
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  // Either end stops at the other's failure, so the test fails with both
  // threads joined instead of waiting out the deadline.
  std::atomic<bool> writerFailed{false};
  std::atomic<bool> readerFailed{false};
  std::thread writer([&] {
    size_t done = 0;
    size_t step = 3 * kCap + 12345;  // more than the ring, odd offsets
    while (done < kTotal && !readerFailed &&
           std::chrono::steady_clock::now() < deadline) {
      size_t free = 0;
      if (!w.space(&free).ok()) {
        writerFailed = true;
        return;
      }
      done += w.write(src.data() + done, std::min(step, kTotal - done));
      step = step % (5 * kCap) + 777777;
      if (free == 0) {
        std::this_thread::yield();
      }
    }
  });
  size_t got = 0;
  size_t step = 200001;
  while (got < kTotal && !writerFailed &&
         std::chrono::steady_clock::now() < deadline) {
    size_t avail = 0;
    if (!r.available(&avail).ok() || avail > kCap) {
      readerFailed = true;
      break;
    }
    if (avail == 0) {
      std::this_thread::yield();
      continue;
    }
    got += r.read(dst.data() + got, std::min(step, kTotal - got));
    step = step % (3 * kCap) + 654321;
  }
  writer.join();
  ASSERT_FALSE(writerFailed) << "the writer saw a tail outside its range";
  ASSERT_FALSE(readerFailed) << "the reader saw a head outside its range";
  ASSERT_EQ(got, kTotal) << "timed out";
  EXPECT_EQ(w.head(), kTotal);
  EXPECT_EQ(r.tail(), kTotal);
  EXPECT_TRUE(std::equal(src.begin(), src.end(), dst.begin()));
}

TEST(ShmRing, CorruptIndicesAreProtocolErrors) {
  constexpr size_t kCap = 4096;
  {
    LocalRing ring(kCap);
    RingReader r(&ring.control, ring.data.data(), kCap);
    size_t n = 0;
    ring.control.head = kCap + 1;  // more than a ring's worth ahead
    Error e = r.available(&n);
    EXPECT_THROW(throwIfError(e), ProtocolError);
    EXPECT_EQ(n, 0u);
    ring.control.head = ~uint64_t{0};  // "behind" the tail
    EXPECT_THROW(throwIfError(r.available(&n)), ProtocolError);
    ring.control.head = 100;
    ASSERT_TRUE(r.available(&n).ok());
    ring.control.head = 50;  // moved backwards
    EXPECT_THROW(throwIfError(r.available(&n)), ProtocolError);
  }
  {
    LocalRing ring(kCap);
    RingWriter w(&ring.control, ring.data.data(), kCap);
    size_t free = 0;
    ASSERT_TRUE(w.space(&free).ok());
    std::vector<char> bytes(1000);
    w.write(bytes.data(), bytes.size());
    ring.control.tail = 1001;  // beyond what was written
    EXPECT_THROW(throwIfError(w.space(&free)), ProtocolError);
    ring.control.tail = 600;
    ASSERT_TRUE(w.space(&free).ok());
    EXPECT_EQ(free, kCap - 400);
    ring.control.tail = 500;  // moved backwards
    EXPECT_THROW(throwIfError(w.space(&free)), ProtocolError);
  }
}

// ---- through pipes ---------------------------------------------------------

// With spin 0 every wait for data or for space goes through the eventfds,
// which exercises the sleep / wake-up handshake on each message.
class ShmSmallRing : public ::testing::TestWithParam<int> {};

TEST_P(ShmSmallRing, MessagesLargerThanTheRingWrapAround) {
  auto pp = shmPair(shm::kMinRingBytes, std::chrono::microseconds(GetParam()));
  const std::vector<size_t> sizes = {1,    4095, 4096,    4097,
                                     9999, 0,    1 << 20, (1 << 20) + 3};
  for (int round = 0; round < 3; ++round) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      const uint32_t seed = static_cast<uint32_t>(round * 100 + i);
      auto m = patterned("m" + std::to_string(i), {sizes[i], 3}, {sizes[i] / 2},
                         seed);
      // Both directions at once: each side's writes wait on the other's
      // reads, through a 4 KiB ring.
      auto w1 = writeAsync(*pp.clientPipe, m.view());
      auto w2 = writeAsync(*pp.serverPipe, m.view());
      auto r1 = readAsync(pp.serverPipe).wait(kWait);
      auto r2 = readAsync(pp.clientPipe).wait(kWait);
      w1.wait(kWait);
      w2.wait(kWait);
      for (const auto* r : {&r1, &r2}) {
        ASSERT_EQ(r->descriptor, m.descriptor);
        ASSERT_EQ(r->payloads, m.payloads) << "size " << sizes[i];
        ASSERT_EQ(r->tensors, m.tensors) << "size " << sizes[i];
      }
    }
  }
  EXPECT_EQ(pp.clientPipe->transportName(), "shm");
}

INSTANTIATE_TEST_SUITE_P(Spin, ShmSmallRing, ::testing::Values(0, 100),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "spin" + std::to_string(i.param) + "us";
                         });

TEST(ShmTransport, AddressesAreCheckedAndReported) {
  auto ctx = Context::create(optionsFor(kShm, "addr"));
  EXPECT_THROW(ctx->listen({"shm://bad name"}), InvalidArgumentError);
  EXPECT_THROW(ctx->listen({"shm://" + std::string(101, 'a')}),
               InvalidArgumentError);
  const std::string name =
      "shm://trellis-test-" + std::to_string(::getpid()) + "-explicit";
  auto l = ctx->listen({name});
  EXPECT_EQ(l->address("shm"), name);
  EXPECT_THROW(ctx->listen({name}), AlreadyExistsError);
  auto auto1 = ctx->listen({"shm://"});
  auto auto2 = ctx->listen({"shm://"});
  EXPECT_NE(auto1->address("shm"), auto2->address("shm"));
  EXPECT_EQ(auto1->address("shm").rfind("shm://trellis-shm-", 0), 0u);
  auto p = ctx->connect("shm://");
  EXPECT_THROW(writeAsync(*p, Message()).wait(kWait), InvalidArgumentError);
}

TEST(ShmTransport, BadOptionsMakeItNotViable) {
  shm::Options o;
  o.ringBytes = 5000;  // not a power of two
  Error e = shm::create(o)->viable();
  EXPECT_EQ(e.code(), Code::kInvalidArgument);
  EXPECT_NE(e.message().find("ringBytes"), std::string::npos);
  EXPECT_TRUE(shm::create()->viable().ok());
}

// The rings' polling follows TRELLIS_SPIN_US unless Options::spin is set,
// so TRELLIS_SPIN_US=0 turns off every poll in the process, these included.
// Each case runs in a freshly executed child ("threadsafe" death tests): the
// budget is read once per process, and a forked child would inherit the
// value read by earlier tests' contexts.
TEST(ShmTransport, PollingFollowsTheProcessSpinBudgetUnlessSet) {
  using std::chrono::microseconds;
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  struct Case {
    const char* env;  // nullptr: unset
    int64_t wantUnsetUs;
  };
  for (const Case& c :
       {Case{nullptr, 100}, Case{"0", 0}, Case{"30", 60}, Case{"bogus", 100}}) {
    EXPECT_EXIT(
        {
          if (c.env == nullptr) {
            ::unsetenv("TRELLIS_SPIN_US");
          } else {
            ::setenv("TRELLIS_SPIN_US", c.env, 1);
          }
          shm::Options unset;
          shm::Options set;
          set.spin = microseconds(7);
          shm::Options negative;
          negative.spin = microseconds(-5);
          const bool ok =
              shm::pollingTime(unset) == microseconds(c.wantUnsetUs) &&
              shm::pollingTime(set) == microseconds(7) &&
              shm::pollingTime(negative) == microseconds(0);
          std::_Exit(ok ? 0 : 1);
        },
        ::testing::ExitedWithCode(0), "")
        << "TRELLIS_SPIN_US=" << (c.env == nullptr ? "(unset)" : c.env);
  }
}

// ---- a hostile peer speaking the setup by hand -----------------------------

int connectRaw(const std::string& address) {
  const std::string name = address.substr(6);  // after shm://
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path + 1, name.data(), name.size());
  const auto len =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), len) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool sendSetup(int sock, uint32_t magic, uint64_t ringBytes,
               const std::vector<int>& fds) {
  uint8_t msg[24] = {0};
  const uint32_t version = 1;
  std::memcpy(msg, &magic, 4);
  std::memcpy(msg + 4, &version, 4);
  std::memcpy(msg + 8, &ringBytes, 8);
  iovec iov{msg, sizeof(msg)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {0};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  if (!fds.empty()) {
    mh.msg_control = control;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  return ::sendmsg(sock, &mh, MSG_NOSIGNAL) ==
         static_cast<ssize_t>(sizeof(msg));
}

// Reads the 8-byte reply and its eventfd within a bound; -1 if the peer
// closed or nothing came.
int recvReply(int sock) {
  pollfd p{sock, POLLIN, 0};
  if (::poll(&p, 1, 10000) != 1) {
    return -1;
  }
  uint8_t buf[8];
  iovec iov{buf, sizeof(buf)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof(control);
  if (::recvmsg(sock, &mh, MSG_CMSG_CLOEXEC) != 8) {
    return -1;
  }
  cmsghdr* c = CMSG_FIRSTHDR(&mh);
  if (c == nullptr || c->cmsg_type != SCM_RIGHTS) {
    return -1;
  }
  int fd;
  std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  return fd;
}

bool closedByPeer(int sock, int timeoutMs) {
  pollfd p{sock, POLLIN, 0};
  if (::poll(&p, 1, timeoutMs) != 1) {
    return false;
  }
  char b;
  return ::recv(sock, &b, 1, MSG_DONTWAIT) <= 0;
}

struct RawSegment {
  explicit RawSegment(size_t ring, bool seal = true, size_t extra = 0)
      : ringBytes(ring), bytes(shm::segmentBytes(ring) + extra) {
    memfd = ::memfd_create("hostile", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    EXPECT_EQ(::ftruncate(memfd, static_cast<off_t>(bytes)), 0);
    if (seal) {
      EXPECT_EQ(::fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    }
    map = static_cast<char*>(
        ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0));
    shm::SegmentHeader h{shm::kSegmentMagic, shm::kSegmentVersion, ring};
    std::memcpy(map, &h, sizeof(h));
    efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  }
  ~RawSegment() {
    ::munmap(map, bytes);
    ::close(memfd);
    ::close(efd);
  }
  RingControl* control(int ring) {
    return reinterpret_cast<RingControl*>(map + shm::kRingControlOffset[ring]);
  }
  size_t ringBytes;
  size_t bytes;
  int memfd;
  int efd;
  char* map;
};

TEST(ShmTransport, GarbageRingIndicesFailOnlyThatConnection) {
  auto server = Context::create(optionsFor(kShm, "server"));
  auto client = Context::create(optionsFor(kShm, "client"));
  auto listener = server->listen({kShm.listenAddr});
  const std::string addr = listener->address("shm");
  // A well-behaved pipe first, to show it is not affected.
  auto good = client->connect(addr);
  auto goodServer = acceptOne(*listener);
  writeAsync(*good, patterned("before", {10}, {}, 1).view()).wait(kWait);
  EXPECT_EQ(readAsync(goodServer).wait(kWait).descriptor, "before");

  RawSegment seg(size_t{64} << 10);
  const int sock = connectRaw(addr);
  ASSERT_GE(sock, 0);
  ASSERT_TRUE(sendSetup(sock, 0x50555453, seg.ringBytes, {seg.memfd, seg.efd}));
  const int acceptorEfd = recvReply(sock);
  ASSERT_GE(acceptorEfd, 0);
  auto victim = acceptOne(*listener);
  auto pending = readAsync(victim);
  // Claim a terabyte of data in a 64 KiB ring, and ring the doorbell.
  std::atomic_ref<uint64_t>(seg.control(0)->head)
      .store(uint64_t{1} << 40, std::memory_order_release);
  const uint64_t one = 1;
  ASSERT_EQ(::write(acceptorEfd, &one, sizeof(one)), 8);
  EXPECT_THROW(pending.wait(kWait), ProtocolError);
  EXPECT_TRUE(closedByPeer(sock, 10000));  // that connection is closed
  ::close(acceptorEfd);
  ::close(sock);

  // The good pipe and the listener carry on.
  auto m = patterned("after", {100000}, {}, 2);
  writeAsync(*goodServer, m.view()).wait(kWait);
  EXPECT_EQ(readAsync(good).wait(kWait).payloads, m.payloads);
  auto again = client->connect(addr);
  auto againServer = acceptOne(*listener);
  writeAsync(*again, Message()).wait(kWait);
  readAsync(againServer).wait(kWait);
}

// A peer that corrupts the consumer index of the ring this end writes
// into: a write now (Connection::writeNow, any thread) is refused and
// writes nothing, and the loop's next write() fails the connection with
// the protocol error, as before writes now existed.
TEST(ShmTransport, GarbageTailRefusesWritesNowAndFailsTheConnection) {
  auto transport = shm::create();
  auto loop = Loop::create("garbage-tail");
  auto onLoop = [&](auto fn) {
    Promise<void> done;
    loop->defer([&fn, done]() mutable {
      fn();
      done.setValue();
    });
    done.getFuture().wait(kWait);
  };
  std::unique_ptr<ConnectionListener> listener;
  Promise<std::shared_ptr<Connection>> accepted;
  onLoop([&] {
    const Error e = transport->listen(
        *loop, "shm://",
        [accepted](const Error& err, std::shared_ptr<Connection> c) mutable {
          err.ok() ? accepted.setValue(std::move(c)) : accepted.setError(err);
        },
        &listener);
    ASSERT_TRUE(e.ok()) << e.what();
  });
  ASSERT_NE(listener, nullptr);
  RawSegment seg(size_t{64} << 10);
  const int sock = connectRaw(listener->address());
  ASSERT_GE(sock, 0);
  ASSERT_TRUE(sendSetup(sock, 0x50555453, seg.ringBytes, {seg.memfd, seg.efd}));
  const int acceptorEfd = recvReply(sock);
  ASSERT_GE(acceptorEfd, 0);
  auto conn = accepted.getFuture().wait(kWait);
  ASSERT_TRUE(conn->writesNow());
  // Ring 1 carries the acceptor's bytes to us (ring 0 the other way).
  std::atomic_ref<uint64_t> head(seg.control(1)->head);
  std::atomic_ref<uint64_t> tail(seg.control(1)->tail);
  std::vector<uint8_t> bytes(100, 0x3c);
  const IoBuf buf{bytes.data(), bytes.size()};
  // Written from this thread while the indices are sane (open once the
  // setup is done)...
  ASSERT_TRUE(eventually([&] { return conn->writeNow(&buf, 1); }));
  EXPECT_EQ(head.load(std::memory_order_acquire), bytes.size());
  // ...and refused, with nothing written, once the tail claims bytes that
  // were never written.
  tail.store(uint64_t{1} << 40, std::memory_order_release);
  EXPECT_FALSE(conn->writeNow(&buf, 1));
  EXPECT_EQ(head.load(std::memory_order_acquire), bytes.size());
  Promise<void> written;
  onLoop([&] {
    conn->write(&buf, 1, [written](const Error& e) mutable {
      e.ok() ? written.setValue() : written.setError(e);
    });
  });
  EXPECT_THROW(written.getFuture().wait(kWait), ProtocolError);
  // A failed connection stays failed, even with the tail put right again.
  tail.store(bytes.size(), std::memory_order_release);
  EXPECT_FALSE(conn->writeNow(&buf, 1));
  EXPECT_EQ(head.load(std::memory_order_acquire), bytes.size());
  onLoop([&] {
    conn->close();
    listener->close();
    listener.reset();
  });
  EXPECT_TRUE(closedByPeer(sock, 10000));
  ::close(acceptorEfd);
  ::close(sock);
  onLoop([&] { loop->stopFromLoop(); });
  EXPECT_TRUE(loop->join(Deadline::after(kWait)));
}

TEST(ShmTransport, HostileSetupsAreRefusedAndTheListenerKeepsServing) {
  auto server = Context::create(optionsFor(kShm, "server"));
  auto listener = server->listen({kShm.listenAddr});
  const std::string addr = listener->address("shm");
  constexpr uint32_t kMagic = 0x50555453;
  const size_t ring = size_t{64} << 10;
  struct Case {
    const char* what;
    std::function<bool(int sock)> send;
  };
  int pipeFds[2];
  ASSERT_EQ(::pipe2(pipeFds, O_CLOEXEC), 0);
  std::vector<Case> cases = {
      {"bad magic",
       [&](int s) {
         RawSegment seg(ring);
         return sendSetup(s, 0xdeadbeef, ring, {seg.memfd, seg.efd});
       }},
      {"ring size not a power of two",
       [&](int s) {
         RawSegment seg(ring);
         return sendSetup(s, kMagic, ring + 1, {seg.memfd, seg.efd});
       }},
      {"ring size beyond the limit",
       [&](int s) {
         RawSegment seg(ring);
         return sendSetup(s, kMagic, uint64_t{1} << 40, {seg.memfd, seg.efd});
       }},
      {"no descriptors", [&](int s) { return sendSetup(s, kMagic, ring, {}); }},
      {"unsealed segment",
       [&](int s) {
         RawSegment seg(ring, false);
         return sendSetup(s, kMagic, ring, {seg.memfd, seg.efd});
       }},
      {"segment of the wrong size",
       [&](int s) {
         RawSegment seg(ring, true, 4096);
         return sendSetup(s, kMagic, ring, {seg.memfd, seg.efd});
       }},
      {"wake-up descriptor not an eventfd",
       [&](int s) {
         RawSegment seg(ring);
         return sendSetup(s, kMagic, ring, {seg.memfd, pipeFds[1]});
       }},
      {"segment descriptor is a pipe",
       [&](int s) {
         RawSegment seg(ring);
         return sendSetup(s, kMagic, ring, {pipeFds[0], seg.efd});
       }},
      {"closed before the setup", [&](int) { return true; }},
  };
  for (auto& c : cases) {
    SCOPED_TRACE(c.what);
    const int sock = connectRaw(addr);
    ASSERT_GE(sock, 0);
    ASSERT_TRUE(c.send(sock));
    if (std::string(c.what) == "closed before the setup") {
      ::close(sock);
      continue;
    }
    EXPECT_TRUE(closedByPeer(sock, 10000));
    ::close(sock);
  }
  ::close(pipeFds[0]);
  ::close(pipeFds[1]);
  // None of them became a pipe: the next accept is a real client.
  auto client = Context::create(optionsFor(kShm, "client"));
  auto p = client->connect(addr);
  auto s = acceptOne(*listener);
  writeAsync(*p, patterned("real", {}, {}, 0).view()).wait(kWait);
  EXPECT_EQ(readAsync(s).wait(kWait).descriptor, "real");
}

TEST(ShmTransport, SilentPeerTimesOutInSetup) {
  shm::Options o;
  o.setupTimeout = std::chrono::milliseconds(200);
  auto server = Context::create(optionsFor(kShm, "server"));
  server->registerTransport(200, shm::create(o));
  auto listener = server->listen({kShm.listenAddr});
  const int sock = connectRaw(listener->address("shm"));
  ASSERT_GE(sock, 0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(closedByPeer(sock, 10000));  // says nothing: dropped
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(9));
  ::close(sock);
}

// ---- other processes
// ---------------------------------------------------------

std::unique_ptr<Child> spawnHelper(std::vector<std::string> args) {
  return testing::spawnHelper(SHM_PEER_HELPER, std::move(args));
}

TEST(ShmTransport, PeerKilledMidMessageFailsPendingOperationsPromptly) {
  auto server = Context::create(optionsFor(kShm, "server"));
  auto listener = server->listen({kShm.listenAddr});
  auto child = spawnHelper({"connect", listener->address("shm")});
  auto pipe = acceptOne(*listener);
  EXPECT_EQ(readAsync(pipe).wait(kWait).descriptor, "hello");
  EXPECT_EQ(child->readLine(30000), "ready shm");
  EXPECT_EQ(pipe->transportName(), "shm");  // two processes, one host
  EXPECT_NE(pipe->peerAddress().find("pid " + std::to_string(child->pid)),
            std::string::npos)
      << pipe->peerAddress();

  // The 64 MiB message starts; freeze the sender so it stays unfinished.
  Promise<Descriptor> dp;
  pipe->readDescriptor([dp](const Error& e, Descriptor d) mutable {
    e.ok() ? dp.setValue(std::move(d)) : dp.setError(e);
  });
  auto d = dp.getFuture().wait(kWait);
  ASSERT_EQ(d.payloadLengths.size(), 1u);
  ASSERT_EQ(::kill(child->pid, SIGSTOP), 0);
  std::vector<uint8_t> body(d.payloadLengths[0]);
  Promise<void> readDone;
  pipe->read(Allocation{{{body.data(), body.size()}}, {}},
             [readDone](const Error& e) mutable {
               e.ok() ? readDone.setValue() : readDone.setError(e);
             });
  // And a write the stopped peer will never drain.
  std::vector<uint8_t> out(size_t{32} << 20, 1);
  Message m;
  m.payloads.push_back({out.data(), out.size()});
  auto w = writeAsync(*pipe, m);
  auto readFuture = readDone.getFuture();
  EXPECT_FALSE(readFuture.waitFor(std::chrono::milliseconds(300)));
  EXPECT_FALSE(w.waitFor(std::chrono::milliseconds(1)));

  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(child->pid, SIGKILL), 0);
  EXPECT_THROW(readFuture.wait(std::chrono::seconds(10)), ConnectionError);
  EXPECT_THROW(w.wait(std::chrono::seconds(10)), ConnectionError);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_NE(readFuture.error().message().find("middle of a message"),
            std::string::npos)
      << readFuture.error().what();
  const int status = child->wait();
  EXPECT_TRUE(WIFSIGNALED(status));
  // The listener still serves.
  auto client = Context::create(optionsFor(kShm, "client"));
  auto p = client->connect(listener->address("shm"));
  auto s = acceptOne(*listener);
  writeAsync(*p, Message()).wait(kWait);
  readAsync(s).wait(kWait);
}

TEST(ShmTransport, NotViableIsReportedAndContextsFallBack) {
  auto child = spawnHelper({"probe"});
  const std::string line = child->readLine(60000);
  const int status = child->wait();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << line;
  EXPECT_NE(line.find("not viable"), std::string::npos) << line;
}

// ---- idle costs nothing ----------------------------------------------------

TEST(ShmTransport, IdleConnectionsBurnNoCpu) {
  auto pp =
      makePair(kShm, optionsFor(kShm, "server"), optionsFor(kShm, "client"));
  // Traffic first, so both loops have been spinning.
  for (int i = 0; i < 500; ++i) {
    auto m = patterned("ping", {8}, {}, static_cast<uint32_t>(i));
    writeAsync(*pp.clientPipe, m.view()).wait(kWait);
    readAsync(pp.serverPipe).wait(kWait);
    writeAsync(*pp.serverPipe, m.view()).wait(kWait);
    readAsync(pp.clientPipe).wait(kWait);
  }
  // Both pipes stay with a read pending, as a server's would.
  auto r1 = readAsync(pp.serverPipe);
  auto r2 = readAsync(pp.clientPipe);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const double before = processCpuSeconds();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const double used = processCpuSeconds() - before;
  EXPECT_LT(used, 0.1) << "CPU seconds used by an idle process over 1 s";
  // And they still wake up.
  writeAsync(*pp.clientPipe, patterned("wake", {}, {}, 0).view()).wait(kWait);
  EXPECT_EQ(r1.wait(kWait).descriptor, "wake");
  writeAsync(*pp.serverPipe, patterned("wake2", {}, {}, 0).view()).wait(kWait);
  EXPECT_EQ(r2.wait(kWait).descriptor, "wake2");
}

}  // namespace
}  // namespace trellis::transport::testing
