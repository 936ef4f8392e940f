#pragma once

// Test helper: N RPC agents in one process, "w0" .. "w<N-1>" with ranks
// 0 .. N-1, each with its own transport context and threads, meeting
// through one in-memory HashStore; the pipes between them are real. Used by
// the rpc, rref and dist_autograd tests.

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <trellis/core/deadline.h>
#include <trellis/rpc/agent.h>
#include <trellis/store/hash_store.h>

namespace trellis::rpc::testing {

class AgentGroup {
 public:
  // `base` is every agent's options; the store and loopback address are
  // filled in, and initTimeout is bounded at 30 s. `perRank`, when given,
  // changes agent i's copy of them.
  explicit AgentGroup(
      int n, RpcOptions base = {},
      const std::function<void(int, RpcOptions&)>& perRank = nullptr) {
    auto store = std::make_shared<store::HashStore>();
    std::vector<std::thread> threads;
    agents_.resize(n);
    for (int i = 0; i < n; ++i) {
      threads.emplace_back([&, i] {
        RpcOptions o = base;
        o.store = store;
        o.localAddress = "127.0.0.1";
        o.initTimeout = std::chrono::seconds(30);
        if (perRank) {
          perRank(i, o);
        }
        agents_[i] = Agent::start("w" + std::to_string(i), i, n, o);
      });
    }
    for (auto& t : threads) {
      t.join();
    }
  }
  ~AgentGroup() { shutdownAll(false); }
  AgentGroup(const AgentGroup&) = delete;
  AgentGroup& operator=(const AgentGroup&) = delete;

  Agent& operator[](int i) { return *agents_[i]; }
  // Hands agent i's reference to the caller (the group forgets it).
  std::shared_ptr<Agent> take(int i) { return std::move(agents_[i]); }
  int size() const { return static_cast<int>(agents_.size()); }

  // Shuts every agent down at once (graceful shutdown needs all of them).
  void shutdownAll(bool graceful, Duration timeout = std::chrono::seconds(30)) {
    std::vector<std::thread> threads;
    for (auto& a : agents_) {
      if (a != nullptr) {
        threads.emplace_back([&a, graceful, timeout] {
          a->shutdown({.graceful = graceful, .drainTimeout = timeout});
        });
      }
    }
    for (auto& t : threads) {
      t.join();
    }
  }

 private:
  std::vector<std::shared_ptr<Agent>> agents_;
};

// Options whose calls are bounded by `timeout` (so a hang fails the test
// with a message instead of running into ctest's limit).
inline RpcOptions callsBoundedBy(Duration timeout) {
  RpcOptions o;
  o.defaultTimeout = timeout;
  return o;
}

// Polls `pred` until it holds or `limit` passes; returns its last value.
inline bool waitUntil(const std::function<bool()>& pred,
                      Duration limit = std::chrono::seconds(10)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return pred();
}

}  // namespace trellis::rpc::testing
