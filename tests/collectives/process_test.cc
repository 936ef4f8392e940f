// Faults with real processes and real signals: three collectives_worker
// ranks over a TCPStore on loopback (fromEnvironment), one of them stopped,
// killed, absent or calling the wrong op. Each test ends only the
// processes it started (Job SIGKILLs and reaps its own children).
#include <chrono>
#include <filesystem>
#include <signal.h>
#include <string>
#include <sys/wait.h>
#include <vector>

#include <gtest/gtest.h>

#include "../netns_hosts.h"
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
    // Rank 2 stops right after it issued seq 5 (step 3's small
    // allreduce): its worker thread may still finish seq 5 with the others
    // before the stop lands, and then they wait in seq 6 (the large one).
    EXPECT_TRUE(
        line.find("seq 5 allreduce(float32[1024], sum)") != std::string::npos ||
        line.find("seq 6 allreduce(float32[262144], sum)") != std::string::npos)
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

// SIGKILLs `killed` (each has said "ready"); then every rank of
// `survivors` must print an UNAVAILABLE error naming each killed rank within
// 2 s, and end failing.
void killAndExpectNamed(Job& job, const std::vector<int>& killed,
                        const std::vector<int>& survivors) {
  for (int r : killed) {
    ASSERT_EQ(::kill(job[r].pid, SIGKILL), 0);
  }
  const auto at = Clock::now();
  for (int r : survivors) {
    const std::string line = lineStartingWith(job[r], "error: ", 5000);
    EXPECT_LT(Clock::now() - at, kSlow * 2s) << "rank " << r << ": " << line;
    for (int k : killed) {
      EXPECT_NE(line.find("rank " + std::to_string(k)), std::string::npos)
          << line;
    }
    EXPECT_NE(line.find("UNAVAILABLE"), std::string::npos) << line;
  }
  for (int r : survivors) {
    const int status = job[r].wait(10000);
    EXPECT_TRUE(endedFailing(status))
        << "rank " << r << ": " << statusText(status);
  }
}

TEST(CollectivesProcess, AKilledRankFailsTheOthersWithinTwoSecondsNamingIt) {
  Job job(kWorker, "kill", 3, {"timeout_ms=60000"});
  awaitStep(job, {2}, 2);
  ASSERT_EQ(lineStartingWith(job[2], "ready", 30000), "ready");
  killAndExpectNamed(job, {2}, {0, 1});
}

// Two of four ranks of one host (the shared-memory segment) killed
// together: the survivors, waiting in the segment, name both, not only the
// first they waited for.
TEST(CollectivesProcess, TwoKilledRanksOfOneHostAreBothNamed) {
  Job job(kWorker, "kill-two", 4, {"timeout_ms=60000"});
  for (int r : {2, 3}) {
    awaitStep(job, {r}, 2);
    ASSERT_EQ(lineStartingWith(job[r], "ready", 30000), "ready");
  }
  killAndExpectNamed(job, {2, 3}, {0, 1});
}

TEST(CollectivesProcess, ARankThatNeverCallsIsNamedAndEveryRankExits) {
  Job job(kWorker, "never", 3, {"timeout_ms=1500"});
  ASSERT_EQ(lineStartingWith(job[2], "skipping", 30000), "skipping")
      << job.stderrOf(2);
  for (int r : {0, 1}) {
    const std::string line = lineStartingWith(job[r], "error: ", 10000);
    EXPECT_NE(line.find("likely culprit: rank 2; rank 2 never entered seq 5; "
                        "it last started seq 4 allreduce(float32[262144], "
                        "sum), which completed"),
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

// The heartbeat in a real process: the store is a trellis-store process,
// frozen with SIGSTOP while the ranks allreduce on. The watchdog's next
// progress report blocks in the store; after the heartbeat timeout (1 s
// here) the monitor reports the watchdog stuck, naming the step and the
// group, and exit mode ends the process with 76, not with a collective
// timeout.
TEST(CollectivesProcess,
     AWatchdogStuckOnAFrozenStoreIsReportedAsSuchNotAsACollective) {
  Job probe(kWorker, "stall", 0);  // for its temp dir and job token only
  auto store = transport::testing::spawnHelper(
      TRELLIS_STORE_PATH, {"--host", "127.0.0.1", "--port", "0"},
      {"TRELLIS_JOB_TOKEN=" + probe.token()}, probe.path("store.err"));
  const std::string port = store->readLine(30000);
  ASSERT_FALSE(port.empty()) << rpc::testing::readFile(probe.path("store.err"));
  std::vector<std::unique_ptr<rpc::testing::Child>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(transport::testing::spawnHelper(
        kWorker,
        {"stall", "timeout_ms=60000", "interval_ms=200", "heartbeat_ms=1000"},
        {"RANK=" + std::to_string(r), "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
         "MASTER_PORT=" + port, "TRELLIS_JOB_TOKEN=" + probe.token()},
        probe.path("stall" + std::to_string(r) + ".err")));
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(lineStartingWith(*ranks[r], "step 3", 30000), "step 3")
        << rpc::testing::readFile(
               probe.path("stall" + std::to_string(r) + ".err"));
  }
  ASSERT_EQ(::kill(store->pid, SIGSTOP), 0);  // a pid this test started
  for (int r = 0; r < 2; ++r) {
    const int status = ranks[r]->wait(kSlow * 15000);
    const std::string err = rpc::testing::readFile(
        probe.path("stall" + std::to_string(r) + ".err"));
    EXPECT_TRUE(exitedWith(status, 76)) << statusText(status) << "\n" << err;
    EXPECT_NE(err.find("collectives watchdog stuck for"), std::string::npos)
        << err;
    EXPECT_NE(err.find("in store update of group 'default'"), std::string::npos)
        << err;
    EXPECT_EQ(err.find("timed out on rank"), std::string::npos) << err;
  }
  ::kill(store->pid, SIGCONT);
}

// Three "hosts": network namespaces this test creates, each with one veth
// into a bridge in a fourth, so the ranks talk TCP over real interfaces
// and only through them (each rank listens on its own address,
// TRELLIS_LOCAL_ADDR; rank 0's namespace hosts the store). Removed, with
// everything in them, when the test ends.
struct Hosts : trellis::testing::NetnsHosts {
  explicit Hosts(int n) : NetnsHosts(n, "trl", 77) {}
};

TEST(CollectivesProcess, RanksOnThreeNetworkHostsRunAndALostHostIsNamed) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "needs root to create network namespaces";
  }
  Hosts hosts(3);
  ASSERT_TRUE(hosts.ok()) << "could not create the network namespaces";
  Job probe(kWorker, "plain", 0);  // for its temp dir and job token only
  const auto start = [&](const std::string& scenario) {
    std::vector<std::unique_ptr<rpc::testing::Child>> ranks;
    for (int r = 0; r < 3; ++r) {
      ranks.push_back(transport::testing::spawnHelper(
          "/usr/sbin/ip",
          {"netns", "exec", hosts.ns("h" + std::to_string(r)), kWorker,
           scenario, "timeout_ms=60000"},
          {"RANK=" + std::to_string(r), "WORLD_SIZE=3",
           "MASTER_ADDR=" + hosts.address(0), "MASTER_PORT=29511",
           "TRELLIS_LOCAL_ADDR=" + hosts.address(r),
           "TRELLIS_JOB_TOKEN=" + probe.token()},
          probe.path(scenario + std::to_string(r) + ".err")));
    }
    return ranks;
  };
  {
    auto ranks = start("plain");
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(lineStartingWith(*ranks[r], "done", 60000), "done")
          << "rank " << r << ":\n"
          << rpc::testing::readFile(
                 probe.path("plain" + std::to_string(r) + ".err"));
    }
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(statusText(ranks[r]->wait(10000)), "exit 0") << "rank " << r;
    }
  }
  {
    auto ranks = start("kill");
    ASSERT_EQ(lineStartingWith(*ranks[2], "ready", 60000), "ready");
    ASSERT_EQ(::kill(ranks[2]->pid, SIGKILL), 0);
    const auto killed = Clock::now();
    for (int r : {0, 1}) {
      const std::string line = lineStartingWith(*ranks[r], "error: ", 10000);
      EXPECT_LT(Clock::now() - killed, kSlow * 2s) << line;
      EXPECT_NE(line.find("rank 2"), std::string::npos) << line;
    }
  }
}

// Two ranks on each of two network hosts: the hierarchical allreduce for
// real (each host's pair reduce in their segment, the leaders over TCP
// between the namespaces). Then a non-leader is killed inside the group:
// the others, on both hosts, fail within 2 s naming it.
TEST(CollectivesProcess, TwoRanksOnEachOfTwoNetworkHostsRunHierarchically) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "needs root to create network namespaces";
  }
  Hosts hosts(2);
  ASSERT_TRUE(hosts.ok()) << "could not create the network namespaces";
  Job probe(kWorker, "plain", 0);  // for its temp dir and job token only
  const auto start = [&](const std::string& scenario) {
    std::vector<std::unique_ptr<rpc::testing::Child>> ranks;
    for (int r = 0; r < 4; ++r) {
      ranks.push_back(transport::testing::spawnHelper(
          "/usr/sbin/ip",
          {"netns", "exec", hosts.ns("h" + std::to_string(r / 2)), kWorker,
           scenario, "timeout_ms=60000"},
          {"RANK=" + std::to_string(r), "WORLD_SIZE=4",
           "MASTER_ADDR=" + hosts.address(0), "MASTER_PORT=29512",
           "TRELLIS_LOCAL_ADDR=" + hosts.address(r / 2),
           "TRELLIS_JOB_TOKEN=" + probe.token()},
          probe.path(scenario + std::to_string(r) + ".err")));
    }
    return ranks;
  };
  {
    auto ranks = start("plain");
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(lineStartingWith(*ranks[r], "done", 60000), "done")
          << "rank " << r << ":\n"
          << rpc::testing::readFile(
                 probe.path("plain" + std::to_string(r) + ".err"));
    }
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(statusText(ranks[r]->wait(10000)), "exit 0") << "rank " << r;
    }
  }
  {
    // The kill scenario's victim is rank 2: host 1's leader.
    auto ranks = start("kill");
    ASSERT_EQ(lineStartingWith(*ranks[2], "ready", 60000), "ready");
    ASSERT_EQ(::kill(ranks[2]->pid, SIGKILL), 0);
    const auto killed = Clock::now();
    for (int r : {0, 1, 3}) {
      const std::string line = lineStartingWith(*ranks[r], "error: ", 10000);
      EXPECT_LT(Clock::now() - killed, kSlow * 2s) << "rank " << r << line;
      // Rank 1 waits for its leader, rank 0, in their segment. Rank 0 may
      // fail on rank 3's abort (rank 3 saw its leader leave) and exit at
      // once; it relays that abort to rank 1 before its pipe closes, so
      // rank 1 names rank 2 too, not only its departed leader.
      EXPECT_NE(line.find("rank 2"), std::string::npos)
          << "rank " << r << ": " << line;
    }
    for (int r : {0, 1, 3}) {
      EXPECT_TRUE(endedFailing(ranks[r]->wait(10000))) << "rank " << r;
    }
  }
}

}  // namespace
}  // namespace trellis::collectives
