// trellis::init and Job::shutdown with real processes under elastic-run
// (tests/job/job_worker.cc): a hybrid start-up, an uncaught exception shown
// in the launcher's summary, the start-up mistakes named at once (world
// size, ranks that start differently, a rank that never comes), and the
// exit barrier (rank 0 serves the store until the others are done, or says
// whom it waited for). Every wait is bounded; the test ends only the
// elastic-run it started, by pid (the agent ends its workers).

#include <chrono>
#include <filesystem>
#include <string>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "../elastic/elastic_test_util.h"
#include "../transport/peer_process.h"
#include <trellis/core/text.h>

using namespace std::chrono_literals;
using trellis::elastic::testing::exitCode;
using trellis::elastic::testing::readFile;
using trellis::transport::testing::spawnHelper;
using Clock = std::chrono::steady_clock;

namespace {

struct JobRun {
  int status = -1;
  std::string err;  // the agent's and the workers' stderr
  Clock::duration took{};
};

// elastic-run --standalone --nproc-per-node <nproc> --max-restarts 0
// job_worker --mode <mode>, to its end (bounded).
JobRun launch(const std::string& mode, int nproc = 2) {
  static int counter = 0;
  const auto dir = std::filesystem::temp_directory_path() /
                   ("trellis_job_test_" + std::to_string(::getpid()) + "_" +
                    std::to_string(counter++));
  std::filesystem::create_directories(dir);
  const auto start = Clock::now();
  auto child =
      spawnHelper(ELASTIC_RUN,
                  {"--standalone", "--nproc-per-node", std::to_string(nproc),
                   "--max-restarts", "0", JOB_WORKER, "--mode", mode},
                  {"OMP_NUM_THREADS=1"}, dir / "err.txt");
  JobRun run;
  run.status = child->wait(90'000);
  run.took = Clock::now() - start;
  run.err = readFile(dir / "err.txt");
  trellis::removeTree(dir);
  return run;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(Init, HybridJobStartsRpcAndATrainersGroupAndEndsWell) {
  const JobRun run = launch("hybrid", 3);
  ASSERT_EQ(exitCode(run.status), 0) << run.err;
  // Trainers are ranks 1 and 2, group ranks 0 and 1: 1 + 2 = 3.
  EXPECT_TRUE(
      has(run.err, "rank 1: allreduce 3.000000 group rank 0 of 2 rpc 11"))
      << run.err;
  EXPECT_TRUE(
      has(run.err, "rank 2: allreduce 3.000000 group rank 1 of 2 rpc 12"))
      << run.err;
  EXPECT_TRUE(has(run.err, "rank 0: serving")) << run.err;
}

TEST(Init, AnUncaughtExceptionIsInTheLaunchersSummary) {
  const JobRun run = launch("throw");
  EXPECT_EQ(exitCode(run.status), 1) << run.err;
  EXPECT_TRUE(has(run.err, "first failure: local rank 1 (rank 1")) << run.err;
  EXPECT_TRUE(has(run.err, "exited with code 1")) << run.err;
  EXPECT_TRUE(
      has(run.err, "message: std::runtime_error: boom after init on rank 1"))
      << run.err;
  EXPECT_FALSE(has(run.err, "none written")) << run.err;
}

TEST(Init, AWorldSizeThatDisagreesIsNamedAtOnce) {
  const JobRun run = launch("world");
  EXPECT_EQ(exitCode(run.status), 1) << run.err;
  EXPECT_TRUE(has(run.err,
                  "trellis::init: the program expects 3 processes "
                  "(InitOptions::worldSize) but the launcher started 2"))
      << run.err;
  EXPECT_LT(run.took, 20s);
}

TEST(Init, RanksThatStartDifferentlyAreNamed) {
  const JobRun run = launch("differ");
  EXPECT_EQ(exitCode(run.status), 1) << run.err;
  EXPECT_TRUE(has(run.err,
                  "rank 0 starts RPC as 'w0', process group: cpu over every "
                  "rank; rank 1 starts no RPC, process group: cpu over every "
                  "rank"))
      << run.err;
  EXPECT_LT(run.took, 20s);
}

TEST(Init, ARankThatNeverComesIsNamedAtTheInitTimeout) {
  const JobRun run = launch("late");
  EXPECT_EQ(exitCode(run.status), 1) << run.err;
  EXPECT_TRUE(has(run.err, "first failure: local rank 0 (rank 0")) << run.err;
  EXPECT_TRUE(has(run.err,
                  "rank [1] of 2 did not reach init within 1s "
                  "(InitOptions::initTimeout)"))
      << run.err;
}

TEST(Init, RankZeroServesTheStoreUntilTheOthersAreDone) {
  const JobRun run = launch("exit-slow");
  ASSERT_EQ(exitCode(run.status), 0) << run.err;
  EXPECT_TRUE(has(run.err, "rank 1: store says still served")) << run.err;
  EXPECT_TRUE(has(run.err, "rank 0: job exit code 3")) << run.err;
}

TEST(Init, AJobLeftByAnExceptionEndsWithoutAGracefulWait) {
  const JobRun run = launch("unwind");
  ASSERT_EQ(exitCode(run.status), 0) << run.err;
  EXPECT_TRUE(has(run.err, "rank 1: caught: rank 1 gives up")) << run.err;
  EXPECT_TRUE(has(run.err, "rank 0: job exit code 1")) << run.err;
}

// Nothing Trellis opens in a worker (the store's listener and
// connections, RPC's and the group's sockets, shared memory, eventfds) nor
// anything of the agent's reaches a program the worker starts.
TEST(Init, AProgramAWorkerStartsInheritsNoDescriptorOfTrellis) {
  const JobRun run = launch("fds");
  ASSERT_EQ(exitCode(run.status), 0) << run.err;
  EXPECT_TRUE(has(run.err, "rank 0: inherited: none")) << run.err;
  EXPECT_TRUE(has(run.err, "rank 1: inherited: none")) << run.err;
}

TEST(Init, TheExitBarrierNamesTheRankItWaitedFor) {
  const JobRun run = launch("exit-timeout");
  EXPECT_EQ(exitCode(run.status), 1) << run.err;
  EXPECT_TRUE(has(run.err,
                  "rank 0: DEADLINE_EXCEEDED: trellis::Job::shutdown: "
                  "rank 0 waited 1s (InitOptions::exitTimeout) for "
                  "ranks [1] to finish"))
      << run.err;
}

}  // namespace
