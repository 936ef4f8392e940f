// Distributed autograd between real worker processes
// (dist_autograd_worker): a worker SIGKILLed while its part of the backward
// pass runs. The in-process tests are in dist_autograd_test.cc.

#include <arpa/inet.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <netinet/in.h>
#include <sstream>
#include <string>
#include <sys/socket.h>
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

}  // namespace
