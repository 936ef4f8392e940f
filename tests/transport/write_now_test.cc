// Pipe::tryWriteNow (transport/pipe.h): a message written on the calling
// thread straight into an shm ring keeps its place among write()s, whole,
// from any number of threads; it is refused, writing nothing, wherever it
// cannot be done that way (uv, out-of-band tensors, the loop thread, a
// closed pipe, a peer that is gone), and a peer process that stops and then
// dies while messages are written now fails them as it fails write()s.

#include <atomic>
#include <chrono>
#include <memory>
#include <signal.h>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <vector>

#include "peer_process.h"
#include "transport_test_util.h"
#include <trellis/transport/shm/factory.h>
#include <trellis/transport/shm/ring.h>

namespace trellis::transport::testing {
namespace {

const Backend kShm{"shm", "shm", "shm://", {"basic"}, "basic", std::nullopt};
const Backend kUv{"uv",      "uv",    "uv://127.0.0.1:0",
                  {"basic"}, "basic", std::nullopt};

// One message each way through write(): the pipe is established after it.
void establish(PipePair& pp) {
  auto m = patterned("hello", {8}, {}, 1);
  writeAsync(*pp.clientPipe, m.view()).wait(kWait);
  ASSERT_EQ(readAsync(pp.serverPipe).wait(kWait).descriptor, "hello");
}

// Writes `m` now if the pipe lets it, else through write(); true if now.
bool writeEitherWay(Pipe& pipe, const OwnedMessage& m,
                    std::vector<Future<void>>* pending) {
  if (pipe.tryWriteNow(m.view())) {
    return true;
  }
  pending->push_back(writeAsync(pipe, m.view()));
  return false;
}

TEST(WriteNow, KeepsItsPlaceAmongWritesThroughAFillingRing) {
  // A 64 KiB ring and some messages of 40 KiB: the ring fills now and
  // then, so write()s wait in the connection and writes now must be
  // refused behind them.
  auto pp = shmPair(64 << 10);
  establish(pp);
  constexpr int kMessages = 1500;
  std::vector<OwnedMessage> messages;
  messages.reserve(kMessages);
  for (int i = 0; i < kMessages; ++i) {
    const size_t size =
        (i % 50 == 0) ? (40 << 10) : static_cast<size_t>(i % 300);
    messages.push_back(patterned(std::to_string(i), {size}, {size / 3 + 1},
                                 static_cast<uint32_t>(i)));
  }
  std::atomic<bool> readerOk{true};
  std::thread reader([&] {
    for (int i = 0; i < kMessages && readerOk; ++i) {
      auto r = readAsync(pp.serverPipe).wait(kWait);
      const auto& m = messages[i];
      if (r.descriptor != m.descriptor || r.payloads != m.payloads ||
          r.tensors != m.tensors) {
        ADD_FAILURE() << "message " << i << " arrived as '" << r.descriptor
                      << "' or with other bytes";
        readerOk = false;
      }
    }
  });
  std::vector<Future<void>> pending;
  int now = 0;
  int refused = 0;
  for (int i = 0; i < kMessages; ++i) {
    if (i % 5 == 0) {
      pending.push_back(writeAsync(*pp.clientPipe, messages[i].view()));
      if (i % 10 == 0) {
        // Written (into the ring or the connection's queue): writes now
        // may go again, unless the ring is full.
        pending.back().wait(kWait);
      }
    } else if (writeEitherWay(*pp.clientPipe, messages[i], &pending)) {
      ++now;
    } else {
      ++refused;
    }
  }
  for (auto& f : pending) {
    f.wait(kWait);
  }
  reader.join();
  EXPECT_TRUE(readerOk);
  EXPECT_GT(now, 0) << "no message was written on the calling thread";
  EXPECT_GT(refused, 0) << "the ring never filled: the test proves less";
}

TEST(WriteNow, ConcurrentWritersKeepTheirOrderAndWholeMessages) {
  auto pp = shmPair(256 << 10);
  establish(pp);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 400;
  std::vector<std::vector<OwnedMessage>> messages(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kPerThread; ++i) {
      const size_t size = static_cast<size_t>((i * 131 + t * 17) % 9000);
      messages[t].push_back(
          patterned(std::to_string(t) + ":" + std::to_string(i), {size, 5},
                    {size / 2}, static_cast<uint32_t>(t * 100000 + i)));
    }
  }
  std::atomic<int> nowTotal{0};
  std::vector<std::thread> writers;
  for (int t = 0; t < kThreads; ++t) {
    writers.emplace_back([&, t] {
      std::vector<Future<void>> pending;
      for (const auto& m : messages[t]) {
        if (writeEitherWay(*pp.clientPipe, m, &pending)) {
          nowTotal.fetch_add(1);
        }
      }
      for (auto& f : pending) {
        f.wait(kWait);
      }
    });
  }
  std::vector<int> next(kThreads, 0);
  for (int k = 0; k < kThreads * kPerThread; ++k) {
    auto r = readAsync(pp.serverPipe).wait(kWait);
    const auto colon = r.descriptor.find(':');
    ASSERT_NE(colon, std::string::npos) << r.descriptor;
    const int t = std::stoi(r.descriptor.substr(0, colon));
    const int i = std::stoi(r.descriptor.substr(colon + 1));
    ASSERT_TRUE(t >= 0 && t < kThreads) << r.descriptor;
    ASSERT_EQ(i, next[t]) << "thread " << t << "'s messages out of order";
    const auto& m = messages[t][i];
    ASSERT_EQ(r.payloads, m.payloads) << r.descriptor;
    ASSERT_EQ(r.tensors, m.tensors) << r.descriptor;
    ++next[t];
  }
  for (auto& w : writers) {
    w.join();
  }
  EXPECT_GT(nowTotal.load(), 0);
}

// A refused tryWriteNow wrote nothing: the message after it, sent by
// write(), is the next one the peer reads.
void expectRefusedWroteNothing(PipePair& pp, const std::string& what) {
  auto refused = patterned("refused", {16}, {}, 3);
  EXPECT_FALSE(pp.clientPipe->tryWriteNow(refused.view())) << what;
  auto next = patterned("next", {16}, {}, 4);
  writeAsync(*pp.clientPipe, next.view()).wait(kWait);
  EXPECT_EQ(readAsync(pp.serverPipe).wait(kWait).descriptor, "next") << what;
}

TEST(WriteNow, RefusedOverUvWithOutOfBandTensorsAndOnTheLoop) {
  {
    auto pp =
        makePair(kUv, optionsFor(kUv, "server"), optionsFor(kUv, "client"));
    establish(pp);
    expectRefusedWroteNothing(pp, "uv");
  }
  {
    // cma from the first byte: every CPU tensor is copied out of band.
    Backend cma = kShm;
    cma.channels = {"cma", "basic"};
    cma.cmaThreshold = 0;
    auto pp =
        makePair(cma, optionsFor(cma, "server"), optionsFor(cma, "client"));
    establish(pp);
    ASSERT_EQ(pp.clientPipe->channelName(), "cma");
    auto m = patterned("oob", {8}, {4096}, 5);
    EXPECT_FALSE(pp.clientPipe->tryWriteNow(m.view()));
    // Without tensors nothing goes out of band: written now.
    auto plain = patterned("plain", {8}, {}, 6);
    EXPECT_TRUE(pp.clientPipe->tryWriteNow(plain.view()));
    EXPECT_EQ(readAsync(pp.serverPipe).wait(kWait).descriptor, "plain");
  }
  {
    auto pp = shmPair(shm::kMinRingBytes * 16);
    establish(pp);
    // Inside a callback, on the loop thread.
    Promise<bool> onLoop;
    auto m = patterned("loop", {8}, {}, 7);
    auto x = patterned("x", {}, {}, 8);
    pp.clientPipe->write(x.view(), [&, onLoop](const Error&) mutable {
      onLoop.setValue(pp.clientPipe->tryWriteNow(m.view()));
    });
    EXPECT_FALSE(onLoop.getFuture().wait(kWait));
    EXPECT_EQ(readAsync(pp.serverPipe).wait(kWait).descriptor, "x");
    auto next = patterned("next", {16}, {}, 4);
    writeAsync(*pp.clientPipe, next.view()).wait(kWait);
    EXPECT_EQ(readAsync(pp.serverPipe).wait(kWait).descriptor, "next");
  }
}

TEST(WriteNow, RefusedAtOnceAfterCloseAndOnceThePeerIsGone) {
  {
    auto pp = shmPair(shm::kMinRingBytes * 16);
    establish(pp);
    auto m = patterned("before", {8}, {}, 9);
    ASSERT_TRUE(pp.clientPipe->tryWriteNow(m.view()));
    EXPECT_EQ(readAsync(pp.serverPipe).wait(kWait).descriptor, "before");
    pp.clientPipe->close();
    EXPECT_FALSE(pp.clientPipe->tryWriteNow(m.view()));
    // And write() reports why.
    EXPECT_THROW(writeAsync(*pp.clientPipe, m.view()).wait(kWait),
                 CancelledError);
  }
  {
    auto pp = shmPair(shm::kMinRingBytes * 16);
    establish(pp);
    pp.serverPipe->close();
    pp.serverPipe.reset();
    pp.listener.reset();
    pp.server.reset();
    // The client's loop learns of the peer's end from the control socket;
    // from then on nothing is written now.
    auto m = patterned("after", {8}, {}, 10);
    EXPECT_TRUE(
        eventually([&] { return !pp.clientPipe->tryWriteNow(m.view()); }));
    EXPECT_THROW(writeAsync(*pp.clientPipe, m.view()).wait(kWait),
                 ConnectionError);
  }
}

TEST(WriteNow, StoppedThenKilledPeerFillsTheRingThenFailsLikeWrite) {
  auto server = Context::create(optionsFor(kShm, "server"));
  auto listener = server->listen({kShm.listenAddr});
  auto child =
      spawnHelper(SHM_PEER_HELPER, {"connect", listener->address("shm")});
  auto pipe = acceptOne(*listener);
  ASSERT_EQ(readAsync(pipe).wait(kWait).descriptor, "hello");
  ASSERT_EQ(child->readLine(30000), "ready shm");
  ASSERT_EQ(pipe->transportName(), "shm");
  // A stopped peer drains nothing: writes now fill its ring, then are
  // refused for want of room, without blocking this thread.
  ASSERT_EQ(::kill(child->pid, SIGSTOP), 0);
  auto m = patterned("fill", {64 << 10}, {}, 11);
  int now = 0;
  bool refused = false;
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  for (int i = 0; i < 100000 && !refused; ++i) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline);
    if (pipe->tryWriteNow(m.view())) {
      ++now;
    } else {
      refused = true;
    }
  }
  EXPECT_GT(now, 0) << "nothing was written now before the ring filled";
  EXPECT_TRUE(refused) << "a ring that nobody drains never filled";
  // write() waits in the connection for room that will not come...
  auto w = writeAsync(*pipe, m.view());
  EXPECT_FALSE(w.waitFor(std::chrono::milliseconds(300)));
  // ...until the peer dies: then it fails, promptly.
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(child->pid, SIGKILL), 0);
  EXPECT_THROW(w.wait(std::chrono::seconds(10)), ConnectionError);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_TRUE(WIFSIGNALED(child->wait()));

  // A peer killed while its ring has room: once the loop has seen it go,
  // writes now are refused for that reason alone, and write() says why.
  auto second =
      spawnHelper(SHM_PEER_HELPER, {"connect", listener->address("shm")});
  auto pipe2 = acceptOne(*listener);
  ASSERT_EQ(readAsync(pipe2).wait(kWait).descriptor, "hello");
  ASSERT_EQ(second->readLine(30000), "ready shm");
  auto small = patterned("small", {16}, {}, 13);
  ASSERT_TRUE(pipe2->tryWriteNow(small.view()));
  ASSERT_EQ(::kill(second->pid, SIGKILL), 0);
  EXPECT_TRUE(WIFSIGNALED(second->wait()));
  EXPECT_TRUE(eventually([&] { return !pipe2->tryWriteNow(small.view()); }))
      << "still written now long after the peer died";
  EXPECT_THROW(writeAsync(*pipe2, small.view()).wait(kWait), ConnectionError);
  // The process goes on: a new peer is served, and written to now.
  auto client = Context::create(optionsFor(kShm, "client"));
  auto p = client->connect(listener->address("shm"));
  auto s = acceptOne(*listener);
  writeAsync(*p, Message()).wait(kWait);
  readAsync(s).wait(kWait);
  auto after = patterned("after", {32}, {}, 12);
  EXPECT_TRUE(s->tryWriteNow(after.view()));
  EXPECT_EQ(readAsync(p).wait(kWait).descriptor, "after");
}

}  // namespace
}  // namespace trellis::transport::testing
