#pragma once
// Helpers of the elastic-run tests that run real agents (elastic_run_test,
// elastic_multinode_test).
#include <algorithm>
#include <arpa/inet.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <netinet/in.h>
#include <random>
#include <sstream>
#include <string>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <trellis/elastic/agent.h>

namespace trellis::elastic::testing {

// The whole file; empty when it cannot be read.
inline std::string readFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// NAME=value lines (what the test worker writes of its environment).
inline std::map<std::string, std::string> readEnvFile(
    const std::filesystem::path& path) {
  std::map<std::string, std::string> env;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) {
      env[line.substr(0, eq)] = line.substr(eq + 1);
    }
  }
  return env;
}

// A free port on 127.0.0.1 for an agent the test starts, below the kernel's
// ephemeral range (net.ipv4.ip_local_port_range). pickFreePort() asks the
// kernel for one inside that range and lets it go; until the agent binds
// it, any socket of the tests running beside this one (a transport test
// binds hundreds of listeners a second, each on a kernel-chosen port) may
// take it, and the agents then wait silently to join a store that is not
// theirs. Below the range only another explicit pick can collide: a
// random start, then the next free port; below 29000, clear of the
// rendezvous and master defaults (29400, 29500) that some tests use.
inline uint16_t pickTestPort() {
  int low = 32768;
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  range >> low;
  const int first = low / 2;
  const int end = std::min(low, 29000);
  if (!range || first < 1024 || end - first < 1024) {
    return pickFreePort("127.0.0.1");
  }
  const int span = end - first;
  std::mt19937 rng(std::random_device{}());
  const int start = static_cast<int>(rng() % static_cast<unsigned>(span));
  for (int i = 0; i < 256; ++i) {
    const auto port = static_cast<uint16_t>(first + (start + i) % span);
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      break;
    }
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool free =
        ::bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    if (free) {
      return port;
    }
  }
  return pickFreePort("127.0.0.1");
}

// A wait status's exit code; -1 when the process was killed by a signal.
inline int exitCode(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace trellis::elastic::testing
