// Faults with real processes and real signals: three collectives_worker
// ranks over a TCPStore on loopback (fromEnvironment), one of them stopped,
// killed, absent or calling the wrong op. Each test ends only the
// processes it started (Job SIGKILLs and reaps its own children).
#include <chrono>
#include <filesystem>
#include <signal.h>
#include <string>
#include <sys/wait.h>

#include <gtest/gtest.h>

#include "../rpc/worker_job.h"

namespace trellis::collectives {
namespace {

using namespace std::chrono_literals;
using rpc::testing::Job;
using rpc::testing::lineStartingWith;
using rpc::testing::waitUntilStopped;
using Clock = std::chrono::steady_clock;

const std::string kWorker = COLLECTIVES_WORKER_PATH;
// Bounds on how fast a failure is seen, stretched under AddressSanitizer.
#if defined(__SANITIZE_ADDRESS__)
constexpr int kSlow = 3;
#else
constexpr int kSlow = 1;
#endif
constexpr int kWatchdogExit = 75;

bool exitedWith(int status, int code) {
  return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == code;
}

// An op failed fast and the worker's own error path (exit 1) may end the
// process before the watchdog's next tick would (exit 75): either way it
// must end, not hang, and not with success.
bool endedFailing(int status) {
  return exitedWith(status, 1) || exitedWith(status, kWatchdogExit);
}

std::string statusText(int status) {
  if (status < 0) {
    return "still running";
  }
  if (WIFEXITED(status)) {
    return "exit " + std::to_string(WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) {
    return "signal " + std::to_string(WTERMSIG(status));
  }
  return "status " + std::to_string(status);
}

// Waits for "step <n>" from every rank in `ranks`.
void awaitStep(Job& job, std::initializer_list<int> ranks, int n) {
  for (int r : ranks) {
    ASSERT_EQ(lineStartingWith(job[r], "step " + std::to_string(n), 30000),
              "step " + std::to_string(n))
        << "rank " << r << " stderr:\n"
        << job.stderrOf(r);
  }
}

TEST(CollectivesProcess, AStoppedRankIsNamedWithinTheTimeoutAndAllDump) {
  Job probe(kWorker, "stop", 0);  // only for its temp dir
  const std::string dir = probe.path("flight");
  Job job(kWorker, "stop", 3, {"timeout_ms=2000", "dir=" + dir});
  awaitStep(job, {0, 1, 2}, 2);
  ASSERT_EQ(lineStartingWith(job[2], "stopping", 30000), "stopping");
  ASSERT_TRUE(waitUntilStopped(job[2].pid, 10s));
  const auto stopped = Clock::now();
  for (int r : {0, 1}) {
    const std::string line = lineStartingWith(job[r], "error: ", 10000);
    const auto after = Clock::now() - stopped;
    // Rank 2 stops right after it issued seq 3: its worker thread may
    // still finish seq 3 with the others before the stop lands, and then
    // they wait in seq 4.
    EXPECT_TRUE(
        line.find("seq 3 allreduce(float32[1024], sum)") != std::string::npos ||
        line.find("seq 4 allreduce(float32[1024], sum)") != std::string::npos)
        << line;
    EXPECT_NE(line.find("likely culprit: rank 2; rank 2 stopped reporting"),
              std::string::npos)
        << line;
    // The op started before the stop, so its timeout ends no later than
    // 2 s after it; a second more is the bound.
    EXPECT_LT(after, kSlow * 3s) << "rank " << r;
  }
  for (int r : {0, 1}) {
    // The rank whose watchdog fired first exits 75; the other may hear its
    // abort and unwind first.
    const int status = job[r].wait(10000);
    EXPECT_TRUE(endedFailing(status))
        << "rank " << r << ": " << statusText(status) << "\n"
        << job.stderrOf(r);
    EXPECT_TRUE(std::filesystem::exists(dir + "/default.1-rank" +
                                        std::to_string(r) + ".json"))
        << "rank " << r;
  }
  // The stopped rank could not write: it is the one without a file, and
  // the tool says so.
  EXPECT_FALSE(std::filesystem::exists(dir + "/default.1-rank2.json"));
  const std::string report = probe.path("report.txt");
  const int rc = std::system((std::string(FLIGHT_RECORDER_TOOL_PATH) + " " +
                              dir + " > " + report + " 2>&1")
                                 .c_str());
  const std::string text = rpc::testing::readFile(report);
  EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 1) << rc << "\n" << text;
  EXPECT_NE(text.find("no file from rank 2"), std::string::npos) << text;
  // Written as the watchdog fired: both still in the op.
  EXPECT_NE(text.find("first collective that did not complete everywhere: "
                      "seq "),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("likely culprit: rank 2"), std::string::npos) << text;
}

TEST(CollectivesProcess, AKilledRankFailsTheOthersWithinTwoSecondsNamingIt) {
  Job job(kWorker, "kill", 3, {"timeout_ms=60000"});
  awaitStep(job, {2}, 2);
  ASSERT_EQ(lineStartingWith(job[2], "ready", 30000), "ready");
  ASSERT_EQ(::kill(job[2].pid, SIGKILL), 0);
  const auto killed = Clock::now();
  for (int r : {0, 1}) {
    const std::string line = lineStartingWith(job[r], "error: ", 5000);
    EXPECT_LT(Clock::now() - killed, kSlow * 2s)
        << "rank " << r << ": " << line;
    EXPECT_NE(line.find("rank 2"), std::string::npos) << line;
    EXPECT_NE(line.find("UNAVAILABLE"), std::string::npos) << line;
  }
  for (int r : {0, 1}) {
    const int status = job[r].wait(10000);
    EXPECT_TRUE(endedFailing(status))
        << "rank " << r << ": " << statusText(status);
  }
}

TEST(CollectivesProcess, ARankThatNeverCallsIsNamedAndEveryRankExits) {
  Job job(kWorker, "never", 3, {"timeout_ms=1500"});
  ASSERT_EQ(lineStartingWith(job[2], "skipping", 30000), "skipping");
  for (int r : {0, 1}) {
    const std::string line = lineStartingWith(job[r], "error: ", 10000);
    EXPECT_NE(line.find("likely culprit: rank 2; rank 2 never entered seq 3; "
                        "it last started seq 2 allreduce(float32[1024], sum), "
                        "which completed"),
              std::string::npos)
        << line;
  }
  // The skipping rank is alive, in no op, and hears the abort: only the
  // watchdog can end it, and exit mode does, so a launcher restarts the
  // whole group. The others end through their own watchdog (75) or
  // through the worker's error path (1) if a peer's abort reached them
  // first.
  const int skipping = job[2].wait(10000);
  EXPECT_TRUE(exitedWith(skipping, kWatchdogExit))
      << statusText(skipping) << "\n"
      << job.stderrOf(2);
  EXPECT_NE(job.stderrOf(2).find("ending the process with exit code 75"),
            std::string::npos)
      << job.stderrOf(2);
  for (int r : {0, 1}) {
    const int status = job[r].wait(10000);
    EXPECT_TRUE(endedFailing(status))
        << "rank " << r << ": " << statusText(status) << "\n"
        << job.stderrOf(r);
  }
}

TEST(CollectivesProcess, DifferentOpsFailEveryRankAtOnceNamingBoth) {
  Job job(kWorker, "desync", 3, {"timeout_ms=60000"});
  const auto start = Clock::now();
  for (int r : {0, 1, 2}) {
    const std::string line = lineStartingWith(job[r], "error: ", 30000);
    EXPECT_NE(line.find("desync"), std::string::npos) << line;
    EXPECT_NE(line.find("allreduce(float32[1024], sum)"), std::string::npos)
        << line;
    EXPECT_NE(line.find("broadcast(float32[1024], root 1)"), std::string::npos)
        << line;
  }
  EXPECT_LT(Clock::now() - start, 30s);  // not the 60 s timeout
  for (int r : {0, 1, 2}) {
    const int status = job[r].wait(10000);
    EXPECT_TRUE(endedFailing(status))
        << "rank " << r << ": " << statusText(status);
  }
}

TEST(CollectivesProcess, FailModeKeepsTheProcessAndANewGroupWorks) {
  Job job(kWorker, "recover", 3, {"timeout_ms=1500", "mode=fail"});
  for (int r : {0, 1}) {
    const std::string line = lineStartingWith(job[r], "error: ", 30000);
    EXPECT_NE(line.find("likely culprit: rank 2"), std::string::npos) << line;
  }
  for (int r : {0, 1, 2}) {
    EXPECT_EQ(lineStartingWith(job[r], "recovered", 30000),
              "recovered 3.000000")
        << "rank " << r << ":\n"
        << job.stderrOf(r);
    const int status = job[r].wait(10000);
    EXPECT_TRUE(exitedWith(status, 0))
        << "rank " << r << ": " << statusText(status);
  }
}

}  // namespace
}  // namespace trellis::collectives
