// ThreadUsage: the calling thread's CPU time and voluntary waits.

#include <chrono>
#include <sched.h>
#include <thread>

#include <gtest/gtest.h>

#include <trellis/core/thread_usage.h>

namespace trellis {
namespace {

using namespace std::chrono_literals;

// Keeps this thread busy for `d` of wall time (no sleep).
void computeFor(Duration d) {
  const auto until = Clock::now() + d;
  while (Clock::now() < until) {
  }
}

// A stretch in which the thread only gave its CPU away (a sched_yield:
// what a thread preempted in the middle of an inline function does
// unasked) costs next to no CPU, however long the thread computed before
// it. getrusage's CPU time, which rpc/ once used, charged the computing
// before the stretch to it in 25 of 30 tries on the 2-core CI machine (up
// to 4 ms): it is brought up to date only at a tick or a switch, and the
// switch came inside the stretch.
TEST(ThreadUsageTest, AStretchAfterComputingCostsOnlyItsOwnCpu) {
  for (int i = 0; i < 30; ++i) {
    computeFor(3ms + std::chrono::microseconds(97 * i));
    const ThreadUsage a = ThreadUsage::now();
    ::sched_yield();
    const ThreadUsage b = ThreadUsage::now();
    EXPECT_LT(b.cpu - a.cpu, 1ms) << "try " << i;
    EXPECT_GE(b.cpu, a.cpu) << "try " << i;
  }
}

// CPU time moves with computing, no faster than the wall clock (one
// thread; the two clocks differ by some microseconds), and a sleep is a
// wait.
TEST(ThreadUsageTest, CountsComputingAndSleeping) {
  const auto t0 = Clock::now();
  const ThreadUsage a = ThreadUsage::now();
  while (ThreadUsage::now().cpu - a.cpu < 5ms) {
    ASSERT_LT(Clock::now() - t0, 10s) << "5 ms of CPU took over 10 s";
  }
  EXPECT_GE(Clock::now() - t0 + 100us, 5ms);
  const ThreadUsage b = ThreadUsage::now();
  std::this_thread::sleep_for(2ms);
  const ThreadUsage c = ThreadUsage::now();
  EXPECT_GE(c.waits - b.waits, 1);
  EXPECT_LT(c.cpu - b.cpu, 1ms);
}

}  // namespace
}  // namespace trellis
