// ProcessGroup with the nccl backend on one GPU: a group of one rank over a
// HashStore. Every test skips, saying why, where no GPU is visible or
// libtorch has no CUDA; none passes vacuously where one is.
//
// ctest runs each test in a process of its own (gtest_discover_tests): the
// tests that abort a communicator cannot leave a CUDA context behind for
// the others.
#include <chrono>
#include <condition_variable>
#include <cuda_runtime.h>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR > 2 || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#include <c10/core/impl/DeviceGuardImplInterface.h>
#define TRELLIS_TEST_STREAMS 1
#endif

#include "../gpu/gpu_test.h"
#include <trellis/collectives/process_group.h>
#include <trellis/core/error.h>
#include <trellis/store/hash_store.h>

namespace trellis::collectives {
namespace {

using namespace std::chrono_literals;

const torch::Device kCuda0(torch::kCUDA, 0);

// The watchdog ticks at a tenth of the shortest group timeout, or this: so
// slowly that an op which completed only at a tick could not pass
// WaitDoesNotWaitForTheWatchdog. Set before main, as the watchdog reads it
// once per process.
const bool kSlowWatchdog =
    setenv("TRELLIS_WATCHDOG_INTERVAL_MS", "600000", 1) == 0;

std::shared_ptr<ProcessGroup> makeGroup(ProcessGroupOptions options = {}) {
  if (!options.timeout) {
    options.timeout = 60s;
  }
  if (!options.watchdogMode) {
    options.watchdogMode = WatchdogMode::kFail;  // never end the test
  }
  if (!options.flightRecorderDir) {
    options.flightRecorderDir = "";
  }
  return ProcessGroup::create("nccl", std::make_shared<store::HashStore>(), 0,
                              1, options);
}

// Small integers: exact in every dtype.
torch::Tensor values(int64_t n, torch::ScalarType dtype) {
  auto base = torch::arange(n, torch::kLong).remainder(5) + 1;
  if (dtype == torch::kBool) {
    return (base.remainder(2) == 0).to(kCuda0);
  }
  return base.to(dtype).to(kCuda0);
}

const torch::ScalarType kDtypes[] = {
    torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16, torch::kChar,
    torch::kByte,  torch::kInt,    torch::kLong, torch::kBool};

using trellis::testing::StreamGate;

TEST(NcclTest, AllreduceEveryDtypeAndOp) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  for (torch::ScalarType dtype : kDtypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProduct,
                        ReduceOp::kMin, ReduceOp::kMax}) {
      auto t = values(1000, dtype);
      const auto expected = t.cpu();
      pg->allreduce(t, op).wait();
      EXPECT_TRUE(torch::equal(t.cpu(), expected))
          << c10::toString(dtype) << " " << toString(op);
    }
  }
}

TEST(NcclTest, AllreduceCoalesced) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  std::vector<torch::Tensor> ts = {values(3, torch::kFloat),
                                   values(0, torch::kFloat),
                                   values(1 << 20, torch::kFloat)};
  std::vector<torch::Tensor> expected;
  for (auto& t : ts) {
    expected.push_back(t.cpu());
  }
  pg->allreduceCoalesced(ts).wait();
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_TRUE(torch::equal(ts[i].cpu(), expected[i])) << i;
  }
}

TEST(NcclTest, BroadcastAndReduceEveryDtype) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  for (torch::ScalarType dtype : kDtypes) {
    auto t = values(777, dtype);
    const auto expected = t.cpu();
    pg->broadcast(t, 0).wait();
    EXPECT_TRUE(torch::equal(t.cpu(), expected)) << c10::toString(dtype);
    pg->reduce(t, 0, ReduceOp::kMax).wait();
    EXPECT_TRUE(torch::equal(t.cpu(), expected)) << c10::toString(dtype);
  }
}

TEST(NcclTest, AllgatherEveryDtype) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  for (torch::ScalarType dtype : kDtypes) {
    auto in = values(513, dtype);
    std::vector<torch::Tensor> outs = {torch::zeros_like(in)};
    pg->allgather(outs, in).wait();
    EXPECT_TRUE(torch::equal(outs[0].cpu(), in.cpu())) << c10::toString(dtype);
    auto flat = torch::zeros_like(in);
    pg->allgatherIntoTensor(flat, in).wait();
    EXPECT_TRUE(torch::equal(flat.cpu(), in.cpu())) << c10::toString(dtype);
  }
}

TEST(NcclTest, ReduceScatter) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  for (torch::ScalarType dtype : kDtypes) {
    auto in = values(300, dtype);
    auto out = torch::zeros_like(in);
    pg->reduceScatter(out, {in}).wait();
    EXPECT_TRUE(torch::equal(out.cpu(), in.cpu())) << c10::toString(dtype);
    auto out2 = torch::zeros_like(in);
    pg->reduceScatterTensor(out2, in, ReduceOp::kMin).wait();
    EXPECT_TRUE(torch::equal(out2.cpu(), in.cpu())) << c10::toString(dtype);
  }
}

TEST(NcclTest, GatherScatterAlltoall) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  auto in = values(64, torch::kInt);
  std::vector<torch::Tensor> outs = {torch::zeros_like(in)};
  pg->gather(outs, in, 0).wait();
  EXPECT_TRUE(torch::equal(outs[0].cpu(), in.cpu()));
  auto out = torch::zeros_like(in);
  pg->scatter(out, {in}, 0).wait();
  EXPECT_TRUE(torch::equal(out.cpu(), in.cpu()));
  auto a2a = torch::zeros_like(in);
  pg->alltoall(a2a, in).wait();
  EXPECT_TRUE(torch::equal(a2a.cpu(), in.cpu()));
}

TEST(NcclTest, Barrier) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  pg->barrier().wait(30s);
  pg->allreduce(values(4, torch::kFloat)).wait();
  pg->barrier().wait(30s);
}

// The op runs after what the caller's stream had, and the caller's stream
// sees its output, with no wait(): .cpu() copies on the current stream.
TEST(NcclTest, OrderedWithTheCallersStream) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  for (int i = 0; i < 20; ++i) {
    auto in = torch::full({1 << 22}, i + 1, torch::TensorOptions(kCuda0));
    auto out = torch::zeros_like(in);
    auto work = pg->allgatherIntoTensor(out, in);
    EXPECT_TRUE(torch::equal(out.cpu(), in.cpu())) << i;
    work.wait();
  }
}

#ifdef TRELLIS_TEST_STREAMS
TEST(NcclTest, OrderedWithANonDefaultCurrentStream) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const c10::Stream side = impl->getStreamFromGlobalPool(kCuda0);
  const c10::Stream before = impl->exchangeStream(side);
  auto in = torch::full({1 << 22}, 5, torch::TensorOptions(kCuda0));
  auto out = torch::zeros_like(in);
  auto work = pg->allgatherIntoTensor(out, in);
  const bool same = torch::equal(out.cpu(), in.cpu());
  work.wait();
  impl->exchangeStream(before);
  EXPECT_TRUE(same);
}

// wait() blocks the caller's current stream, not the host: with the legacy
// default stream held, the op cannot run, yet wait() returns at once; what
// is then put on another stream made current runs only after the op.
TEST(NcclTest, WaitBlocksTheCurrentStreamNotTheHost) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  auto in = torch::full({1 << 20}, 5, torch::TensorOptions(kCuda0));
  auto out = torch::zeros_like(in);
  // The communicator exists, and so does NCCL's allgather: the first op of
  // a kind may block the host on work on the legacy stream, the gate's.
  pg->allgatherIntoTensor(out, in).wait(30s);
  out.zero_();
  // Made before the gate: the pool's first use creates its streams.
  const c10::Stream side = impl->getStreamFromGlobalPool(kCuda0);
  torch::Tensor seen;
  {
    const auto gated = std::chrono::steady_clock::now();
    StreamGate gate(20s);
    auto work = pg->allgatherIntoTensor(out, in);  // behind the gate
    const auto issued = std::chrono::steady_clock::now();
    EXPECT_LT(issued - gated, 5s) << "issuing the op blocked the host";
    const c10::Stream before = impl->exchangeStream(side);
    work.wait();
    EXPECT_LT(std::chrono::steady_clock::now() - issued, 5s)
        << "wait() blocked the host";
    EXPECT_FALSE(work.isCompleted());
    seen = out.clone();  // on `side`: after the op only if wait() joined it
    impl->exchangeStream(before);
    gate.open();
    work.wait(30s);
  }
  EXPECT_TRUE(torch::equal(seen.cpu(), in.cpu()));
}

// Blocking waits (ProcessGroupOptions::blockingWait) block the host until
// the GPU finished the op.
TEST(NcclTest, BlockingWaitBlocksTheHost) {
  REQUIRE_GPU();
  ProcessGroupOptions o;
  o.blockingWait = true;
  auto pg = makeGroup(o);
  auto t = torch::ones({1024}, kCuda0);
  pg->allreduce(t).wait();
  StreamGate gate(20s);
  auto work = pg->allreduce(t);
  std::thread opener([&gate] {
    std::this_thread::sleep_for(300ms);
    gate.open();
  });
  const auto start = std::chrono::steady_clock::now();
  work.wait();
  const auto waited = std::chrono::steady_clock::now() - start;
  opener.join();
  EXPECT_TRUE(work.isCompleted());
  EXPECT_GE(waited, 250ms);
}
#endif

TEST(NcclTest, CpuTensorIsRefusedAtTheCallSite) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  EXPECT_THROW(pg->allreduce(torch::ones({4})), InvalidArgumentError);
  std::vector<torch::Tensor> outs = {torch::zeros({4})};
  EXPECT_THROW(pg->allgather(outs, torch::ones({4}, kCuda0)),
               InvalidArgumentError);
  // The group is unharmed.
  pg->allreduce(torch::ones({4}, kCuda0)).wait();
}

TEST(NcclTest, TensorsOnTwoDevicesAreRefused) {
  REQUIRE_GPU();
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  if (n < 2) {
    GTEST_SKIP() << "needs two GPUs, " << n << " visible";
  }
  auto pg = makeGroup();
  std::vector<torch::Tensor> outs = {
      torch::zeros({4}, torch::TensorOptions(torch::Device(torch::kCUDA, 1)))};
  try {
    (void)pg->allgather(outs, torch::ones({4}, kCuda0));
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos)
        << e.what();
  }
}

TEST(NcclTest, WhatNcclLacksIsRefusedAtTheCallSite) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  auto t = torch::ones({4}, torch::TensorOptions(kCuda0).dtype(torch::kInt));
  for (ReduceOp op : {ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor}) {
    EXPECT_THROW(pg->allreduce(t, op), InvalidArgumentError) << toString(op);
  }
  EXPECT_THROW(pg->recvAnysource(t), InvalidArgumentError);
  pg->allreduce(t).wait();
}

// Work::wait() returns once the GPU finished, not at the watchdog's next
// tick (here 6 s, a tenth of the group's 60 s timeout): twenty ops in a row,
// each waited for, take less than one tick.
TEST(NcclTest, WaitDoesNotWaitForTheWatchdog) {
  REQUIRE_GPU();
  ASSERT_TRUE(kSlowWatchdog);
  auto pg = makeGroup();
  auto t = torch::ones({1024}, kCuda0);
  pg->allreduce(t).wait();  // the communicator exists
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) {
    auto work = pg->allreduce(t);
    work.wait(30s);
    EXPECT_TRUE(work.isCompleted());
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_TRUE(torch::equal(t.cpu(), torch::ones({1024})));
}

// A callback that drops the last owner of the group runs on the backend's
// completion thread, which then destroys the backend: nothing hangs or
// crashes, and the next group works.
TEST(NcclTest, LastOwnerDroppedInACompletionCallback) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  auto t = torch::ones({1024}, kCuda0);
  pg->allreduce(t).wait();
  std::mutex mu;
  std::condition_variable cv;
  bool dropped = false;
  StreamGate gate(20s);  // so the callback is attached before the op ends
  auto work = pg->allreduce(t);
  auto chained =
      work.future().then([held = std::move(pg), &mu, &cv,
                          &dropped](const std::vector<at::Tensor>&) mutable {
        held.reset();
        std::lock_guard<std::mutex> lock(mu);
        dropped = true;
        cv.notify_all();
      });
  gate.open();
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 30s, [&] { return dropped; }));
  }
  auto again = makeGroup();
  again->allreduce(t).wait(30s);
  EXPECT_TRUE(torch::equal(t.cpu(), torch::ones({1024})));
}

// An op that cannot start (its stream is held) fails at the group's
// timeout; the group is aborted and every later op fails with the same
// story.
TEST(NcclTest, WatchdogTimeoutAbortsTheGroup) {
  REQUIRE_GPU();
  ProcessGroupOptions o;
  o.timeout = 2s;
  o.watchdogMode = WatchdogMode::kFail;
  auto pg = makeGroup(o);
  auto t = torch::ones({1024}, kCuda0);
  pg->allreduce(t).wait();  // the communicator exists
  std::string story;
  {
    StreamGate gate(20s);
    auto work = pg->allreduce(t);
    const auto start = std::chrono::steady_clock::now();
    try {
      work.wait(30s);
      ADD_FAILURE() << "no error";
    } catch (const TimeoutError& e) {
      story = e.error().message();
      EXPECT_NE(story.find("allreduce"), std::string::npos) << story;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, 15s);
  }
  try {
    pg->allreduce(t).wait(30s);
    ADD_FAILURE() << "no error after the abort";
  } catch (const Exception& e) {
    EXPECT_EQ(e.error().message(), story);
  }
}

// Destroying the group with an op pending fails that op (CANCELLED).
TEST(NcclTest, DestroyedWithAnOpPending) {
  REQUIRE_GPU();
  auto pg = makeGroup();
  auto t = torch::ones({1024}, kCuda0);
  pg->allreduce(t).wait();
  StreamGate gate(10s);
  auto work = pg->allreduce(t);
  pg.reset();
  EXPECT_THROW(work.wait(30s), CancelledError);
}

}  // namespace
}  // namespace trellis::collectives
