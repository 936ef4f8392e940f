// The cma channel (transport/cma/): negotiation, the out-of-band path in one
// process and between two, lying records from a hostile peer, and a writer
// killed before its tensor is read. The contract suite runs shm+cma and
// uv+cma as well (contract_test.cc).

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <functional>
#include <memory>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <string>
#include <sys/mman.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "peer_process.h"
#include "transport_test_util.h"
#include <trellis/core/wire.h>
#include <trellis/transport/channel.h>
#include <trellis/transport/cma/factory.h>
#include <trellis/transport/process_gone.h>
#include <trellis/transport/transport.h>
#include <trellis/transport/wire_format.h>

namespace trellis::transport::testing {
namespace {

namespace wf = wire_format;

// cma takes no tensor by default (docs/transport.md, "cma or the ring?"):
// these tests make it take those of 256 KiB and more.
const Backend kShmCma{"shm_cma",        "shm", "shm://",
                      {"cma", "basic"}, "cma", size_t{256} << 10};

ContextOptions defaults(std::string name) {
  ContextOptions o;
  o.name = std::move(name);
  o.tokenFromEnvironment = false;
  return o;
}

// A pipe's read of one message into fresh buffers, with its own error.
struct ReadResult {
  Descriptor descriptor;
  std::vector<std::vector<uint8_t>> tensors;
  Error error;
};

ReadResult readAll(const std::shared_ptr<Pipe>& pipe) {
  Promise<Descriptor> dp;
  pipe->readDescriptor([dp](const Error& e, Descriptor d) mutable {
    e.ok() ? dp.setValue(std::move(d)) : dp.setError(e);
  });
  ReadResult r;
  auto df = dp.getFuture();
  if (!df.waitFor(kWait)) {
    r.error = Error::timeout("no descriptor");
    return r;
  }
  if (!df.error().ok()) {
    r.error = df.error();
    return r;
  }
  r.descriptor = df.wait(kWait);
  Allocation a;
  std::vector<std::vector<uint8_t>> payloads;
  for (size_t n : r.descriptor.payloadLengths) {
    payloads.emplace_back(n);
    a.payloads.push_back({payloads.back().data(), n});
  }
  r.tensors.reserve(r.descriptor.tensors.size());
  for (const auto& t : r.descriptor.tensors) {
    r.tensors.emplace_back(t.length);
    a.tensors.push_back({r.tensors.back().data(), t.length});
  }
  Promise<void> rp;
  pipe->read(std::move(a), [rp](const Error& e) mutable {
    e.ok() ? rp.setValue() : rp.setError(e);
  });
  auto rf = rp.getFuture();
  r.error = rf.waitFor(kWait) ? rf.error() : Error::timeout("no read");
  return r;
}

// A cma record as the writer's channel builds it (docs/transport.md).
std::string cmaRecord(uint64_t pid, uintptr_t address, size_t length) {
  wire::WireWriter w;
  w.putFixed64(pid);
  w.putFixed64(address);
  w.putVarint(length);
  return std::string(w.bytes().begin(), w.bytes().end());
}

// readOutOfBand made synchronous, with a bound.
Error readRecord(const Channel& ch, const std::string& record, void* dst,
                 size_t length, const std::string& who) {
  Promise<void> p;
  ch.readOutOfBand(
      record, Allocation::Buffer{dst, length}, Device{}, who,
      [p](const Error& e) mutable { e.ok() ? p.setValue() : p.setError(e); });
  auto f = p.getFuture();
  return f.waitFor(kWait) ? f.error() : Error::timeout("no copy callback");
}

// ---- the channel itself
// ------------------------------------------------------

TEST(CmaChannel, ViableHereAndCopiesFromAProcess) {
  auto cma = cma::create();
  ASSERT_TRUE(cma->viable().ok()) << cma->viable().what();
  EXPECT_TRUE(cma->sameHostOnly());
  EXPECT_TRUE(cma->drivesOutOfBand());
  // Small, and large enough to be split across the copy threads.
  for (size_t size : {size_t{100000}, (size_t{9} << 20) + 123}) {
    std::vector<uint8_t> src(size);
    fillPattern(src.data(), src.size(), 3);
    std::vector<uint8_t> dst(src.size());
    std::string record;
    ASSERT_TRUE(
        cma->describeOutOfBand({src.data(), src.size(), Device{}}, &record)
            .ok());
    EXPECT_LE(record.size(), Channel::kMaxOutOfBandRecordBytes);
    const auto self = static_cast<uint64_t>(::getpid());
    const Descriptor::TensorInfo info{src.size(), Device{}};
    EXPECT_TRUE(cma->checkOutOfBandRecord(record, info, self).ok());
    EXPECT_EQ(cma->checkOutOfBandRecord(record, info, 1).code(),
              Code::kDataLoss);
    // A record must describe the tensor it stands for.
    EXPECT_EQ(
        cma->checkOutOfBandRecord(record, {src.size() + 1, Device{}}, self)
            .code(),
        Code::kDataLoss);
    EXPECT_EQ(
        cma->checkOutOfBandRecord(record, {src.size(), Device::cuda(0)}, self)
            .code(),
        Code::kDataLoss);
    EXPECT_EQ(cma->checkOutOfBandRecord("short", info, self).code(),
              Code::kDataLoss);
    ASSERT_TRUE(readRecord(*cma, record, dst.data(), dst.size(), "self").ok());
    EXPECT_EQ(src, dst);
  }
  // Unmapped memory: a clear error naming the pid and the peer.
  std::vector<uint8_t> dst(64);
  const Error e =
      readRecord(*cma, cmaRecord(static_cast<uint64_t>(::getpid()), 16, 64),
                 dst.data(), 64, "peer x");
  EXPECT_EQ(e.code(), Code::kDataLoss) << e.what();
  EXPECT_NE(e.message().find("pid " + std::to_string(::getpid())),
            std::string::npos)
      << e.what();
  EXPECT_NE(e.message().find("peer x"), std::string::npos) << e.what();
}

// The state letter of /proc/<pid>/stat ('R', 'S', 'Z', ...), 0 if unread.
char procState(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(f, line);
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() ? line[paren + 2]
                                                               : '\0';
}

// A process that ended took its memory with it: a copy from it fails as
// the peer's departure (UNAVAILABLE naming it), zombie or reaped, not as a
// lying record. (A live process without the memory: DATA_LOSS, above.)
TEST(CmaChannel, CopyFromAProcessThatIsGoneIsUnavailable) {
  auto cma = cma::create();
  ASSERT_TRUE(cma->viable().ok()) << cma->viable().what();
  // Copied on the calling thread, and split across the copy threads.
  std::vector<std::vector<uint8_t>> srcs;
  for (size_t size : {size_t{100000}, (size_t{9} << 20) + 123}) {
    srcs.emplace_back(size);
    fillPattern(srcs.back().data(), size, 5);
  }
  // The child has the same memory at the same addresses (copy on write).
  Child child;
  child.pid = ::fork();
  ASSERT_GE(child.pid, 0);
  if (child.pid == 0) {
    ::alarm(60);  // bounded even if this test dies first
    for (;;) {
      ::pause();  // async-signal-safe: waits for the SIGKILL
    }
  }
  const auto pid = static_cast<uint64_t>(child.pid);
  EXPECT_FALSE(processGone(pid));
  EXPECT_FALSE(processGone(static_cast<uint64_t>(::getpid())));
  auto copyEach = [&](const char* when) {
    for (const auto& src : srcs) {
      std::vector<uint8_t> dst(src.size());
      const Error e = readRecord(
          *cma,
          cmaRecord(pid, reinterpret_cast<uintptr_t>(src.data()), src.size()),
          dst.data(), dst.size(), "peer z");
      if (std::string(when) == "alive") {
        EXPECT_TRUE(e.ok()) << e.what();
        EXPECT_EQ(dst, src);
        continue;
      }
      EXPECT_EQ(e.code(), Code::kUnavailable) << when << ": " << e.what();
      EXPECT_NE(e.message().find("pid " + std::to_string(pid)),
                std::string::npos)
          << e.what();
      EXPECT_NE(e.message().find("peer z"), std::string::npos) << e.what();
      EXPECT_NE(e.message().find("is gone"), std::string::npos) << e.what();
    }
  };
  copyEach("alive");
  ASSERT_EQ(::kill(child.pid, SIGKILL), 0);
  // Not reaped yet: a zombie, which still answers kill(pid, 0). Waited for
  // by its state: processGone() is true from the start of its exit, while
  // its memory may still be there for a moment (a copy then succeeds,
  // harmlessly: nothing runs in that process any more).
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (procState(child.pid) != 'Z' &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(procState(child.pid), 'Z');
  ASSERT_TRUE(processGone(pid));
  EXPECT_EQ(::kill(child.pid, 0), 0);
  copyEach("zombie");
  const int status = child.wait();
  EXPECT_TRUE(WIFSIGNALED(status)) << status;
  EXPECT_TRUE(processGone(pid));
  copyEach("reaped");
}

TEST(CmaChannel, ThresholdDecidesWhatGoesOutOfBand) {
  auto cma = cma::create({1000});
  uint8_t b = 0;
  EXPECT_FALSE(cma->sendsOutOfBand({&b, 999, Device{}}));
  EXPECT_TRUE(cma->sendsOutOfBand({&b, 1000, Device{}}));
  EXPECT_FALSE(cma->sendsOutOfBand({&b, 5000, Device{DeviceType::kCuda, 0}}));
  auto all = cma::create({0});
  EXPECT_FALSE(all->sendsOutOfBand({nullptr, 0, Device{}}));
  EXPECT_TRUE(all->sendsOutOfBand({&b, 1, Device{}}));
  // The default: the ring carries every tensor.
  EXPECT_FALSE(cma::create()->sendsOutOfBand({&b, size_t{1} << 30, Device{}}));
}

// TRELLIS_CMA_THRESHOLD sets the built-in channel's threshold (here: a
// 64 KiB tensor then waits for the reader's copy); anything but a number
// of bytes is refused when the context is created.
TEST(CmaChannel, ThresholdFromTheEnvironment) {
  ::setenv("TRELLIS_CMA_THRESHOLD", "65536", 1);
  auto server = Context::create(defaults("server"));
  auto client = Context::create(defaults("client"));
  ::setenv("TRELLIS_CMA_THRESHOLD", "64KiB", 1);
  EXPECT_THROW(Context::create(defaults("bad")), InvalidArgumentError);
  ::unsetenv("TRELLIS_CMA_THRESHOLD");
  auto l = server->listen({"shm://"});
  auto clientPipe = client->connect(l->address("shm"));
  auto serverPipe = acceptOne(*l);
  auto big = patterned("big", {}, {size_t{64} << 10}, 3);
  auto w = writeAsync(*clientPipe, big.view());
  EXPECT_FALSE(w.waitFor(std::chrono::milliseconds(200)));
  auto r = readAll(serverPipe);
  ASSERT_TRUE(r.error.ok()) << r.error.what();
  EXPECT_EQ(r.tensors.at(0), big.tensors.at(0));
  w.wait(kWait);
  EXPECT_EQ(clientPipe->channelName(), "cma");
}

// ---- negotiation
// ---------------------------------------------------------------

TEST(CmaNegotiation, PreferredOnOneHostRestrictedByEnvironment) {
  {
    auto server = Context::create(defaults("server"));
    auto client = Context::create(defaults("client"));
    auto l = server->listen({"shm://"});
    auto c = client->connect(l->address("shm"));
    auto s = acceptOne(*l);
    writeAsync(*c, Message()).wait(kWait);
    readAsync(s).wait(kWait);
    EXPECT_EQ(c->channelName(), "cma");
    EXPECT_EQ(s->channelName(), "cma");
  }
  {
    ASSERT_EQ(::getenv("TRELLIS_CHANNELS"), nullptr);
    ::setenv("TRELLIS_CHANNELS", "basic", 1);
    auto client = Context::create(defaults("client"));
    ::unsetenv("TRELLIS_CHANNELS");
    auto server = Context::create(defaults("server"));
    auto l = server->listen({"shm://"});
    auto c = client->connect(l->address("shm"));
    auto s = acceptOne(*l);
    writeAsync(*c, Message()).wait(kWait);
    readAsync(s).wait(kWait);
    EXPECT_EQ(c->channelName(), "basic");
    EXPECT_EQ(s->channelName(), "basic");
  }
}

TEST(CmaNegotiation, OtherHostsGetBasic) {
  auto server = Context::create(defaults("server"));
  auto l = server->listen({"uv://127.0.0.1:0"});
  std::string chosen;
  const int fd = rawConnect(l->address("uv"));
  ASSERT_TRUE(rawHandshake(fd, {"cma", "basic"}, /*sameHost=*/false, &chosen));
  EXPECT_EQ(chosen, "basic");
  ::close(fd);
  const int fd2 = rawConnect(l->address("uv"));
  ASSERT_TRUE(rawHandshake(fd2, {"cma", "basic"}, /*sameHost=*/true, &chosen));
  EXPECT_EQ(chosen, "cma");
  ::close(fd2);
}

// ---- the out-of-band path in one process
// -------------------------------------

TEST(CmaPipe, LargeTensorsWaitForTheReaderSmallOnesDoNot) {
  auto pp = makePair(kShmCma, optionsFor(kShmCma, "server"),
                     optionsFor(kShmCma, "client"));
  // Below the threshold: inline, the write completes unread.
  auto small = patterned("small", {10}, {1000}, 1);
  writeAsync(*pp.clientPipe, small.view()).wait(kWait);
  // At the threshold and above: the callback waits for the reader's copy.
  auto big = patterned("big", {300000}, {1000, size_t{1} << 20, 256 << 10}, 2);
  auto w = writeAsync(*pp.clientPipe, big.view());
  EXPECT_FALSE(w.waitFor(std::chrono::milliseconds(200)));
  auto r1 = readAll(pp.serverPipe);
  ASSERT_TRUE(r1.error.ok()) << r1.error.what();
  EXPECT_EQ(r1.tensors.at(0), small.tensors.at(0));
  auto r2 = readAll(pp.serverPipe);
  ASSERT_TRUE(r2.error.ok()) << r2.error.what();
  EXPECT_EQ(r2.descriptor.descriptor, "big");
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(r2.tensors.at(i), big.tensors.at(i)) << "tensor " << i;
  }
  w.wait(kWait);
  EXPECT_EQ(pp.clientPipe->channelName(), "cma");
}

// A message of one tensor, `src`, which cma moves (descriptor "big").
Message bigMessage(std::vector<uint8_t>& src) {
  Message m;
  m.descriptor = "big";
  m.tensors.push_back({src.data(), src.size(), {}});
  return m;
}

// The next descriptor `pipe` reads; fails the test after kWait.
Descriptor nextDescriptor(Pipe& pipe) {
  Promise<Descriptor> dp;
  pipe.readDescriptor([dp](const Error& e, Descriptor d) mutable {
    e.ok() ? dp.setValue(std::move(d)) : dp.setError(e);
  });
  return dp.getFuture().wait(kWait);
}

// The reader closes its pipe while its cma copy of a large tensor runs. The
// writer learns of the close through the connection and may then reuse its
// buffer, so the reader must keep the connection until its copy is done:
// else the writer's reuse (here: overwriting the whole tensor at once in
// its write callback) lands in the middle of the copy. The read itself
// fails either way (the pipe was closed); what is checked is that the
// destination holds only the writer's original bytes.
TEST(CmaPipe, AReaderThatClosesMidCopyKeepsTheWritersBufferBorrowedUntilDone) {
  auto pp = makePair(kShmCma, optionsFor(kShmCma, "server"),
                     optionsFor(kShmCma, "client"));
  const size_t n = size_t{96} << 20;
  std::vector<uint8_t> src(n);
  fillPattern(src.data(), n, 7);
  const std::vector<uint8_t> original = src;
  std::vector<uint8_t> dst(n, 0);
  Message m = bigMessage(src);
  Promise<void> written;
  pp.clientPipe->write(std::move(m), [&src, written](const Error&) mutable {
    std::memset(src.data(), 0xEE, src.size());  // the writer reuses it
    written.setValue();
  });
  ASSERT_EQ(nextDescriptor(*pp.serverPipe).tensors.size(), 1u);
  Allocation a;
  a.tensors.push_back({dst.data(), n});
  Promise<void> rp;
  pp.serverPipe->read(std::move(a), [rp](const Error& e) mutable {
    e.ok() ? rp.setValue() : rp.setError(e);
  });
  pp.serverPipe->close();  // while the copy runs
  auto rf = rp.getFuture();
  ASSERT_TRUE(rf.waitFor(kWait));
  written.getFuture().wait(kWait);
  // Bytes the copy got before the close ended it are the writer's; none
  // may be the reused buffer's.
  size_t reused = 0;
  for (size_t i = 0; i < n; i += 512) {
    reused += dst[i] == 0xEE && original[i] != 0xEE ? 1 : 0;
  }
  EXPECT_EQ(reused, 0u) << "pages of the copy read the writer's reused buffer";
  EXPECT_EQ(pp.clientPipe->channelName(), "cma");
}

// A pipe closed while its own cma copy runs keeps its connection open for
// the copy; a message it was still sending through that connection (a
// payload too big for the socket, unread by the peer) is in the
// connection's hands until it closes, so the write's callback, which lets
// the caller free the payload, must not come before the copy has ended.
TEST(CmaPipe,
     AWriteOfAPipeClosedMidCopyIsCalledBackOnlyOnceItsConnectionClosed) {
  auto pp = makePair(kShmCma, optionsFor(kShmCma, "server"),
                     optionsFor(kShmCma, "client"));
  const size_t n = size_t{96} << 20;
  std::vector<uint8_t> src(n);
  fillPattern(src.data(), n, 3);
  std::vector<uint8_t> dst(n, 0);
  Message m = bigMessage(src);
  auto w = writeAsync(*pp.clientPipe, std::move(m));
  ASSERT_EQ(nextDescriptor(*pp.serverPipe).tensors.size(), 1u);
  // The server's own message, stuck in its connection: the client reads
  // nothing.
  std::vector<uint8_t> reply(size_t{32} << 20, 0x5A);
  Message back;
  back.descriptor = "reply";
  back.payloads.push_back({reply.data(), reply.size()});
  // The order in which the two callbacks came: 1 and 2.
  std::atomic<int> order{0};
  std::atomic<int> readAt{0};
  std::atomic<int> writeAt{0};
  Promise<void> both;
  auto oneDone = [&order, both](std::atomic<int>& at) mutable {
    const int k = ++order;
    at = k;
    if (k == 2) {
      both.setValue();
    }
  };
  pp.serverPipe->write(std::move(back), [&, oneDone](const Error&) mutable {
    oneDone(writeAt);
  });
  Allocation a;
  a.tensors.push_back({dst.data(), n});
  pp.serverPipe->read(std::move(a),
                      [&, oneDone](const Error&) mutable { oneDone(readAt); });
  pp.serverPipe->close();  // while the copy runs
  ASSERT_TRUE(both.getFuture().waitFor(kWait));
  EXPECT_LT(readAt.load(), writeAt.load())
      << "the write's callback came while the connection was still open";
  // The client reads what the server sent (cut short by the close), which
  // brings it to the end of the stream, where its own write fails.
  auto r = readAsync(pp.clientPipe);
  ASSERT_TRUE(r.waitFor(kWait));
  ASSERT_TRUE(w.waitFor(kWait));
  EXPECT_TRUE(w.hasError());
}

// The writer closes its pipe while the reader's cma copy of a large tensor
// runs, and reuses its buffer in the write callback (CANCELLED) that the
// close brings. The reader must never deliver that read as OK unless
// every byte is the writer's original: a copy that was still running when
// the writer closed fails (UNAVAILABLE), whichever of the copy's end and
// the connection's end the reader sees first. Over the shm connection and
// over uv (cma also serves same-host uv pipes), several times, since the
// outcome was a race.
const Backend kUvCma{"uv_cma",         "uv",  "uv://127.0.0.1:0",
                     {"cma", "basic"}, "cma", size_t{256} << 10};

void writerClosesMidCopy(const Backend& backend) {
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    auto pp = makePair(backend, optionsFor(backend, "server"),
                       optionsFor(backend, "client"));
    const size_t n = size_t{64} << 20;
    std::vector<uint8_t> src(n);
    fillPattern(src.data(), n, 11 + round);
    const std::vector<uint8_t> original = src;
    std::vector<uint8_t> dst(n, 0);
    Message m = bigMessage(src);
    Promise<Error> written;
    pp.clientPipe->write(std::move(m), [&src, written](const Error& e) mutable {
      std::memset(src.data(), 0xEE, src.size());
      written.setValue(e);
    });
    ASSERT_EQ(nextDescriptor(*pp.serverPipe).tensors.size(), 1u);
    ASSERT_EQ(pp.serverPipe->channelName(), "cma");
    Allocation a;
    a.tensors.push_back({dst.data(), n});
    Promise<Error> rp;
    pp.serverPipe->read(std::move(a),
                        [rp](const Error& e) mutable { rp.setValue(e); });
    // A little into the copy (64 MiB take 10 ms or more here), or at once
    // in the odd rounds. (Not by watching `dst`: that would race with the
    // copy thread's writes.)
    if (round % 2 == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    pp.clientPipe->close();
    const Error readError = rp.getFuture().wait(kWait);
    const Error writeError = written.getFuture().wait(kWait);
    if (readError.ok()) {
      // Delivered: the copy ended before the writer closed, so every byte
      // is the original (the writer's close may still have overtaken the
      // completion frame: its callback says OK or CANCELLED).
      EXPECT_TRUE(dst == original)
          << "a read delivered as OK holds bytes of the reused buffer";
    } else {
      EXPECT_EQ(readError.code(), Code::kUnavailable) << readError.what();
      EXPECT_FALSE(writeError.ok());
    }
  }
}

TEST(CmaPipe, AWriterThatClosesMidCopyNeverHasItsReusedBufferDeliveredShm) {
  writerClosesMidCopy(kShmCma);
}

TEST(CmaPipe, AWriterThatClosesMidCopyNeverHasItsReusedBufferDeliveredUv) {
  writerClosesMidCopy(kUvCma);
}

// A message whose cma record arrived before the writer closed, read after
// the close was seen: the writer's callback has told it CANCELLED, so the
// buffer is its own again and no copy may start from it.
TEST(CmaPipe, AReadStartedAfterTheWriterClosedFailsWithoutCopying) {
  auto pp = makePair(kShmCma, optionsFor(kShmCma, "server"),
                     optionsFor(kShmCma, "client"));
  const size_t n = size_t{1} << 20;
  std::vector<uint8_t> src(n);
  fillPattern(src.data(), n, 5);
  Message m = bigMessage(src);
  auto w = writeAsync(*pp.clientPipe, std::move(m));
  ASSERT_EQ(nextDescriptor(*pp.serverPipe).tensors.size(), 1u);
  pp.clientPipe->close();
  ASSERT_TRUE(w.waitFor(kWait));
  EXPECT_TRUE(w.hasError());
  // Time for the reader's loop to see the end of the stream before the
  // read is posted (if it has not, the copy runs and the read fails as a
  // copy the close overtook, checked below by its message).
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::vector<uint8_t> dst(n, 0);
  Allocation a;
  a.tensors.push_back({dst.data(), n});
  Promise<Error> rp;
  pp.serverPipe->read(std::move(a),
                      [rp](const Error& e) mutable { rp.setValue(e); });
  const Error e = rp.getFuture().wait(kWait);
  EXPECT_EQ(e.code(), Code::kUnavailable) << e.what();
  if (e.message().find("before the tensor was read") != std::string::npos) {
    EXPECT_TRUE(std::all_of(dst.begin(), dst.end(), [](uint8_t b) {
      return b == 0;
    })) << "a copy ran from a buffer the writer had been given back";
  } else {
    EXPECT_NE(e.message().find("while the tensor was copied"),
              std::string::npos)
        << e.what();
  }
}

// ---- hostile peer: lying records
// ---------------------------------------------

struct RawCmaPeer {
  std::shared_ptr<Context> server;
  std::shared_ptr<Listener> listener;
  int fd = -1;
  std::shared_ptr<Pipe> pipe;
  ~RawCmaPeer() {
    if (fd >= 0) {
      ::close(fd);
    }
  }
};

std::unique_ptr<RawCmaPeer> rawCmaPeer() {
  auto p = std::make_unique<RawCmaPeer>();
  p->server = Context::create(defaults("server"));
  p->listener = p->server->listen({"uv://127.0.0.1:0"});
  p->fd = rawConnect(p->listener->address("uv"));
  std::string chosen;
  EXPECT_TRUE(rawHandshake(p->fd, {"cma", "basic"}, true, &chosen));
  EXPECT_EQ(chosen, "cma");
  p->pipe = acceptOne(*p->listener);
  return p;
}

// A frame announcing one cma tensor of `length` bytes at `address` of `pid`.
std::vector<uint8_t> cmaFrame(uint64_t pid, uintptr_t address, size_t length) {
  Message m;
  m.descriptor = "lie";
  m.tensors.push_back({reinterpret_cast<const void*>(address), length, {}});
  std::vector<wf::OutOfBand> oob{{true, cmaRecord(pid, address, length)}};
  std::vector<uint8_t> out;
  wf::encodeFrameHead(m, &out, &oob);
  out.insert(out.end(), m.descriptor.begin(), m.descriptor.end());
  return out;
}

wf::FrameLayout rawReadFrame(int fd) {
  std::vector<uint8_t> header;
  wf::FrameLayout lay;
  EXPECT_TRUE(rawRecv(fd, wf::kFrameHeaderBytes, &header));
  size_t len = 0;
  EXPECT_TRUE(wf::decodeFrameHeader(header, Limits{}, &len).ok());
  std::vector<uint8_t> body;
  EXPECT_TRUE(rawRecv(fd, len, &body));
  EXPECT_TRUE(wf::decodeLayout(body, Limits{}, &lay).ok());
  return lay;
}

TEST(CmaHostilePeer, LyingRecordsFailThatReadOnlyAndThePeerIsTold) {
  auto peer = rawCmaPeer();
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* mem = ::mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  std::memset(mem, 0x42, page);
  ASSERT_EQ(::mprotect(static_cast<char*>(mem) + page, page, PROT_NONE), 0);
  const auto pid = static_cast<uint64_t>(::getpid());
  const auto base = reinterpret_cast<uintptr_t>(mem);

  // Longer than the writer's buffer: the copy stops at the guard page.
  rawSend(peer->fd, cmaFrame(pid, base, 2 * page));
  auto r = readAll(peer->pipe);
  EXPECT_EQ(r.error.code(), Code::kDataLoss) << r.error.what();
  EXPECT_NE(r.error.message().find("after " + std::to_string(page) + " bytes"),
            std::string::npos)
      << r.error.what();
  auto c = rawReadFrame(peer->fd);
  EXPECT_EQ(c.type, wf::kFrameCompletion);
  EXPECT_EQ(c.completionCode, Code::kDataLoss);
  EXPECT_FALSE(c.completionReason.empty());

  // An address that is not mapped at all.
  rawSend(peer->fd, cmaFrame(pid, 4096, 64));
  r = readAll(peer->pipe);
  EXPECT_EQ(r.error.code(), Code::kDataLoss) << r.error.what();
  EXPECT_NE(rawReadFrame(peer->fd).completionCode, Code::kOk);

  // The pipe goes on: an honest record, then an inline message.
  rawSend(peer->fd, cmaFrame(pid, base, page));
  r = readAll(peer->pipe);
  ASSERT_TRUE(r.error.ok()) << r.error.what();
  EXPECT_EQ(r.tensors.at(0), std::vector<uint8_t>(page, 0x42));
  EXPECT_EQ(rawReadFrame(peer->fd).completionCode, Code::kOk);
  auto head = rawFrameHead(3, {});
  head.insert(head.end(), {'a', 'b', 'c'});
  rawSend(peer->fd, head);
  r = readAll(peer->pipe);
  ASSERT_TRUE(r.error.ok()) << r.error.what();
  EXPECT_EQ(r.descriptor.descriptor, "abc");
  ::munmap(mem, 2 * page);
}

// Records are opaque to the pipe: the cma channel checks them, and a lie
// fails that read only (and the peer hears of it), the pipe goes on.
TEST(CmaHostilePeer, RecordForAnotherPidOrLengthFailsThatReadOnly) {
  auto peer = rawCmaPeer();
  uint8_t b[16] = {};
  // Pid 1: a third process (this one's pid would be the peer's own).
  rawSend(peer->fd, cmaFrame(1, reinterpret_cast<uintptr_t>(b), sizeof(b)));
  auto r = readAll(peer->pipe);
  EXPECT_EQ(r.error.code(), Code::kDataLoss) << r.error.what();
  EXPECT_NE(r.error.message().find("names pid 1"), std::string::npos)
      << r.error.what();
  EXPECT_EQ(rawReadFrame(peer->fd).completionCode, Code::kDataLoss);
  // A record whose length differs from the tensor's.
  auto frame = cmaFrame(static_cast<uint64_t>(::getpid()),
                        reinterpret_cast<uintptr_t>(b), 10);
  // Layout: ... record ending in its varint length (10), before "lie".
  const size_t at = frame.size() - 3 - 1;
  ASSERT_EQ(frame[at], 10);
  frame[at] = 11;
  rawSend(peer->fd, frame);
  r = readAll(peer->pipe);
  EXPECT_EQ(r.error.code(), Code::kDataLoss) << r.error.what();
  EXPECT_NE(r.error.message().find("cma length"), std::string::npos)
      << r.error.what();
  EXPECT_EQ(rawReadFrame(peer->fd).completionCode, Code::kDataLoss);
  // A record that is not one (truncated).
  Message m;
  m.descriptor = "lie";
  m.tensors.push_back({b, sizeof(b), {}});
  std::vector<wf::OutOfBand> oob{{true, "short"}};
  std::vector<uint8_t> out;
  wf::encodeFrameHead(m, &out, &oob);
  out.insert(out.end(), m.descriptor.begin(), m.descriptor.end());
  rawSend(peer->fd, out);
  r = readAll(peer->pipe);
  EXPECT_EQ(r.error.code(), Code::kDataLoss) << r.error.what();
  EXPECT_EQ(rawReadFrame(peer->fd).completionCode, Code::kDataLoss);
  // The pipe goes on.
  auto head = rawFrameHead(2, {});
  head.insert(head.end(), {'o', 'k'});
  rawSend(peer->fd, head);
  r = readAll(peer->pipe);
  ASSERT_TRUE(r.error.ok()) << r.error.what();
  EXPECT_EQ(r.descriptor.descriptor, "ok");
}

// A frame whose record exceeds the bound fails the pipe before anything is
// sized from it.
TEST(CmaHostilePeer, OversizedRecordIsAProtocolError) {
  auto peer = rawCmaPeer();
  Message m;
  uint8_t b[16] = {};
  m.tensors.push_back({b, sizeof(b), {}});
  std::vector<wf::OutOfBand> oob{
      {true, std::string(Channel::kMaxOutOfBandRecordBytes + 1, 'x')}};
  std::vector<uint8_t> out;
  wf::encodeFrameHead(m, &out, &oob);
  rawSend(peer->fd, out);
  Promise<Descriptor> dp;
  peer->pipe->readDescriptor([dp](const Error& e, Descriptor d) mutable {
    e.ok() ? dp.setValue(std::move(d)) : dp.setError(e);
  });
  auto f = dp.getFuture();
  ASSERT_TRUE(f.waitFor(kWait));
  EXPECT_EQ(f.error().code(), Code::kDataLoss) << f.error().what();
  EXPECT_NE(f.error().message().find("out-of-band record"), std::string::npos)
      << f.error().what();
  EXPECT_TRUE(rawPeerClosed(peer->fd, std::chrono::seconds(10)));
}

// ---- other processes
// ----------------------------------------------------------

std::unique_ptr<Child> spawnHelper(std::vector<std::string> args) {
  return testing::spawnHelper(CMA_PEER_HELPER, std::move(args));
}

// A read that failed because its writer went away says so: the peer's pid,
// its address, "is gone".
void expectNamesTheDepartedPeer(const Error& e, pid_t pid,
                                const std::string& address) {
  EXPECT_NE(e.message().find("pid " + std::to_string(pid)), std::string::npos)
      << e.what();
  EXPECT_NE(e.message().find(address), std::string::npos) << e.what();
  EXPECT_NE(e.message().find("is gone"), std::string::npos) << e.what();
}

// A writer process (cma_peer_helper MODE) has written a 64 MiB tensor by
// cma; this side takes the record, says "go", and reads the tensor once the
// writer says it let go of it ("freed").
struct ReadAfterRelease {
  std::unique_ptr<Child> child;
  std::shared_ptr<Pipe> pipe;
  std::shared_ptr<std::vector<uint8_t>> body;
  Error error;  // the read's
  std::chrono::steady_clock::duration took{};
};

constexpr size_t kReleasedBytes = size_t{64} << 20;

std::unique_ptr<ReadAfterRelease> readAfterRelease(
    Listener& l, const std::string& mode,
    const std::function<void(Pipe&)>& whileReading = nullptr) {
  auto r = std::make_unique<ReadAfterRelease>();
  r->child =
      spawnHelper({mode, l.address("shm"), std::to_string(kReleasedBytes)});
  r->pipe = acceptOne(l);
  EXPECT_EQ(readAsync(r->pipe).wait(kWait).descriptor, "hello");
  EXPECT_EQ(r->child->readLine(30000), "ready shm cma");
  EXPECT_EQ(r->child->readLine(30000), "sent");
  Promise<Descriptor> dp;
  r->pipe->readDescriptor([dp](const Error& e, Descriptor d) mutable {
    e.ok() ? dp.setValue(std::move(d)) : dp.setError(e);
  });
  auto df = dp.getFuture();
  if (!df.waitFor(kWait) || !df.error().ok()) {
    r->error = df.error().ok() ? Error::timeout("no descriptor") : df.error();
    ADD_FAILURE() << r->error.what();
    return r;
  }
  const Descriptor d = df.wait(kWait);
  EXPECT_EQ(d.descriptor, "big");
  if (d.tensors.size() != 1 || d.tensors[0].length != kReleasedBytes) {
    r->error = Error::internal("unexpected descriptor");
    ADD_FAILURE() << "unexpected descriptor";
    return r;
  }
  // Shared with the read's callback: a read that never called back still
  // owns its buffer. Made before "go", so that the copy starts as soon as
  // the writer says "freed" (zeroing 64 MiB takes 200+ ms under TSan, as
  // long as the "leave" writer lives on).
  r->body = std::make_shared<std::vector<uint8_t>>(kReleasedBytes);
  Message go;
  go.descriptor = "go";
  writeAsync(*r->pipe, go).wait(kWait);
  EXPECT_EQ(r->child->readLine(30000), "freed");
  Promise<void> rp;
  const auto t0 = std::chrono::steady_clock::now();
  r->pipe->read(Allocation{{}, {{r->body->data(), r->body->size()}}},
                [rp, body = r->body](const Error& e) mutable {
                  e.ok() ? rp.setValue() : rp.setError(e);
                });
  if (whileReading) {
    whileReading(*r->pipe);
  }
  auto rf = rp.getFuture();
  if (!rf.waitFor(std::chrono::seconds(20))) {
    r->error = Error::timeout("the read did not call back within 20 s");
    ADD_FAILURE() << r->error.what();
    return r;
  }
  r->took = std::chrono::steady_clock::now() - t0;
  r->error = rf.error();
  return r;
}

// A writer process's 16 MiB tensor is read straight from its memory,
// intact, and the writer hears so: also how a test shows that the listener
// and the channel serve the next writer as before.
void expectAnotherWriterIsServed(Listener& l) {
  constexpr size_t kBytes = size_t{16} << 20;
  auto child = spawnHelper({"send", l.address("shm"), std::to_string(kBytes)});
  auto pipe = acceptOne(l);
  EXPECT_EQ(readAsync(pipe).wait(kWait).descriptor, "hello");
  EXPECT_EQ(child->readLine(30000), "ready shm cma");
  auto r = readAll(pipe);
  ASSERT_TRUE(r.error.ok()) << r.error.what();
  ASSERT_EQ(r.tensors.size(), 1u);
  EXPECT_TRUE(checkPattern(r.tensors[0].data(), kBytes, 7));
  EXPECT_EQ(child->readLine(30000), "written ok");
  const int status = child->wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST(CmaTwoProcesses, SiblingReadsALargeTensorStraightFromTheWriter) {
  auto server = Context::create(defaults("server"));
  auto l = server->listen({"shm://"});
  expectAnotherWriterIsServed(*l);
}

// The writer closed its pipe before the reader copied: its write failed
// (CANCELLED), the buffer was its own again and it let go of it, though the
// process lives on. The reader copies nothing from a writer that closed,
// and says the peer left, not that it lied (collectives once saw DATA_LOSS
// here).
TEST(CmaTwoProcesses, WriterThatClosedAndFreedItsTensorFailsTheReadAsGone) {
  auto server = Context::create(defaults("server"));
  auto l = server->listen({"shm://"});
  auto r = readAfterRelease(*l, "close");
  EXPECT_EQ(r->error.code(), Code::kUnavailable) << r->error.what();
  expectNamesTheDepartedPeer(r->error, r->child->pid, r->pipe->peerAddress());
  EXPECT_LT(r->took, std::chrono::seconds(5));
  EXPECT_THROW(throwIfError(r->error), ConnectionError);
  // The stream ended with that message.
  auto next = readAll(r->pipe);
  EXPECT_EQ(next.error.code(), Code::kUnavailable) << next.error.what();
  expectAnotherWriterIsServed(*l);
}

// Another process closes its pipe while this one copies its 64 MiB tensor,
// and overwrites the tensor in its write's callback. The read fails as the
// peer's departure, or is delivered with every byte the writer's original:
// never with bytes of the reused buffer.
TEST(CmaTwoProcesses,
     AWriterThatClosesMidCopyAndReusesItsBufferIsNotDelivered) {
  auto server = Context::create(defaults("server"));
  auto l = server->listen({"shm://"});
  auto child =
      spawnHelper({"reuse", l->address("shm"), std::to_string(kReleasedBytes)});
  auto pipe = acceptOne(*l);
  EXPECT_EQ(readAsync(pipe).wait(kWait).descriptor, "hello");
  EXPECT_EQ(child->readLine(30000), "ready shm cma");
  EXPECT_EQ(child->readLine(30000), "sent");
  ASSERT_EQ(nextDescriptor(*pipe).tensors.size(), 1u);
  auto body = std::make_shared<std::vector<uint8_t>>(kReleasedBytes, 0);
  Promise<Error> rp;
  pipe->read(Allocation{{}, {{body->data(), body->size()}}},
             [rp, body](const Error& e) mutable { rp.setValue(e); });
  Message go;
  go.descriptor = "go";
  writeAsync(*pipe, go).wait(kWait);
  EXPECT_EQ(child->readLine(30000), "reused");
  auto rf = rp.getFuture();
  ASSERT_TRUE(rf.waitFor(kWait));
  const Error e = rf.value();
  if (e.ok()) {
    EXPECT_TRUE(checkPattern(body->data(), body->size(), 7))
        << "a read delivered as OK holds bytes of the reused buffer";
  } else {
    EXPECT_EQ(e.code(), Code::kUnavailable) << e.what();
    expectNamesTheDepartedPeer(e, child->pid, pipe->peerAddress());
  }
}

// The writer let go of the tensor with its pipe still open, as a process
// does while unwinding on its way out, and ended 200 ms later: the read
// fails as the peer's departure, not as corruption.
TEST(CmaTwoProcesses, WriterThatFreedItsTensorAndExitedFailsTheReadAsGone) {
  auto server = Context::create(defaults("server"));
  auto l = server->listen({"shm://"});
  auto r = readAfterRelease(*l, "leave");
  const pid_t pid = r->child->pid;
  EXPECT_EQ(r->error.code(), Code::kUnavailable) << r->error.what();
  expectNamesTheDepartedPeer(r->error, pid, r->pipe->peerAddress());
  EXPECT_LT(r->took, std::chrono::seconds(5));
  const int status = r->child->wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  expectAnotherWriterIsServed(*l);
}

// A live writer that keeps its pipe open but whose record names memory it
// does not have (here: freed before the reader's copy) is still a protocol
// error, that read's alone; the writer hears of it and the pipe goes on.
TEST(CmaTwoProcesses, LiveWriterWhoseRecordNamesFreedMemoryIsAProtocolError) {
  auto server = Context::create(defaults("server"));
  auto l = server->listen({"shm://"});
  auto r = readAfterRelease(*l, "free");
  EXPECT_EQ(r->error.code(), Code::kDataLoss) << r->error.what();
  EXPECT_NE(r->error.message().find("pid " + std::to_string(r->child->pid)),
            std::string::npos)
      << r->error.what();
  // The writer hears of it through the completion frame.
  const std::string line = r->child->readLine(30000);
  EXPECT_EQ(line.rfind("written error: DATA_LOSS", 0), 0u) << line;
  // The pipe goes on.
  Message ping;
  ping.descriptor = "ping";
  auto w = writeAsync(*r->pipe, ping);
  ASSERT_TRUE(w.waitFor(kWait));
  EXPECT_TRUE(w.error().ok()) << w.error().what();
  expectAnotherWriterIsServed(*l);
}

// The same read, waiting for the writer's end of the connection, ends at
// once when this side closes the pipe meanwhile.
TEST(CmaTwoProcesses, ClosingThePipeEndsAReadWaitingForThePeersEnd) {
  auto server = Context::create(defaults("server"));
  auto l = server->listen({"shm://"});
  auto r = readAfterRelease(*l, "free", [](Pipe& pipe) {
    // Long enough for the copy to fail, well inside the 1 s wait.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    pipe.close();
  });
  EXPECT_EQ(r->error.code(), Code::kCancelled) << r->error.what();
  EXPECT_LT(r->took, std::chrono::milliseconds(900));
  expectAnotherWriterIsServed(*l);
}

TEST(CmaTwoProcesses, WriterKilledBeforeTheReadFailsItClearly) {
  auto server = Context::create(defaults("server"));
  auto l = server->listen({"shm://"});
  constexpr size_t kBytes = size_t{64} << 20;
  auto child = spawnHelper({"hold", l->address("shm"), std::to_string(kBytes)});
  auto pipe = acceptOne(*l);
  EXPECT_EQ(readAsync(pipe).wait(kWait).descriptor, "hello");
  EXPECT_EQ(child->readLine(30000), "ready shm cma");
  EXPECT_EQ(child->readLine(30000), "sent");
  Promise<Descriptor> dp;
  pipe->readDescriptor([dp](const Error& e, Descriptor d) mutable {
    e.ok() ? dp.setValue(std::move(d)) : dp.setError(e);
  });
  auto d = dp.getFuture().wait(kWait);
  ASSERT_EQ(d.tensors.size(), 1u);
  ASSERT_EQ(d.tensors[0].length, kBytes);
  // The record is here; the memory it names goes away.
  const pid_t pid = child->pid;
  ASSERT_EQ(::kill(child->pid, SIGKILL), 0);
  const int status = child->wait();
  EXPECT_TRUE(WIFSIGNALED(status));
  std::vector<uint8_t> body(kBytes);
  Promise<void> rp;
  const auto t0 = std::chrono::steady_clock::now();
  pipe->read(Allocation{{}, {{body.data(), body.size()}}},
             [rp](const Error& e) mutable {
               e.ok() ? rp.setValue() : rp.setError(e);
             });
  auto rf = rp.getFuture();
  ASSERT_TRUE(rf.waitFor(std::chrono::seconds(10)));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  // The copy finds no process (whether or not the connection's EOF came
  // first): the peer is gone, named by its pid and address.
  EXPECT_EQ(rf.error().code(), Code::kUnavailable) << rf.error().what();
  expectNamesTheDepartedPeer(rf.error(), pid, pipe->peerAddress());
  EXPECT_THROW(rf.wait(kWait), ConnectionError);
  // The listener still serves.
  auto client = Context::create(defaults("client"));
  auto c = client->connect(l->address("shm"));
  auto s = acceptOne(*l);
  writeAsync(*c, Message()).wait(kWait);
  readAsync(s).wait(kWait);
}

}  // namespace
}  // namespace trellis::transport::testing
