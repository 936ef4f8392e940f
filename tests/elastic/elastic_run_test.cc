// elastic-run with real processes and real signals: the worker environment,
// a restart, a spent budget, SIGTERM and SIGKILL to the agent, a missing
// program, two standalone agents at once, the command line's errors, and
// the log layout. Every wait is bounded; the test ends only the processes
// it started (by pid).

#include <arpa/inet.h>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <netinet/in.h>
#include <sstream>
#include <string>
#include <sys/socket.h>
#include <sys/wait.h>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "../fd_listing.h"
#include "../port_reservation.h"
#include "../transport/peer_process.h"
#include "elastic_test_util.h"
#include <trellis/core/text.h>
#include <trellis/elastic/agent.h>

using namespace std::chrono_literals;
using trellis::transport::testing::Child;
using trellis::transport::testing::spawnHelper;
using Clock = std::chrono::steady_clock;

using namespace trellis::elastic::testing;

namespace {

// Gone: no /proc entry, or a zombie nobody reaped yet (it runs no code).
bool processGone(pid_t pid) {
  const std::string stat = readFile("/proc/" + std::to_string(pid) + "/stat");
  if (stat.empty()) {
    return true;
  }
  const auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() &&
         (stat[close + 2] == 'Z' || stat[close + 2] == 'X');
}

bool waitGone(pid_t pid, std::chrono::milliseconds bound) {
  const auto end = Clock::now() + bound;
  while (!processGone(pid)) {
    if (Clock::now() >= end) {
      return false;
    }
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

// One elastic-run in a temp folder of its own: workers write there, logs go
// to <dir>/logs, the agent's stderr to <dir>/agent.err.
class AgentRun {
 public:
  AgentRun() {
    static int counter = 0;
    dir_ = std::filesystem::temp_directory_path() /
           ("trellis_elastic_run_" + std::to_string(::getpid()) + "_" +
            std::to_string(counter++));
    std::filesystem::create_directories(dir_);
  }
  ~AgentRun() {
    child_.reset();  // SIGKILLs and reaps the agent if it is still there
    for (pid_t pid : workerPids_) {
      // A worker that outlived the test's checks: end it, ours by pid.
      if (!processGone(pid)) {
        ::kill(pid, SIGKILL);
      }
    }
    trellis::removeTree(dir_);
  }

  // elastic-run <flags> --log-dir <dir>/logs <worker> <workerArgs>
  void start(std::vector<std::string> flags,
             const std::vector<std::string>& workerArgs,
             std::vector<std::string> env = {},
             const std::string& program = ELASTIC_TEST_WORKER) {
    flags.push_back("--log-dir");
    flags.push_back(dir_ / "logs");
    flags.push_back(program);
    flags.insert(flags.end(), workerArgs.begin(), workerArgs.end());
    env.push_back("OMP_NUM_THREADS=1");
    child_ = spawnHelper(ELASTIC_RUN, flags, env, dir_ / "agent.err");
  }
  // The agent's wait status; -1 (and a failure) past the bound.
  int wait(std::chrono::milliseconds bound = 30s) {
    return child_->wait(static_cast<int>(bound.count()));
  }
  Child& agent() { return *child_; }
  std::filesystem::path dir() const { return dir_; }
  std::string agentErr() const { return readFile(dir_ / "agent.err"); }
  std::string agentOut() {
    std::string all;
    for (std::string line; !(line = child_->readLine(200)).empty();) {
      all += line + "\n";
    }
    return all;
  }
  std::map<std::string, std::string> env(int rank, int restart) const {
    return readEnvFile(dir_ / ("env_" + std::to_string(rank) + "_" +
                               std::to_string(restart) + ".txt"));
  }
  // Waits (bounded) for the workers of `restart` to write their pids.
  std::vector<pid_t> workerPids(int nproc, int restart,
                                std::chrono::milliseconds bound = 20s) {
    std::vector<pid_t> pids;
    const auto end = Clock::now() + bound;
    for (int r = 0; r < nproc; ++r) {
      const auto path =
          dir_ / ("pid_" + std::to_string(r) + "_" + std::to_string(restart));
      while (!std::filesystem::exists(path) && Clock::now() < end) {
        std::this_thread::sleep_for(10ms);
      }
      const pid_t pid = static_cast<pid_t>(std::atoi(readFile(path).c_str()));
      EXPECT_GT(pid, 0) << "rank " << r << " wrote no pid";
      pids.push_back(pid);
      workerPids_.push_back(pid);
    }
    return pids;
  }

 private:
  std::filesystem::path dir_;
  std::unique_ptr<Child> child_;
  std::vector<pid_t> workerPids_;
};

TEST(ElasticRun, TwoWorkersSucceedWithTorchrunsEnvironment) {
  AgentRun run;
  run.start({"--standalone", "--nproc-per-node", "2"},
            {"--dir", run.dir().string()});
  EXPECT_EQ(exitCode(run.wait()), 0) << run.agentErr();
  const auto e0 = run.env(0, 0);
  const auto e1 = run.env(1, 0);
  ASSERT_FALSE(e0.empty());
  ASSERT_FALSE(e1.empty());
  for (const auto& [rank, e] : {std::pair{0, e0}, std::pair{1, e1}}) {
    EXPECT_EQ(e.at("RANK"), std::to_string(rank));
    EXPECT_EQ(e.at("LOCAL_RANK"), std::to_string(rank));
    EXPECT_EQ(e.at("WORLD_SIZE"), "2");
    EXPECT_EQ(e.at("LOCAL_WORLD_SIZE"), "2");
    EXPECT_EQ(e.at("TORCHELASTIC_RESTART_COUNT"), "0");
    EXPECT_EQ(e.at("TORCHELASTIC_USE_AGENT_STORE"), "False");
    EXPECT_EQ(e.at("MASTER_ADDR"), "127.0.0.1");
    EXPECT_GT(std::stoi(e.at("MASTER_PORT")), 0);
    EXPECT_NE(e.at("MASTER_PORT"), "29500");  // --standalone picks a free one
    EXPECT_EQ(e.at("TORCHELASTIC_ERROR_FILE")
                  .rfind((run.dir() / "logs").string() + "/", 0),
              0u);
    EXPECT_NE(e.at("TORCHELASTIC_ERROR_FILE")
                  .find("/attempt_0/" + std::to_string(rank) + "/error.json"),
              std::string::npos);
  }
  EXPECT_EQ(e0.at("MASTER_PORT"), e1.at("MASTER_PORT"));
  EXPECT_EQ(e0.at("TORCHELASTIC_RUN_ID"), e1.at("TORCHELASTIC_RUN_ID"));
  EXPECT_FALSE(e0.at("TRELLIS_JOB_TOKEN").empty());
  EXPECT_EQ(e0.at("TRELLIS_JOB_TOKEN"), e1.at("TRELLIS_JOB_TOKEN"));
}

TEST(ElasticRun, StaticSingleNodeUsesMasterPort) {
  AgentRun run;
  run.start(
      {"--nnodes", "1", "--nproc-per-node", "1", "--master-port", "29577"},
      {"--dir", run.dir().string()});
  EXPECT_EQ(exitCode(run.wait()), 0) << run.agentErr();
  EXPECT_EQ(run.env(0, 0).at("MASTER_PORT"), "29577");
  EXPECT_EQ(run.env(0, 0).at("TORCHELASTIC_RUN_ID"), "none");
}

// c10d on one node: a Trellis worker gets the agent's store (the endpoint,
// TORCHELASTIC_USE_AGENT_STORE=True); a Python worker does not (torch's
// TCPStore cannot talk to ours): its rank 0 serves on another port, and
// the agent says why.
TEST(ElasticRun, C10dSharesTheAgentStoreExceptWithPythonWorkers) {
  const trellis::testing::PortReservation reserved;
  const std::string port = std::to_string(reserved.port());
  const std::vector<std::string> flags = {
      "--nnodes",       "1",    "--nproc-per-node", "1",
      "--rdzv-backend", "c10d", "--rdzv-endpoint",  "127.0.0.1:" + port,
      "--rdzv-id",      "one"};
  {
    AgentRun run;
    run.start(flags, {"--dir", run.dir().string(), "--store"});
    EXPECT_EQ(exitCode(run.wait()), 0) << run.agentErr();
    const auto e = run.env(0, 0);
    ASSERT_FALSE(e.empty()) << run.agentErr();
    EXPECT_EQ(e.at("TORCHELASTIC_USE_AGENT_STORE"), "True");
    EXPECT_EQ(e.at("MASTER_PORT"), port);
    const auto st = readEnvFile(run.dir() / "store_0_0.txt");
    ASSERT_FALSE(st.empty()) << run.agentErr();
    EXPECT_EQ(st.at("server"), "0");
    EXPECT_EQ(st.at("prefix"), "/worker/attempt_0/round_0");
  }
  {
    AgentRun run;
    const std::string out = (run.dir() / "py.txt").string();
    run.start(flags,
              {"-c",
               "import os, sys; open(sys.argv[1], 'w').write("
               "os.environ['TORCHELASTIC_USE_AGENT_STORE'] + ' ' + "
               "os.environ['MASTER_PORT'] + ' ' + "
               "str('TRELLIS_RDZV_ROUND' in os.environ))",
               out},
              {}, "/usr/bin/python3");
    EXPECT_EQ(exitCode(run.wait()), 0) << run.agentErr();
    const std::string got = readFile(out);
    EXPECT_EQ(got.substr(0, 6), "False ") << got;
    EXPECT_NE(got.substr(6, port.size() + 1), port + " ") << got;
    EXPECT_NE(got.find(" False"), std::string::npos) << got;
    EXPECT_NE(
        run.agentErr().find("the workers run Python ('/usr/bin/python3')"),
        std::string::npos)
        << run.agentErr();
  }
}

TEST(ElasticRun, CrashOnceRestartsTheGroup) {
  AgentRun run;
  run.start(
      {"--standalone", "--nproc-per-node", "2", "--max-restarts", "1"},
      {"--dir", run.dir().string(), "--fail-rank", "1", "--fail-restart", "0"});
  EXPECT_EQ(exitCode(run.wait()), 0) << run.agentErr();
  EXPECT_EQ(run.env(0, 1).at("TORCHELASTIC_RESTART_COUNT"), "1");
  EXPECT_EQ(run.env(1, 1).at("TORCHELASTIC_RESTART_COUNT"), "1");
  EXPECT_EQ(run.env(1, 1).at("TORCHELASTIC_MAX_RESTARTS"), "1");
  EXPECT_NE(run.agentErr().find("restarting the worker group"),
            std::string::npos)
      << run.agentErr();
}

TEST(ElasticRun, BudgetSpentNamesTheFirstFailureAndItsMessage) {
  AgentRun run;
  run.start(
      {"--standalone", "--nproc-per-node", "2", "--max-restarts", "1"},
      {"--dir", run.dir().string(), "--fail-rank", "1", "--sleep-ms", "10000"});
  const int status = run.wait();
  EXPECT_EQ(exitCode(status), 1) << run.agentErr();
  const std::string err = run.agentErr();
  EXPECT_NE(err.find("failed after 2 attempt(s)"), std::string::npos) << err;
  EXPECT_NE(err.find("first failure: local rank 1 (rank 1"), std::string::npos)
      << err;
  EXPECT_NE(err.find("exited with code 3"), std::string::npos) << err;
  EXPECT_NE(err.find("message: std::runtime_error: boom from rank 1"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("local rank 0: killed by signal 15 (SIGTERM) (stopped "
                     "by the agent)"),
            std::string::npos)
      << err;
  // Both attempts ran, with their own error files.
  EXPECT_EQ(run.env(1, 1).at("TORCHELASTIC_RESTART_COUNT"), "1");
}

// The root cause is the earliest error, as torchrun picks it: rank 1
// records its error and is slow to go; rank 0 fails 1.5 s later because of
// it (no error file) and is the first to end. The summary names rank 1, and
// rank 0 as what followed.
TEST(ElasticRun, TheSummaryNamesTheEarliestErrorNotTheFirstToExit) {
  AgentRun run;
  run.start({"--standalone", "--nproc-per-node", "2", "--max-restarts", "0"},
            {"--fail-rank", "1", "--fail-after-ms", "20000", "--exit-rank",
             "0", "--exit-code", "5", "--sleep-ms", "1500"},
            {"TRELLIS_ELASTIC_STOP_GRACE_S=2"});
  EXPECT_EQ(exitCode(run.wait()), 1) << run.agentErr();
  const std::string err = run.agentErr();
  EXPECT_NE(err.find("first failure: local rank 1 (rank 1"), std::string::npos)
      << err;
  EXPECT_NE(err.find("message: std::runtime_error: boom from rank 1"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("local rank 0: exited with code 5"), std::string::npos)
      << err;
}

// A worker's message too big for an error file still reaches the agent's
// summary, cut (the writer keeps within the reader's bound); a file the
// reader refuses is named in the agent's log.
TEST(ElasticRun, AHugeMessageIsCutAndABadErrorFileIsNamed) {
  {
    AgentRun run;
    run.start({"--standalone", "--nproc-per-node", "1"},
              {"--dir", run.dir().string(), "--fail-rank", "0", "--fail-pad",
               "3000000"});
    EXPECT_EQ(exitCode(run.wait()), 1) << run.agentErr().substr(0, 2000);
    const std::string err = run.agentErr();
    EXPECT_NE(err.find("message: std::runtime_error: boom from rank 0xxx"),
              std::string::npos)
        << err.substr(0, 2000);
    // The summary shows the head; the file keeps what fits in it.
    EXPECT_NE(err.find("bytes; the error file has more]"), std::string::npos);
    EXPECT_LT(err.size(), size_t{64} << 10);
    EXPECT_EQ(err.find("not usable"), std::string::npos);
  }
  {
    AgentRun run;
    run.start(
        {"--standalone", "--nproc-per-node", "1"},
        {"--dir", run.dir().string(), "--fail-rank", "0", "--fail-garbage"});
    EXPECT_EQ(exitCode(run.wait()), 1) << run.agentErr();
    const std::string err = run.agentErr();
    EXPECT_NE(err.find("local rank 0: its error file is not usable: "),
              std::string::npos)
        << err;
    EXPECT_NE(err.find("exited with code 3"), std::string::npos) << err;
  }
}

TEST(ElasticRun, SigtermStopsEveryWorkerAndExits143) {
  AgentRun run;
  run.start({"--standalone", "--nproc-per-node", "2"},
            {"--dir", run.dir().string(), "--sleep-ms", "60000"},
            {"TRELLIS_ELASTIC_STOP_GRACE_S=2"});
  const auto pids = run.workerPids(2, 0);
  ASSERT_EQ(::kill(run.agent().pid, SIGTERM), 0);
  const int status = run.wait(2s + 5s);
  EXPECT_EQ(exitCode(status), 128 + SIGTERM) << run.agentErr();
  for (pid_t pid : pids) {
    EXPECT_TRUE(processGone(pid)) << "worker " << pid << " survived";
  }
  EXPECT_NE(run.agentErr().find("got SIGTERM"), std::string::npos);
  EXPECT_NE(run.agentErr().find("elastic-run: error: stopped by SIGTERM while "
                                "the workers ran; they were stopped\n"),
            std::string::npos)
      << run.agentErr();
}

TEST(ElasticRun, WorkerIgnoringTheSignalIsKilledAfterTheGrace) {
  AgentRun run;
  run.start(
      {"--standalone", "--nproc-per-node", "2"},
      {"--dir", run.dir().string(), "--sleep-ms", "60000", "--ignore-signals"},
      {"TRELLIS_ELASTIC_STOP_GRACE_S=1"});
  const auto pids = run.workerPids(2, 0);
  const auto start = Clock::now();
  ASSERT_EQ(::kill(run.agent().pid, SIGINT), 0);
  const int status = run.wait(1s + 5s);
  EXPECT_EQ(exitCode(status), 128 + SIGINT) << run.agentErr();
  EXPECT_GE(Clock::now() - start, 900ms);  // the grace was given
  for (pid_t pid : pids) {
    EXPECT_TRUE(processGone(pid)) << "worker " << pid << " survived";
  }
  EXPECT_NE(run.agentErr().find("sending SIGKILL"), std::string::npos)
      << run.agentErr();
}

TEST(ElasticRun, NoWorkerSurvivesAnAgentThatIsKilled) {
  AgentRun run;
  run.start(
      {"--standalone", "--nproc-per-node", "2"},
      {"--dir", run.dir().string(), "--sleep-ms", "60000", "--ignore-signals"});
  const auto pids = run.workerPids(2, 0);
  ASSERT_EQ(::kill(run.agent().pid, SIGKILL), 0);
  run.wait(5s);
  for (pid_t pid : pids) {
    EXPECT_TRUE(waitGone(pid, 5s)) << "worker " << pid << " survived";
  }
}

// What a worker starts goes with a SIGKILLed agent (the keeper ends the
// worker's process group), and a worker gets stdin, stdout and stderr of
// the agent's descriptors and nothing else, so a child that left the group
// (setsid) and outlives the agent does not hold the agent's rendezvous
// port: a relaunch could host the endpoint again.
TEST(ElasticRun, AKilledAgentTakesItsWorkersChildrenAndLeavesItsPortFree) {
  const trellis::testing::PortReservation reserved;
  const std::string port = std::to_string(reserved.port());
  AgentRun run;
  const auto grouped = run.dir() / "grouped";
  const auto escaped = run.dir() / "escaped";
  const auto fdsFile = run.dir() / "fds";
  run.start({"--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend",
             "c10d", "--rdzv-endpoint", "127.0.0.1:" + port, "--rdzv-id",
             "orphans"},
            {"-c", "ls -l /proc/self/fd > " + fdsFile.string() +
                       "; sleep 40 & echo $! > " + grouped.string() +
                       "; setsid sleep 40 & echo $! > " + escaped.string() +
                       "; wait"},
            {}, "/bin/sh");
  auto readPid = [](const std::filesystem::path& file) {
    pid_t pid = 0;
    const auto end = Clock::now() + 20s;
    while (pid <= 0 && Clock::now() < end) {
      pid = static_cast<pid_t>(std::atoi(readFile(file).c_str()));
      std::this_thread::sleep_for(10ms);
    }
    return pid;
  };
  const pid_t child = readPid(grouped);
  const pid_t loner = readPid(escaped);
  ASSERT_GT(child, 0) << run.agentErr();
  ASSERT_GT(loner, 0) << run.agentErr();
  // What the worker's shell passed on to ls: 0, 1, 2 and ls's own
  // listing of /proc/self/fd, nothing else.
  const std::string fds = readFile(fdsFile);
  const auto listed = trellis::testing::parseFdListing(fds);
  int others = 0;
  for (const auto& [fd, target] : listed) {
    others += fd > 2 && target.rfind("/proc/", 0) != 0;
  }
  EXPECT_EQ(others, 0) << fds;
  EXPECT_EQ(listed.count(2), 1u) << fds;

  ASSERT_EQ(::kill(run.agent().pid, SIGKILL), 0);
  run.wait(5s);
  EXPECT_TRUE(waitGone(child, 5s)) << "the worker's child outlived the agent";
  EXPECT_FALSE(processGone(loner)) << "setsid's child left the group";
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(reserved.port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool bound =
      ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::listen(fd, 1) == 0;
  const int err = errno;
  ::close(fd);
  // Started by this test's worker; by pid.
  for (pid_t pid : {child, loner}) {
    if (!processGone(pid)) {
      ::kill(pid, SIGKILL);
    }
  }
  EXPECT_TRUE(waitGone(loner, 5s));
  EXPECT_TRUE(bound) << "the port is held after the agent died: "
                     << std::strerror(err);
}

TEST(ElasticRun, MissingProgramIsNamed) {
  AgentRun run;
  run.start({"--standalone", "--nproc-per-node", "2", "--max-restarts", "3"},
            {}, {}, "/nonexistent/trellis_no_such_program");
  EXPECT_EQ(exitCode(run.wait()), 127) << run.agentErr();
  EXPECT_NE(
      run.agentErr().find("cannot run '/nonexistent/trellis_no_such_program'"),
      std::string::npos)
      << run.agentErr();
  EXPECT_NE(run.agentErr().find("No such file or directory"),
            std::string::npos);
  EXPECT_EQ(run.agentErr().find("restarting"), std::string::npos);
}

TEST(ElasticRun, TwoStandaloneAgentsPickDifferentPorts) {
  AgentRun a;
  AgentRun b;
  a.start({"--standalone", "--nproc-per-node", "1"},
          {"--dir", a.dir().string(), "--sleep-ms", "300"});
  b.start({"--standalone", "--nproc-per-node", "1"},
          {"--dir", b.dir().string(), "--sleep-ms", "300"});
  EXPECT_EQ(exitCode(a.wait()), 0) << a.agentErr();
  EXPECT_EQ(exitCode(b.wait()), 0) << b.agentErr();
  EXPECT_NE(a.env(0, 0).at("MASTER_PORT"), b.env(0, 0).at("MASTER_PORT"));
  EXPECT_NE(a.env(0, 0).at("TORCHELASTIC_RUN_ID"),
            b.env(0, 0).at("TORCHELASTIC_RUN_ID"));
}

TEST(ElasticRun, TeePrefixesLinesAndLogDirHoldsEachAttempt) {
  AgentRun run;
  run.start({"--standalone", "--nproc-per-node", "2", "--tee", "1",
             "--local-ranks-filter", "1"},
            {"--print", "hello"});
  EXPECT_EQ(exitCode(run.wait()), 0) << run.agentErr();
  const std::string out = run.agentOut();
  EXPECT_NE(out.find("[default1]:hello"), std::string::npos) << out;
  EXPECT_EQ(out.find("[default0]:"), std::string::npos) << out;
  // The files hold every rank's raw lines, filter or not.
  std::vector<std::filesystem::path> runDirs;
  for (const auto& e :
       std::filesystem::directory_iterator(run.dir() / "logs")) {
    runDirs.push_back(e.path());
  }
  ASSERT_EQ(runDirs.size(), 1u);
  for (int r : {0, 1}) {
    const auto d = runDirs[0] / "attempt_0" / std::to_string(r);
    EXPECT_EQ(readFile(d / "stdout.log"), "hello\n") << d;
    EXPECT_FALSE(std::filesystem::exists(d / "stderr.log")) << d;
  }
}

TEST(ElasticRun, CommandLineErrorsExit2) {
  {
    AgentRun run;
    run.start({"--standalone", "--bogus-flag", "1"}, {});
    EXPECT_EQ(exitCode(run.wait()), 2);
    EXPECT_NE(run.agentErr().find("elastic-run: error: unknown flag "
                                  "'--bogus-flag'"),
              std::string::npos)
        << run.agentErr();
  }
  {
    // Several c10d nodes need the job token they share.
    AgentRun run;
    run.start({"--nnodes", "1:3", "--rdzv-backend", "c10d"}, {},
              {"TRELLIS_JOB_TOKEN="});
    EXPECT_EQ(exitCode(run.wait(10s)), 2);
    EXPECT_NE(run.agentErr().find("needs TRELLIS_JOB_TOKEN"), std::string::npos)
        << run.agentErr();
  }
  {
    // So do several static nodes.
    AgentRun run;
    run.start({"--nnodes", "2", "--node-rank", "0"}, {},
              {"TRELLIS_JOB_TOKEN="});
    EXPECT_EQ(exitCode(run.wait(10s)), 2);
    EXPECT_NE(run.agentErr().find("--rdzv-backend static with --nnodes 2:2 "
                                  "needs TRELLIS_JOB_TOKEN"),
              std::string::npos)
        << run.agentErr();
  }
  {
    AgentRun run;
    run.start({"--nnodes", "2", "--rdzv-backend", "etcd-v2"}, {});
    EXPECT_EQ(exitCode(run.wait(10s)), 2);
    EXPECT_NE(run.agentErr().find("etcd v2 API is not supported; use etcd "
                                  "(v3)"),
              std::string::npos)
        << run.agentErr();
  }
  {
    AgentRun run;
    run.start({"--help"}, {});
    EXPECT_EQ(exitCode(run.wait(10s)), 0);
    EXPECT_NE(run.agentOut().find("usage: elastic-run"), std::string::npos);
  }
}

}  // namespace
