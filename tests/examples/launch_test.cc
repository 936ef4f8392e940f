// trellis-launch with real worker processes: how it reports a stopped rank
// (the parameter-server job with its server SIGSTOPped), a rank that
// leaves without shutdown, a rank that aborts, and that no worker outlives
// a launcher that is SIGKILLed.

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <signal.h>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "../rpc/worker_job.h"
#include "../transport/peer_process.h"
#include <trellis/core/text.h>

using namespace std::chrono_literals;
using trellis::rpc::testing::Clock;
using trellis::rpc::testing::readFile;
using trellis::transport::testing::Child;
using trellis::transport::testing::spawnHelper;

namespace {

// One launcher run: its stdout (the ranks' tagged lines) read by the test,
// its stderr in a temp file.
class Launch {
 public:
  Launch(int nproc, std::vector<std::string> command)
      : dir_(std::filesystem::temp_directory_path() /
             ("trellis_launch_" + std::to_string(::getpid()) + "_" +
              std::to_string(counter()++))) {
    std::filesystem::create_directories(dir_);
    std::vector<std::string> args = {"--nproc",
                                     std::to_string(nproc),
                                     "--master-port",
                                     std::to_string(port_.port()),
                                     "--timeout-s",
                                     "120",
                                     "--"};
    for (auto& a : command) {
      args.push_back(a.rfind("{dir}/", 0) == 0 ? path(a.substr(6)) : a);
    }
    child_ = spawnHelper(TRELLIS_LAUNCH, args, {}, path("launcher.err"));
  }
  ~Launch() {
    // Ends the job through the launcher, which ends its workers; the
    // Child's destructor SIGKILLs the launcher if it is still there.
    if (child_->pid > 0) {
      ::kill(child_->pid, SIGTERM);
      child_->wait(15000);
    }
    child_.reset();
    trellis::removeTree(dir_);
  }

  Child& launcher() { return *child_; }
  std::string path(const std::string& name) const { return dir_ / name; }
  std::string stderrText() const { return readFile(path("launcher.err")); }

  // Reads the launcher's stdout until a line contains `needle`; every line
  // read is kept in `seen`.
  std::string lineWith(const std::string& needle, int timeoutMs) {
    const auto end = Clock::now() + std::chrono::milliseconds(timeoutMs);
    while (Clock::now() < end) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          end - Clock::now());
      std::string line = child_->readLine(static_cast<int>(left.count()));
      seen += line + "\n";
      if (line.find(needle) != std::string::npos) {
        return line;
      }
    }
    return "";
  }
  // The rest of stdout, up to EOF or the bound.
  void drain(int timeoutMs) {
    const auto end = Clock::now() + std::chrono::milliseconds(timeoutMs);
    while (Clock::now() < end) {
      pollfd p{child_->out, POLLIN, 0};
      if (::poll(&p, 1, 50) != 1) {
        continue;
      }
      char buf[4096];
      const ssize_t n = ::read(child_->out, buf, sizeof(buf));
      if (n <= 0) {
        return;
      }
      seen.append(buf, static_cast<size_t>(n));
    }
  }

  std::string seen;

 private:
  static int& counter() {
    static int c = 0;
    return c;
  }
  std::filesystem::path dir_;
  trellis::rpc::testing::PortReservation port_;
  std::unique_ptr<Child> child_;
};

// The launcher's children, in the order it started them (rank order).
std::vector<pid_t> childrenOf(pid_t pid) {
  std::vector<pid_t> out;
  std::istringstream in(readFile("/proc/" + std::to_string(pid) + "/task/" +
                                 std::to_string(pid) + "/children"));
  for (pid_t c; in >> c;) {
    out.push_back(c);
  }
  return out;
}

// Running, or stopped: not gone and not a zombie (an orphan's zombie may
// wait for a reaper that never comes in a container).
bool alive(pid_t pid) {
  const std::string stat = readFile("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() &&
         stat[paren + 2] != 'Z' && stat[paren + 2] != 'X';
}

// Issue 14: the ps SIGSTOPped made the trainers abort (SIGABRT in
// ThreadPool::join) once their calls timed out, and the launcher blamed
// the trainer that aborted first. Now the trainers report the timeout and
// exit 1, and the launcher names the stopped rank as the likely cause.
TEST(Launch, StoppedParameterServerIsNamedAsTheCause) {
  Launch job(3, {PARAMETER_SERVER, "--steps", "1000000", "--log-every", "20",
                 "--batch", "32", "--rpc-timeout-s", "2"});
  ASSERT_FALSE(job.lineWith("trainer1 step", 120000).empty())
      << job.seen << job.stderrText();
  const auto ranks = childrenOf(job.launcher().pid);
  ASSERT_EQ(ranks.size(), 3u);
  ASSERT_EQ(::kill(ranks[0], SIGSTOP), 0);  // the ps; the launcher ends it
  const int status = job.launcher().wait(60000);
  job.drain(2000);
  const std::string err = job.stderrText();
  std::printf("%s", err.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  EXPECT_NE(err.find("rank 0 (pid " + std::to_string(ranks[0]) +
                     ") has been stopped (SIGSTOP)"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("after rank(s) 0 had been stopped (the likely cause)"),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find("SIGABRT"), std::string::npos) << err;
  // The trainers said why (their stderr comes through the launcher's),
  // naming the server.
  const size_t said = err.find("] parameter_server rank ");
  ASSERT_NE(said, std::string::npos) << err;
  EXPECT_NE(err.find(": DEADLINE_EXCEEDED: ", said), std::string::npos) << err;
  EXPECT_NE(err.find("to worker 'ps' (rank 0) timed out after 2s"),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find("check failed"), std::string::npos) << err;
  for (pid_t p : ranks) {
    EXPECT_FALSE(alive(p)) << p;  // all reaped by the launcher
  }
}

// A rank that returns from main without shutdown: the launcher keeps
// waiting for the others, as torchrun does, and they end on their own,
// their graceful shutdown failing at once with an error naming it.
TEST(Launch, RankThatLeavesEarlyLetsTheOthersFailNamingIt) {
  Launch job(3, {RPC_WORKER_HELPER, "leave", "return", "{dir}/go"});
  for (int r = 0; r < 2; ++r) {
    const std::string line = job.lineWith("shutdown ", 60000);
    ASSERT_FALSE(line.empty()) << job.seen << job.stderrText();
    EXPECT_NE(line.find("shutdown ConnectionError"), std::string::npos) << line;
    EXPECT_NE(line.find("worker 'w2' (rank 2) has not entered shutdown and "
                        "is gone"),
              std::string::npos)
        << line;
  }
  std::ofstream(job.path("go")) << "go\n";
  const int status = job.launcher().wait(30000);
  const std::string err = job.stderrText();
  std::printf("%s", err.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  EXPECT_NE(err.find("rank 2 (pid"), std::string::npos) << err;
  EXPECT_NE(err.find("exited with code 0"), std::string::npos) << err;
  EXPECT_NE(err.find("exited with code 3"), std::string::npos) << err;
}

TEST(Launch, RankThatAbortsEndsTheJobNamingIt) {
  Launch job(3, {RPC_WORKER_HELPER, "leave", "abort", "{dir}/go"});
  const int status = job.launcher().wait(60000);
  const std::string err = job.stderrText();
  std::printf("%s", err.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  EXPECT_NE(err.find("rank 2 killed by signal 6 (SIGABRT); stopping the "
                     "other ranks"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("first failure: rank 2"), std::string::npos) << err;
}

// No worker outlives its launcher, even a SIGKILLed one.
TEST(Launch, WorkersDieWithASigkilledLauncher) {
  // Both ranks wait (up to 60 s) for something that never comes.
  Launch job(2, {RPC_WORKER_HELPER, "serve", "{dir}/never"});
  std::vector<pid_t> ranks;
  const auto end = Clock::now() + 30s;
  while (ranks.size() < 2 && Clock::now() < end) {
    ranks = childrenOf(job.launcher().pid);
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(ranks.size(), 2u);
  ASSERT_EQ(::kill(job.launcher().pid, SIGKILL), 0);
  job.launcher().wait(10000);
  for (pid_t p : ranks) {
    // Reaped by init once the kernel killed them; bounded wait.
    const auto until = Clock::now() + 10s;
    while (alive(p) && Clock::now() < until) {
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_FALSE(alive(p)) << "worker " << p << " outlived its launcher";
  }
}

}  // namespace
