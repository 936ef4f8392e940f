#pragma once
// A real etcd server for the etcd rendezvous tests (Debian's etcd-server,
// /usr/bin/etcd): a single member on 127.0.0.1, free ports, a fresh data
// directory, started and waited for (bounded), SIGKILLed by its pid and
// reaped when the test is done (or asks). Its log goes to <dir>/etcd.log.
// Or, given a network namespace the test created and an address in it,
// there on etcd's usual ports (the namespace is fresh: nothing holds them),
// started through `ip netns exec` (which execs etcd in the same pid) and
// found ready by its log, since this process cannot reach the namespace.
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "../transport/peer_process.h"
#include <trellis/core/text.h>
#include <trellis/elastic/agent.h>
#include <trellis/elastic/etcd_store.h>

namespace trellis::elastic::testing {

inline constexpr const char* kEtcdBinary = "/usr/bin/etcd";

inline bool haveEtcd() { return ::access(kEtcdBinary, X_OK) == 0; }

class EtcdServer {
 public:
  explicit EtcdServer(std::string netns = "", std::string host = "127.0.0.1")
      : netns_(std::move(netns)), host_(std::move(host)) {
    static int counter = 0;
    dir_ = std::filesystem::temp_directory_path() /
           ("trellis_etcd_" + std::to_string(::getpid()) + "_" +
            std::to_string(counter++));
    std::filesystem::create_directories(dir_);
  }
  ~EtcdServer() {
    kill();
    trellis::removeTree(dir_);
  }
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  // Starts etcd and waits (bounded) until it answers; false when it does
  // not (the log says why). Tries fresh ports a few times: another process
  // may take a port between picking and binding it. After kill(), starts
  // it again on the same ports and data.
  bool start(std::chrono::milliseconds bound = std::chrono::seconds(20)) {
    for (int attempt = 0; attempt < 3; ++attempt) {
      if (!netns_.empty()) {
        clientPort_ = 2379;
        peerPort_ = 2380;
      } else if (clientPort_ == 0 || attempt > 0) {
        clientPort_ = pickFreePort("127.0.0.1");
        peerPort_ = pickFreePort("127.0.0.1");
      }
      const std::string client =
          "http://" + host_ + ":" + std::to_string(clientPort_);
      const std::string peer =
          "http://" + host_ + ":" + std::to_string(peerPort_);
      std::vector<std::string> args = {"--name",
                                       "default",
                                       "--data-dir",
                                       (dir_ / "data").string(),
                                       "--listen-client-urls",
                                       client,
                                       "--advertise-client-urls",
                                       client,
                                       "--listen-peer-urls",
                                       peer,
                                       "--initial-advertise-peer-urls",
                                       peer,
                                       "--initial-cluster",
                                       "default=" + peer};
      const char* binary = kEtcdBinary;
      if (!netns_.empty()) {
        args.insert(args.begin(), {"netns", "exec", netns_, kEtcdBinary});
        binary = "/usr/sbin/ip";
      }
      child_ = transport::testing::spawnHelper(binary, args, {},
                                               (dir_ / "etcd.log").string());
      if (waitReady(bound)) {
        return true;
      }
      kill();
    }
    return false;
  }

  // SIGKILL by pid, then reap.
  void kill() {
    if (child_ && child_->pid > 0) {
      ::kill(child_->pid, SIGKILL);
      ::waitpid(child_->pid, nullptr, 0);
      child_->pid = -1;
    }
    child_.reset();
  }

  uint16_t port() const { return clientPort_; }
  std::string endpoint() const {
    return host_ + ":" + std::to_string(clientPort_);
  }
  pid_t pid() const { return child_ ? child_->pid : -1; }
  std::filesystem::path dir() const { return dir_; }

 private:
  bool waitReady(std::chrono::milliseconds bound) {
    const auto end = std::chrono::steady_clock::now() + bound;
    while (std::chrono::steady_clock::now() < end) {
      int status = 0;
      if (::waitpid(child_->pid, &status, WNOHANG) == child_->pid) {
        child_->pid = -1;  // it exited (a port taken?)
        return false;
      }
      if (!netns_.empty()) {
        std::ifstream log(dir_ / "etcd.log");
        const std::string text((std::istreambuf_iterator<char>(log)),
                               std::istreambuf_iterator<char>());
        if (text.find("ready to serve client requests") != std::string::npos) {
          return true;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      try {
        EtcdStoreOptions o;
        o.port = clientPort_;
        o.prefix = "/trellis-test-ready/";
        o.timeout = std::chrono::milliseconds(500);
        EtcdStore probe(o);
        (void)probe.numKeys();
        return true;
      } catch (const std::exception&) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    return false;
  }

  std::string netns_;
  std::string host_;
  std::filesystem::path dir_;
  uint16_t clientPort_ = 0;
  uint16_t peerPort_ = 0;
  std::unique_ptr<transport::testing::Child> child_;
};

}  // namespace trellis::elastic::testing
