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

#include <trellis/store/tcp_store.h>

namespace {

using namespace std::chrono_literals;
using trellis::store::TCPStore;
using trellis::store::TCPStoreOptions;
using trellis::store::TCPStoreServer;
using Clock = std::chrono::steady_clock;

struct Result {
  std::string metric;
  double value;
  std::string unit;
  std::optional<std::string> baseline;
  std::optional<double> ratio;
};

std::vector<Result> results;

void report(std::string metric, double value, std::string unit,
            std::optional<std::string> baseline = std::nullopt) {
  std::optional<double> ratio;
  if (baseline) {
    for (const auto& r : results) {
      if (r.metric == *baseline && r.value != 0) {
        ratio = value / r.value;
      }
    }
  }
  results.push_back(
      {std::move(metric), value, std::move(unit), std::move(baseline), ratio});
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) {
    return 0;
  }
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * v.size()));
  return v[i];
}

double usSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// --- Raw TCP ping-pong on loopback: the baseline. ---------------------------

void readFull(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) {
      std::perror("recv");
      std::exit(1);
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
}

void measureRawRtt(int iterations) {
  const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::listen(lfd, 1);
  socklen_t len = sizeof(addr);
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&addr), &len);
  constexpr size_t kMsg = 32;  // about the size of a small store request
  // Round trips after 1 ms of idleness, like the wake-up measurement below:
  // both ends sleep in between, so this prices the cold wake-ups.
  constexpr int kIdleIterations = 500;
  std::thread echo([&] {
    const int c = ::accept(lfd, nullptr, nullptr);
    const int one = 1;
    ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    char buf[kMsg];
    for (int i = 0; i < iterations + kIdleIterations; ++i) {
      readFull(c, buf, kMsg);
      ::send(c, buf, kMsg, MSG_NOSIGNAL);
    }
    ::close(c);
  });
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  char buf[kMsg] = {};
  std::vector<double> rtts;
  rtts.reserve(iterations);
  const auto start = Clock::now();
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = Clock::now();
    ::send(fd, buf, kMsg, MSG_NOSIGNAL);
    readFull(fd, buf, kMsg);
    rtts.push_back(usSince(t0));
  }
  const double totalUs = usSince(start);
  std::vector<double> idle;
  for (int i = 0; i < kIdleIterations; ++i) {
    std::this_thread::sleep_for(1ms);
    const auto t0 = Clock::now();
    ::send(fd, buf, kMsg, MSG_NOSIGNAL);
    readFull(fd, buf, kMsg);
    idle.push_back(usSince(t0));
  }
  echo.join();
  ::close(fd);
  ::close(lfd);
  report("raw_tcp_rtt_median", percentile(rtts, 0.5), "us");
  report("raw_tcp_rtt_p99", percentile(rtts, 0.99), "us");
  report("raw_tcp_round_trips_per_s", iterations / (totalUs / 1e6), "ops/s");
  report("raw_tcp_rtt_after_idle_median", percentile(idle, 0.5), "us");
  report("raw_tcp_rtt_after_idle_p99", percentile(idle, 0.99), "us");
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
  report(m + "_median", percentile(lat, 0.5), "us", "raw_tcp_rtt_median");
  report(m + "_p99", percentile(lat, 0.99), "us", "raw_tcp_rtt_p99");
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
  report(std::string(name(op)) + "_ops_per_s_c" + std::to_string(clients),
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
  report("set_wait_wakeup_median", percentile(lat, 0.5), "us",
         "raw_tcp_rtt_after_idle_median");
  report("set_wait_wakeup_p99", percentile(lat, 0.99), "us",
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

  if (json) {
    for (const auto& r : results) {
      std::printf(
          "{\"bench\": \"store\", \"metric\": \"%s\", \"value\": %.6g, "
          "\"unit\": \"%s\", \"baseline\": %s, \"ratio\": %s}\n",
          r.metric.c_str(), r.value, r.unit.c_str(),
          r.baseline ? ("\"" + *r.baseline + "\"").c_str() : "null",
          r.ratio ? std::to_string(*r.ratio).c_str() : "null");
    }
  } else {
    std::printf("%-32s %14s %-6s %-28s %8s\n", "metric", "value", "unit",
                "baseline", "ratio");
    for (const auto& r : results) {
      std::printf("%-32s %14.2f %-6s %-28s %8s\n", r.metric.c_str(), r.value,
                  r.unit.c_str(), r.baseline ? r.baseline->c_str() : "-",
                  r.ratio ? std::to_string(*r.ratio).c_str() : "-");
    }
  }
  return 0;
}
