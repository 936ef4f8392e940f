#pragma once

// A helper process started by a test (posix_spawn), its stdout read line by
// line with a bound; killed (SIGKILL, by its pid) and reaped if the test
// ends first.

#include <chrono>
#include <fcntl.h>
#include <memory>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

extern char** environ;

namespace trellis::transport::testing {

struct Child {
  pid_t pid = -1;
  int out = -1;
  ~Child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    if (out >= 0) {
      ::close(out);
    }
  }
  // A line of stdout within `timeoutMs`; empty if none.
  std::string readLine(int timeoutMs) {
    std::string line;
    const auto end =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs);
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{out, POLLIN, 0};
      if (::poll(&p, 1, 100) != 1) {
        continue;
      }
      char c;
      if (::read(out, &c, 1) != 1) {
        break;
      }
      if (c == '\n') {
        return line;
      }
      line += c;
    }
    return line;
  }
  // The child's wait status once it exits, waiting at most `timeoutMs`;
  // a child still running then is SIGKILLed and -1 returned.
  int wait(int timeoutMs = 30000) {
    const auto end =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs);
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() >= end) {
        ADD_FAILURE() << "child " << pid << " still running after " << timeoutMs
                      << " ms";
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
        pid = -1;
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    pid = -1;
    return status;
  }
};

// Starts `path args...` with this process's environment plus `env`
// ("NAME=value" entries, which take precedence); its stdout is the Child's
// pipe, its stderr ours or, when `stderrPath` is set, that file.
inline std::unique_ptr<Child> spawnHelper(const std::string& path,
                                          std::vector<std::string> args,
                                          std::vector<std::string> env = {},
                                          const std::string& stderrPath = "") {
  int fds[2];
  EXPECT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  if (!stderrPath.empty()) {
    posix_spawn_file_actions_addopen(&fa, 2, stderrPath.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  args.insert(args.begin(), path);
  std::vector<char*> argv;
  for (auto& a : args) {
    argv.push_back(a.data());
  }
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (auto& e : env) {
    envp.push_back(e.data());
  }
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    bool overridden = false;
    for (const auto& mine : env) {
      const auto eq = mine.find('=');
      overridden = overridden || entry.rfind(mine.substr(0, eq + 1), 0) == 0;
    }
    if (!overridden) {
      envp.push_back(*e);
    }
  }
  envp.push_back(nullptr);
  auto child = std::make_unique<Child>();
  const int rc = posix_spawn(&child->pid, path.c_str(), &fa, nullptr,
                             argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  child->out = fds[0];
  EXPECT_EQ(rc, 0);
  return child;
}

}  // namespace trellis::transport::testing
