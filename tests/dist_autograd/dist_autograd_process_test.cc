// Distributed autograd between real worker processes
// (dist_autograd_worker): a worker SIGKILLed while its part of the backward
// pass runs. The in-process tests are in dist_autograd_test.cc.

#include <arpa/inet.h>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <netinet/in.h>
#include <signal.h>
#include <sstream>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "../rpc/worker_job.h"
#include <trellis/core/auth.h>

using namespace std::chrono_literals;
using trellis::transport::testing::Child;

namespace {

using namespace trellis::rpc::testing;

TEST(DistAutogradProcess, WorkerKilledDuringBackwardFailsItNamingTheWorker) {
  Job job(DIST_AUTOGRAD_WORKER, "kill", 3);
  // w0 -> w1 -> w2 forward; w2's backward function blocks.
  ASSERT_EQ(lineStartingWith(job[0], "backward", 60000), "backward")
      << job.stderrOf(0);
  ASSERT_EQ(lineStartingWith(job[2], "blocking", 30000), "blocking")
      << job.stderrOf(2);
  const auto killedAt = Clock::now();
  ASSERT_EQ(::kill(job[2].pid, SIGKILL), 0);  // a pid this test started
  const int victim = job[2].wait(10000);
  EXPECT_TRUE(WIFSIGNALED(victim) && WTERMSIG(victim) == SIGKILL);

  const std::string err = lineStartingWith(job[0], "error ", 30000);
  ASSERT_FALSE(err.empty()) << job.stderrOf(0);
  EXPECT_TRUE(err.rfind("error ConnectionError ", 0) == 0 ||
              err.rfind("error RemoteError ", 0) == 0)
      << err;
  EXPECT_NE(err.find("w2"), std::string::npos) << err;
  const std::string at = lineStartingWith(job[0], "failed_at_ns ", 1000);
  ASSERT_FALSE(at.empty());
  // steady_clock is CLOCK_MONOTONIC, system-wide: the stamps compare.
  const auto failedAt =
      Clock::time_point(std::chrono::nanoseconds(std::stoll(at.substr(13))));
  std::printf(
      "backward failed %.1f ms after SIGKILL: %s\n",
      std::chrono::duration<double, std::milli>(failedAt - killedAt).count(),
      err.c_str());
  EXPECT_LT(failedAt - killedAt, 30s);  // a hang bound, not a speed check

  EXPECT_EQ(lineStartingWith(job[0], "released", 15000), "released w0=0 w1=0")
      << job.stderrOf(0) << job.stderrOf(1);
  EXPECT_EQ(lineStartingWith(job[0], "second", 20000), "second ok")
      << job.stderrOf(0) << job.stderrOf(1);
  const int s0 = job[0].wait(20000);
  const int s1 = job[1].wait(20000);
  EXPECT_TRUE(exitedZero(s0)) << job.stderrOf(0);
  EXPECT_TRUE(exitedZero(s1)) << job.stderrOf(1);
}

// Issue 14: with the ps SIGSTOPped, trainers died with SIGABRT
// ("ThreadPool::join() called from one of its own workers") once their
// calls timed out, in 2 of 3 runs. Every kind of call to a stopped peer
// must fail with a TimeoutError naming it and the function, and the caller
// must shut down and exit 0. Nine rounds (three under the sanitizers),
// taking turns: at once,
// a graceful shutdown bounded by 1 s, and none (the process agent is closed
// during static destruction with a call still pending): the abort was
// intermittent.
TEST(DistAutogradProcess,
     StoppedPeerTimesOutEveryCallAndTheCallerExitsCleanly) {
  const std::map<std::string, std::string> function = {
      {"rpcSync", "'addInts' to worker 'w0'"},
      {"rpcAsync", "'addInts' to worker 'w0'"},
      {"toHere", "toHere() of RRef"},
      // A number's toHere() waits for the remote()'s own reply: its own
      // timeout, or the remote()'s that started just before it.
      {"toHereNumber", "toHere() of RRef"},
      {"backward", "propagateGradients' to worker 'w0'"},
      {"step", "LocalOptimizer::step' to worker 'w0'"},
  };
  // The sanitizer builds run every shutdown mode once: their rounds are
  // 2-3x slower. The dev build runs each three times to hunt the abort,
  // which came in 2 of 3 runs when it was found (about 2.8 s a round).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  constexpr int kRounds = 3;
#else
  constexpr int kRounds = 9;
#endif
  for (int i = 0; i < kRounds; ++i) {
    const std::string mode = std::array{"now", "graceful", "exit"}[i % 3];
    SCOPED_TRACE("round " + std::to_string(i) + ", shutdown " + mode);
    Job job(DIST_AUTOGRAD_WORKER, "stopped", 2, {mode, "{dir}/go"});
    // Both ranks' logs on a failure: rank 0's init waits for rank 1's.
    ASSERT_EQ(lineStartingWith(job[0], "serving", 60000), "serving")
        << "rank 0:\n"
        << job.stderrOf(0) << "rank 1:\n"
        << job.stderrOf(1);
    ASSERT_EQ(lineStartingWith(job[1], "ready", 60000), "ready")
        << "rank 0:\n"
        << job.stderrOf(0) << "rank 1:\n"
        << job.stderrOf(1);
    ASSERT_EQ(::kill(job[0].pid, SIGSTOP), 0);  // a pid this test started
    ASSERT_TRUE(waitUntilStopped(job[0].pid, 5000ms));
    std::ofstream(job.path("go")) << "go\n";
    std::map<std::string, std::string> ops;
    for (size_t k = 0; k < function.size() + 1; ++k) {
      const std::string line = lineStartingWith(job[1], "op ", 20000);
      ASSERT_FALSE(line.empty()) << job.stderrOf(1);
      const size_t sp = line.find(' ', 3);
      ops[line.substr(3, sp - 3)] = line;
    }
    for (const auto& [op, fn] : function) {
      SCOPED_TRACE(op);
      ASSERT_EQ(ops.count(op), 1u);
      const std::string& line = ops[op];
      // "op NAME TimeoutError MS what"
      const std::string head = "op " + op + " TimeoutError ";
      ASSERT_EQ(line.rfind(head, 0), 0u) << line;
      const int ms = std::stoi(line.substr(head.size()));
      EXPECT_LT(ms, 5000) << line;  // a hang bound; the call timeout is 1 s
      EXPECT_NE(line.find(fn), std::string::npos) << line;
      EXPECT_NE(line.find("'w0'"), std::string::npos) << line;
      EXPECT_NE(line.find("timed out after 1s"), std::string::npos) << line;
    }
    // The caller's own wait, not the call, timed out: that is all it says.
    EXPECT_EQ(ops["abandoned"].rfind("op abandoned TimeoutError ", 0), 0u)
        << ops["abandoned"];
    const std::string shut = lineStartingWith(job[1], "shutdown ", 20000);
    if (mode == "now") {
      EXPECT_EQ(shut, "shutdown ok");
    } else if (mode == "exit") {
      EXPECT_EQ(shut, "shutdown skipped");
    } else {
      // w0 serves the store and is stopped: the shutdown names it.
      EXPECT_EQ(shut.rfind("shutdown TimeoutError ", 0), 0u) << shut;
      EXPECT_NE(shut.find("worker 'w0' (rank 0)"), std::string::npos) << shut;
    }
    if (i < 2) {
      for (const auto& [op, line] : ops) {
        std::printf("%s\n", line.c_str());
      }
      std::printf("%s\n", shut.c_str());
    }
    const int status = job[1].wait(20000);
    EXPECT_TRUE(exitedZero(status)) << "status " << status << "\n"
                                    << job.stderrOf(1);
    if (HasFailure()) {
      break;
    }
  }
}

}  // namespace
