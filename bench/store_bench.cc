// store_bench: TCPStore throughput and latency against a raw TCP round trip
// measured in the same run (docs/benchmarks.md).
//
//   store_bench [--json] [--seconds-per-case S]
//
// Every figure comes with a baseline measured here: ops/s against raw TCP
// round trips per second on one loopback connection (1/RTT), latencies
// against the raw round-trip time.
#include <algorithm>
#include <arpa/inet.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <optional>
#include <string>
#include <sys/resource.h>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench_util.h"
#include <trellis/store/tcp_store.h>

namespace {

using namespace std::chrono_literals;
using trellis::store::TCPStore;
using trellis::store::TCPStoreOptions;
using trellis::store::TCPStoreServer;
using Clock = std::chrono::steady_clock;

trellis::bench::Report report("store");
using trellis::bench::percentile;

double usSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// --- Raw TCP ping-pong on loopback: the baseline. ---------------------------

void measureRawRtt(int iterations) {
  const auto [fd, server] = trellis::bench::loopbackTcpPair();
  constexpr size_t kMsg = 32;  // about the size of a small store request
  // Round trips after 1 ms of idleness, like the wake-up measurement below:
  // both ends sleep in between, so this prices the cold wake-ups.
  constexpr int kIdleIterations = 500;
  std::thread echo([&, c = server] {
    char buf[kMsg];
    for (int i = 0; i < iterations + kIdleIterations; ++i) {
      trellis::bench::recvAll(c, buf, kMsg);
      trellis::bench::sendAll(c, buf, kMsg);
    }
    ::close(c);
  });
  char buf[kMsg] = {};
  std::vector<double> rtts;
  rtts.reserve(iterations);
  const auto start = Clock::now();
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = Clock::now();
    trellis::bench::sendAll(fd, buf, kMsg);
    trellis::bench::recvAll(fd, buf, kMsg);
    rtts.push_back(usSince(t0));
  }
  const double totalUs = usSince(start);
  std::vector<double> idle;
  for (int i = 0; i < kIdleIterations; ++i) {
    std::this_thread::sleep_for(1ms);
    const auto t0 = Clock::now();
    trellis::bench::sendAll(fd, buf, kMsg);
    trellis::bench::recvAll(fd, buf, kMsg);
    idle.push_back(usSince(t0));
  }
  echo.join();
  ::close(fd);
  report.add("raw_tcp_rtt_median", percentile(rtts, 0.5), "us");
  report.add("raw_tcp_rtt_p99", percentile(rtts, 0.99), "us");
  report.add("raw_tcp_round_trips_per_s", iterations / (totalUs / 1e6),
             "ops/s");
  report.add("raw_tcp_rtt_after_idle_median", percentile(idle, 0.5), "us");
  report.add("raw_tcp_rtt_after_idle_p99", percentile(idle, 0.99), "us");
}

// --- Store operations.
// --------------------------------------------------------

TCPStoreOptions options(uint16_t port) {
  TCPStoreOptions o;
  o.port = port;
  o.timeout = 60s;
  return o;
}

enum class Op { kSet, kGet, kAdd };
const char* name(Op op) {
  return op == Op::kSet ? "set" : op == Op::kGet ? "get" : "add";
}

void runOp(TCPStore& c, Op op, const std::string& key) {
  static const std::string value(16, 'v');
  switch (op) {
    case Op::kSet:
      c.set(key, value);
      break;
    case Op::kGet:
      (void)c.get("bench-get-key");
      break;
    case Op::kAdd:
      c.add("bench-counter", 1);
      break;
  }
}

void measureLatency(uint16_t port, Op op, int iterations) {
  TCPStore c(options(port));
  std::vector<double> lat;
  lat.reserve(iterations);
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = Clock::now();
    runOp(c, op, "lat-key");
    lat.push_back(usSince(t0));
  }
  const std::string m = std::string(name(op)) + "_latency";
  report.add(m + "_median", percentile(lat, 0.5), "us", "raw_tcp_rtt_median");
  report.add(m + "_p99", percentile(lat, 0.99), "us", "raw_tcp_rtt_p99");
}

void measureThroughput(uint16_t port, Op op, int clients,
                       std::chrono::milliseconds duration) {
  std::vector<std::unique_ptr<TCPStore>> conns;
  for (int i = 0; i < clients; ++i) {
    conns.push_back(std::make_unique<TCPStore>(options(port)));
  }
  std::atomic<bool> go{false};
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> total{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back([&, i] {
      const std::string key = "tp-" + std::to_string(i);
      while (!go.load(std::memory_order_acquire)) {
        std::this_thread::yield();
      }
      uint64_t n = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        runOp(*conns[i], op, key);
        ++n;
      }
      total.fetch_add(n);
    });
  }
  const auto t0 = Clock::now();
  go.store(true, std::memory_order_release);
  std::this_thread::sleep_for(duration);
  stop = true;
  for (auto& t : threads) {
    t.join();
  }
  const double secs = usSince(t0) / 1e6;
  report.add(std::string(name(op)) + "_ops_per_s_c" + std::to_string(clients),
             static_cast<double>(total.load()) / secs, "ops/s",
             "raw_tcp_round_trips_per_s");
}

// set -> wait wake-up: a client blocked in wait() on the server, another
// client sets the key; from just before the set to the waiter's return.
void measureWakeup(uint16_t port, int iterations) {
  TCPStore waiter(options(port));
  TCPStore setter(options(port));
  std::vector<double> lat;
  for (int i = 0; i < iterations; ++i) {
    const std::string key = "wake-" + std::to_string(i);
    std::atomic<int64_t> setAtNs{0};
    std::thread t([&] {
      std::this_thread::sleep_for(1ms);  // let the waiter block first
      setAtNs = Clock::now().time_since_epoch().count();
      setter.set(key, "x");
    });
    waiter.wait({key});
    const int64_t woke = Clock::now().time_since_epoch().count();
    t.join();
    lat.push_back(static_cast<double>(woke - setAtNs.load()) / 1e3);
  }
  report.add("set_wait_wakeup_median", percentile(lat, 0.5), "us",
             "raw_tcp_rtt_after_idle_median");
  report.add("set_wait_wakeup_p99", percentile(lat, 0.99), "us",
             "raw_tcp_rtt_after_idle_p99");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"store_bench: TCPStore throughput and latency"};
  bool json = false;
  double secondsPerCase = 1.0;
  app.add_flag("--json", json, "print one JSON object per line");
  app.add_option("--seconds-per-case", secondsPerCase,
                 "duration of each throughput case")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  if (lim.rlim_cur < 2048 && lim.rlim_max >= 2048) {
    lim.rlim_cur = 2048;
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }

  measureRawRtt(20000);
  TCPStoreServer server;
  {
    TCPStore c(options(server.port()));
    c.set("bench-get-key", std::string(16, 'g'));
  }
  for (Op op : {Op::kSet, Op::kGet, Op::kAdd}) {
    measureLatency(server.port(), op, 10000);
  }
  const auto duration =
      std::chrono::milliseconds(static_cast<int64_t>(secondsPerCase * 1000));
  for (int clients : {1, 16, 256}) {
    for (Op op : {Op::kSet, Op::kGet, Op::kAdd}) {
      measureThroughput(server.port(), op, clients, duration);
    }
  }
  measureWakeup(server.port(), 500);

  report.print(json);
  return 0;
}
