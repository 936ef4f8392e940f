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

#include "../transport/peer_process.h"
#include <trellis/core/auth.h>

using namespace std::chrono_literals;
using trellis::transport::testing::Child;

namespace {

using Clock = std::chrono::steady_clock;

int freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The worker binary with `env` added to ours and stderr to `stderrPath`.
std::unique_ptr<Child> spawnWorker(std::vector<std::string> args,
                                   const std::vector<std::string>& env,
                                   const std::string& stderrPath) {
  int fds[2];
  EXPECT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_addopen(&fa, 2, stderrPath.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  args.insert(args.begin(), DIST_AUTOGRAD_WORKER);
  std::vector<char*> argv;
  for (auto& a : args) {
    argv.push_back(a.data());
  }
  argv.push_back(nullptr);
  std::vector<std::string> all = env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    bool mine = false;
    for (const auto& m : env) {
      mine = mine || entry.rfind(m.substr(0, m.find('=') + 1), 0) == 0;
    }
    if (!mine) {
      all.push_back(entry);
    }
  }
  std::vector<char*> envp;
  for (auto& e : all) {
    envp.push_back(e.data());
  }
  envp.push_back(nullptr);
  auto child = std::make_unique<Child>();
  const int rc = posix_spawn(&child->pid, DIST_AUTOGRAD_WORKER, &fa, nullptr,
                             argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  child->out = fds[0];
  EXPECT_EQ(rc, 0);
  return child;
}

// N worker processes of one scenario; each Child SIGKILLs and reaps its
// process if the test ends before it exited.
class Job {
 public:
  Job(const std::string& scenario, int n)
      : dir_(std::filesystem::temp_directory_path() /
             ("trellis_dist_autograd_" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(dir_);
    const int port = freePort();
    const std::string token = trellis::auth::JobToken::generate().secret();
    for (int r = 0; r < n; ++r) {
      children_.push_back(spawnWorker(
          {scenario},
          {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(n),
           "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port),
           "TRELLIS_JOB_TOKEN=" + token, "TRELLIS_LOG_LEVEL=info"},
          stderrPath(r)));
    }
  }
  ~Job() {
    children_.clear();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  Child& operator[](int r) { return *children_[r]; }
  std::string stderrPath(int r) const {
    return dir_ / ("rank" + std::to_string(r) + ".err");
  }
  std::string stderrOf(int r) const { return readFile(stderrPath(r)); }

 private:
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<Child>> children_;
};

bool exitedZero(int status) {
  return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// Reads lines until one starts with `prefix`; "" if none within the bound.
std::string lineStartingWith(Child& c, const std::string& prefix,
                             int timeoutMs) {
  const auto end = Clock::now() + std::chrono::milliseconds(timeoutMs);
  while (Clock::now() < end) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        end - Clock::now());
    std::string line = c.readLine(static_cast<int>(left.count()));
    if (line.rfind(prefix, 0) == 0) {
      return line;
    }
  }
  return "";
}

TEST(DistAutogradProcess, WorkerKilledDuringBackwardFailsItNamingTheWorker) {
  Job job("kill", 3);
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
