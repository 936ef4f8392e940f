#pragma once

// Test helper: a loopback TCP port reserved for a process the test starts
// (the rpc, dist_autograd, store, launcher and elastic-run process tests).

#include <algorithm>
#include <arpa/inet.h>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <netinet/in.h>
#include <random>
#include <string>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

namespace trellis::testing {

// A loopback TCP port for a process a test starts (rank 0's store, an
// elastic-run agent's rendezvous endpoint), held for this process until the
// reservation is destroyed.
//
// Not "bind port 0, read it, close": the kernel hands out the ephemeral
// range (ip_local_port_range, 32768-60999 by default) for every connect()
// and every bind to port 0 of the tests running in parallel, so a port
// found that way and closed can become another socket's local port before
// rank 0 binds it (seen: rank 0 could not listen and rank 1 timed out with
// "Connection refused"). A port below that range is never assigned by the
// kernel; one that binds now and whose lock file no other test process
// holds (flock, released when this process closes it or dies) is ours.
class PortReservation {
 public:
  PortReservation() {
    int low = 32768;
    std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
    range >> low;
    constexpr int kFirst = 10000;
    const int last = std::max(low - 1, kFirst + 1000);
    const std::filesystem::path dir =
        std::filesystem::temp_directory_path() / "trellis-test-ports";
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    std::random_device seed;
    std::mt19937 gen(seed() ^ static_cast<unsigned>(::getpid()));
    std::uniform_int_distribution<int> pick(kFirst, last);
    for (int attempt = 0; attempt < 500 && port_ < 0; ++attempt) {
      const int port = pick(gen);
      const std::string lock = dir / (std::to_string(port) + ".lock");
      const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
      if (fd < 0) {
        continue;
      }
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && bindsNow(port)) {
        port_ = port;
        lockFd_ = fd;
      } else {
        ::close(fd);
      }
    }
    if (port_ < 0) {
      ADD_FAILURE() << "no free port in [" << kFirst << ", " << last
                    << "] after 500 tries";
    }
  }
  ~PortReservation() {
    if (lockFd_ >= 0) {
      ::close(lockFd_);
    }
  }
  PortReservation(const PortReservation&) = delete;
  PortReservation& operator=(const PortReservation&) = delete;

  int port() const { return port_; }

 private:
  static bool bindsNow(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      return false;
    }
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    ::close(fd);
    return ok;
  }

  int port_ = -1;
  int lockFd_ = -1;
};

}  // namespace trellis::testing
