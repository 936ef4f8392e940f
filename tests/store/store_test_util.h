#pragma once

// Helpers shared by the store tests: temporary files, a trellis-store child
// process, and bounded waits.

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <poll.h>
#include <signal.h>
#include <string>
#include <string_view>
#include <sys/types.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

namespace trellis::store::testing {

// A unique path under the test's temporary directory, removed on exit.
class TempPath {
 public:
  explicit TempPath(const std::string& stem) {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("trellis_store_" + stem + "_" + std::to_string(::getpid()) + "_" +
             std::to_string(counter++));
    std::filesystem::remove(path_);
  }
  ~TempPath() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// Waits (bounded) for `pid` to change state; returns the status, or -1 when
// it did not within `limit`.
inline int waitPid(pid_t pid, std::chrono::milliseconds limit,
                   int options = 0) {
  const auto until = std::chrono::steady_clock::now() + limit;
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, options | WNOHANG);
    if (r == pid) {
      return status;
    }
    if (std::chrono::steady_clock::now() >= until) {
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

#ifdef TRELLIS_STORE_BIN
// A trellis-store process started by the test; killed (by PID) on exit.
// (Only in binaries that are told where trellis-store is.)
class StoreProcess {
 public:
  // Starts the binary on 127.0.0.1, port 0, and reads the port it prints.
  // `token` is passed through TRELLIS_JOB_TOKEN when not empty.
  explicit StoreProcess(const std::string& token = "") {
    int out[2];
    if (::pipe(out) != 0) {
      ADD_FAILURE() << "pipe failed";
      return;
    }
    // Everything the child needs is built before fork(): only async-signal
    // safe calls happen between fork and exec.
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::string_view(*e).rfind("TRELLIS_JOB_TOKEN=", 0) != 0) {
        env.emplace_back(*e);
      }
    }
    if (!token.empty()) {
      env.push_back("TRELLIS_JOB_TOKEN=" + token);
    }
    std::vector<char*> envp;
    for (auto& e : env) {
      envp.push_back(e.data());
    }
    envp.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(out[1], STDOUT_FILENO);
      ::close(out[0]);
      ::close(out[1]);
      ::execle(TRELLIS_STORE_BIN, TRELLIS_STORE_BIN, "--host", "127.0.0.1",
               "--port", "0", static_cast<char*>(nullptr), envp.data());
      ::_exit(127);
    }
    ::close(out[1]);
    // Read the first line, waiting at most 10 s for the child to print it.
    std::string line;
    char c = 0;
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (line.size() < 16 && std::chrono::steady_clock::now() < until) {
      pollfd pfd{out[0], POLLIN, 0};
      if (::poll(&pfd, 1, 100) <= 0) {
        continue;
      }
      if (::read(out[0], &c, 1) != 1 || c == '\n') {
        break;
      }
      line += c;
    }
    ::close(out[0]);
    port_ = static_cast<uint16_t>(std::atoi(line.c_str()));
    if (port_ == 0) {
      ADD_FAILURE() << "trellis-store did not print a port: '" << line << "'";
    }
  }
  ~StoreProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      waitPid(pid_, std::chrono::seconds(10));
    }
  }
  uint16_t port() const { return port_; }
  pid_t pid() const { return pid_; }
  // Sends `sig` and reaps the process; returns its wait status.
  int signalAndReap(int sig) {
    ::kill(pid_, sig);
    const int status = waitPid(pid_, std::chrono::seconds(10));
    pid_ = -1;
    return status;
  }

 private:
  pid_t pid_ = -1;
  uint16_t port_ = 0;
};
#endif  // TRELLIS_STORE_BIN

template <typename F>
std::chrono::milliseconds timed(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - t0);
}

}  // namespace trellis::store::testing
