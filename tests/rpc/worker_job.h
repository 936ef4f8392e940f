#pragma once

// Test helper: a job of real worker processes (the rpc and dist_autograd
// process tests), each a Child from peer_process.h.

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

#include "../port_reservation.h"
#include "../transport/peer_process.h"
#include <trellis/core/auth.h>
#include <trellis/core/text.h>

namespace trellis::rpc::testing {

using transport::testing::Child;
using Clock = std::chrono::steady_clock;

using trellis::testing::PortReservation;

inline std::string readFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Lines of `text` logged at warn level or above.
inline std::vector<std::string> loudLines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.find("[warning]") != std::string::npos ||
        line.find("[error]") != std::string::npos ||
        line.find("[critical]") != std::string::npos) {
      out.push_back(line);
    }
  }
  return out;
}

// One job: N worker processes of one scenario, started like a launcher
// does (RANK, WORLD_SIZE, MASTER_ADDR/PORT, a job token), their stderr in a
// temp dir. Each Child SIGKILLs and reaps its process if the test ends
// before it exited.
class Job {
 public:
  Job(const std::string& binary, const std::string& scenario, int n,
      const std::vector<std::string>& extraArgs = {})
      : dir_(std::filesystem::temp_directory_path() /
             ("trellis_job_" + std::to_string(::getpid()) + "_" +
              std::to_string(counter()++))),
        token_(trellis::auth::JobToken::generate().secret()) {
    std::filesystem::create_directories(dir_);
    const int port = port_.port();
    for (int r = 0; r < n; ++r) {
      std::vector<std::string> args = {scenario};
      for (const auto& a : extraArgs) {
        // "{dir}/x": a file in this job's temp dir.
        args.push_back(a.rfind("{dir}/", 0) == 0 ? path(a.substr(6)) : a);
      }
      children_.push_back(transport::testing::spawnHelper(
          binary, args,
          {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(n),
           "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port),
           "TRELLIS_JOB_TOKEN=" + token_, "TRELLIS_LOG_LEVEL=info"},
          stderrPath(r)));
    }
  }
  ~Job() {
    children_.clear();  // SIGKILLs and reaps any still running
    trellis::removeTree(dir_);
  }

  Child& operator[](int r) { return *children_[r]; }
  int size() const { return static_cast<int>(children_.size()); }
  const std::string& token() const { return token_; }
  std::string path(const std::string& name) const { return dir_ / name; }
  std::string stderrPath(int r) const {
    return path("rank" + std::to_string(r) + ".err");
  }
  std::string stderrOf(int r) const { return readFile(stderrPath(r)); }

  // Every rank's exit status, each waited for within what is left of
  // `limit`.
  std::vector<int> waitAll(std::chrono::milliseconds limit) {
    const auto end = Clock::now() + limit;
    std::vector<int> out;
    for (auto& c : children_) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          end - Clock::now());
      out.push_back(
          c->wait(static_cast<int>(std::max<int64_t>(left.count(), 1))));
    }
    return out;
  }

 private:
  static int& counter() {
    static int c = 0;  // test threads only
    return c;
  }
  std::filesystem::path dir_;
  std::string token_;
  PortReservation port_;  // before children_: released after they are gone
  std::vector<std::unique_ptr<Child>> children_;
};

inline bool exitedZero(int status) {
  return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// Reads lines until one starts with `prefix`; "" if none within the bound.
inline std::string lineStartingWith(Child& c, const std::string& prefix,
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

// True once /proc says `pid` is stopped (state T), within `limit`.
inline bool waitUntilStopped(pid_t pid, std::chrono::milliseconds limit) {
  const auto end = Clock::now() + limit;
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  while (Clock::now() < end) {
    const std::string stat = readFile(path);
    // "pid (comm) S ...": the state follows the last ')'.
    const size_t paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size() &&
        stat[paren + 2] == 'T') {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

}  // namespace trellis::rpc::testing
