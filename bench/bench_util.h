#pragma once

// What every benchmark program in bench/ shares: the result table and the
// JSON-lines format of DESIGN.md ("Benchmarks"), numeric flags, percentiles,
// the raw loopback-socket plumbing its baselines are measured with, and buffers
// on transparent huge pages. Failures exit the program: a benchmark with a
// broken baseline has nothing to report.

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <optional>
#include <spawn.h>
#include <string>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <utility>
#include <vector>

#include <trellis/core/text.h>

namespace trellis::bench {

struct Result {
  std::string metric;
  double value;
  std::string unit;
  std::string baseline;  // metric measured in the same run; empty = none
};

class Report {
 public:
  explicit Report(std::string bench) : bench_(std::move(bench)) {}

  void add(Result r) { results_.push_back(std::move(r)); }
  void add(std::string metric, double value, std::string unit,
           std::string baseline = {}) {
    add(Result{std::move(metric), value, std::move(unit), std::move(baseline)});
  }

  // The value of `metric` in this run; 0 when it was not measured.
  double valueOf(const std::string& metric) const {
    for (const auto& r : results_) {
      if (r.metric == metric) {
        return r.value;
      }
    }
    return 0;
  }

  // A table, or one JSON object per line; ratio = value / baseline's value.
  void print(bool json) const {
    if (!json) {
      std::printf("%-42s %14s %-6s %-38s %8s\n", "metric", "value", "unit",
                  "baseline", "ratio");
    }
    for (const auto& r : results_) {
      const double base = r.baseline.empty() ? 0 : valueOf(r.baseline);
      const std::string ratio = base > 0 ? std::to_string(r.value / base) : "";
      if (json) {
        const std::string baseline =
            r.baseline.empty() ? "null" : "\"" + r.baseline + "\"";
        std::printf(
            "{\"bench\": \"%s\", \"metric\": \"%s\", \"value\": %.6g, "
            "\"unit\": \"%s\", \"baseline\": %s, \"ratio\": %s}\n",
            bench_.c_str(), r.metric.c_str(), r.value, r.unit.c_str(),
            baseline.c_str(), ratio.empty() ? "null" : ratio.c_str());
      } else {
        std::printf("%-42s %14.3f %-6s %-38s %8s\n", r.metric.c_str(), r.value,
                    r.unit.c_str(),
                    r.baseline.empty() ? "-" : r.baseline.c_str(),
                    ratio.empty() ? "-" : ratio.substr(0, 5).c_str());
      }
    }
  }

 private:
  std::string bench_;
  std::vector<Result> results_;
};

// The value of numeric flag `flag` of `program`: `text` as a decimal
// integer in [lo, hi]. Anything else exits 2 naming the flag, the range
// and the text: flags are untrusted input (atoi would read "x" as 0).
inline int64_t flagValue(const char* program, const char* flag,
                         const char* text, int64_t lo, int64_t hi) {
  const std::optional<int64_t> v = parseDecimal(text);
  if (!v || *v < lo || *v > hi) {
    std::fprintf(stderr,
                 "%s: %s wants a whole number from %lld to %lld, not '%s'\n",
                 program, flag, static_cast<long long>(lo),
                 static_cast<long long>(hi), text);
    std::exit(2);
  }
  return *v;
}

// The p-th quantile (0..1) of `v`; 0 for an empty sample.
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) {
    return 0;
  }
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

// The arithmetic mean of `v`; 0 for an empty sample.
inline double mean(const std::vector<double>& v) {
  if (v.empty()) {
    return 0;
  }
  double total = 0;
  for (double x : v) {
    total += x;
  }
  return total / static_cast<double>(v.size());
}

inline void sendAll(int fd, const void* data, size_t n) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r <= 0) {
      std::perror("send");
      std::exit(1);
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
}

// `maxRead` caps each recv() call (0: no cap).
inline void recvAll(int fd, void* data, size_t n, size_t maxRead = 0) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, maxRead == 0 ? n : std::min(n, maxRead), 0);
    if (r <= 0) {
      std::perror("recv");
      std::exit(1);
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
}

// A connected {client, server} TCP pair on 127.0.0.1, both TCP_NODELAY.
inline std::pair<int, int> loopbackTcpPair() {
  const int l = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::listen(l, 1) != 0 ||
      ::getsockname(l, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    std::perror("tcp listen");
    std::exit(1);
  }
  const int c = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(c, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    std::perror("tcp connect");
    std::exit(1);
  }
  const int s = ::accept(l, nullptr, nullptr);
  ::close(l);
  const int one = 1;
  ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return {c, s};
}

// A line for the reader outside the table and the JSON lines: stderr.
inline void note(const std::string& line) {
  std::fprintf(stderr, "# %s\n", line.c_str());
}

// Context switches per thread name, from /proc (pool threads are named by
// role: "rpc-<worker>/i" handlers, "rpc-done-<worker>/i" completions).
// `voluntaryOnly`: only the times a thread slept and had to be woken.
inline std::map<std::string, double> switchesByThread(
    bool voluntaryOnly = false) {
  std::map<std::string, double> out;
  for (const auto& t : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(t.path() / "comm");
    std::string name;
    std::getline(comm, name);
    // Threads nobody named (main, transport loop, agent timer, store
    // server) carry the program's name: tell them apart by id.
    const std::string tid = t.path().filename().string();
    if (tid == std::to_string(::getpid())) {
      name = "main";
    } else if (name == program_invocation_short_name) {
      name = "unnamed-" + tid;
    }
    std::ifstream status(t.path() / "status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.find("ctxt_switches:") != std::string::npos &&
          (!voluntaryOnly || line.rfind("voluntary", 0) == 0)) {
        out[name] += std::atof(line.substr(line.find(':') + 1).c_str());
      }
    }
  }
  return out;
}

// Switches per thread since `before` (switchesByThread of the same kind).
inline std::map<std::string, double> switchesSince(
    const std::map<std::string, double>& before, bool voluntaryOnly = false) {
  std::map<std::string, double> out;
  for (const auto& [name, n] : switchesByThread(voluntaryOnly)) {
    auto it = before.find(name);
    out[name] = n - (it == before.end() ? 0 : it->second);
  }
  return out;
}

// " name=switches per call" for each thread of `counts` that switched at
// least once every 20 calls.
inline std::string perCallByThread(const std::map<std::string, double>& counts,
                                   double calls) {
  std::string out;
  for (const auto& [name, n] : counts) {
    const double d = n / calls;
    if (d >= 0.05) {
      char buf[128];
      std::snprintf(buf, sizeof(buf), " %s=%.2f", name.c_str(), d);
      out += buf;
    }
  }
  return out;
}

// The same for the switches since `before`.
inline std::string switchesPerCall(const std::map<std::string, double>& before,
                                   int calls, bool voluntaryOnly = false) {
  return perCallByThread(switchesSince(before, voluntaryOnly), calls);
}

// This program again (/proc/self/exe), with `argv` (null-terminated) and
// this environment: a bench's second process (a callee, a ps). Exits the
// bench, naming `bench`, when the spawn fails.
inline pid_t spawnSelf(const char* bench, std::vector<const char*> argv,
                       const posix_spawn_file_actions_t* actions = nullptr) {
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, "/proc/self/exe", actions, nullptr,
                               const_cast<char* const*>(argv.data()), environ);
  if (rc != 0) {
    std::fprintf(stderr, "%s: spawn: %s\n", bench, std::strerror(rc));
    std::exit(1);
  }
  return pid;
}

// Waits for a child this bench started, at most `limit`; kills it by its
// PID when it takes longer. Its exit code, 128 + the signal when a signal
// ended it, 1 when it had to be killed.
inline int reapChild(const char* bench, pid_t pid,
                     std::chrono::seconds limit = std::chrono::seconds(60)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (std::chrono::steady_clock::now() < end) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    ::usleep(10'000);
  }
  std::fprintf(stderr, "%s: child %d did not exit; killing it\n", bench,
               static_cast<int>(pid));
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return 1;
}

// n bytes with every page touched once: fresh pages fault at a fraction of
// copy bandwidth and would measure the kernel, not the code.
inline std::vector<uint8_t> prefaulted(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; i += 4096) {
    v[i] = 1;
  }
  return v;
}

inline constexpr size_t kHugePage = size_t{2} << 20;

// Memory on transparent huge pages, unmapped when dropped. THP here is in
// `madvise` mode: only advised ranges get huge pages, and only whole 2 MiB
// aligned pieces of them, so the range is aligned and rounded up to that.
class HugePageBuffer {
 public:
  explicit HugePageBuffer(size_t n)
      : size_((n + kHugePage - 1) / kHugePage * kHugePage) {
    // mmap aligns to 4 KiB only: map one huge page more and trim the ends.
    const size_t span = size_ + kHugePage;
    void* p = ::mmap(nullptr, span, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("mmap");
      std::exit(1);
    }
    const auto base = reinterpret_cast<uintptr_t>(p);
    const uintptr_t start = (base + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t end = start + size_;
    if (start > base) {
      ::munmap(p, start - base);
    }
    if (base + span > end) {
      ::munmap(reinterpret_cast<void*>(end), base + span - end);
    }
    data_ = reinterpret_cast<uint8_t*>(start);
    if (::madvise(data_, size_, MADV_HUGEPAGE) != 0) {
      // A kernel without THP: the rows then measure 4 KiB pages; say so.
      note(std::string("madvise(MADV_HUGEPAGE): ") + std::strerror(errno));
    }
    // Fault it in now (one huge page per 2 MiB where granted).
    for (size_t i = 0; i < size_; i += 4096) {
      data_[i] = 1;
    }
  }
  HugePageBuffer(HugePageBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(o.size_) {}
  HugePageBuffer(const HugePageBuffer&) = delete;
  HugePageBuffer& operator=(const HugePageBuffer&) = delete;
  HugePageBuffer& operator=(HugePageBuffer&&) = delete;
  ~HugePageBuffer() {
    if (data_ != nullptr) {
      ::munmap(data_, size_);
    }
  }

  uint8_t* data() const { return data_; }

  // The share (0..1) of the mapping holding this buffer that the kernel
  // backs with huge pages (/proc/self/smaps); -1 if it cannot tell. The
  // advice is only a request: fragmented memory gets 4 KiB pages.
  double hugeShare() const {
    std::FILE* f = std::fopen("/proc/self/smaps", "r");
    if (f == nullptr) {
      return -1;
    }
    const auto p = reinterpret_cast<uintptr_t>(data_);
    bool inside = false;
    double sizeKb = 0;
    double hugeKb = -1;
    char line[512];
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      unsigned long lo = 0;
      unsigned long hi = 0;
      double kb = 0;
      if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {
        if (inside) {
          break;  // past our mapping's fields
        }
        inside = p >= lo && p < hi;
      } else if (inside && std::sscanf(line, "Size: %lf", &kb) == 1) {
        sizeKb = kb;
      } else if (inside && std::sscanf(line, "AnonHugePages: %lf", &kb) == 1) {
        hugeKb = kb;
      }
    }
    std::fclose(f);
    return sizeKb > 0 && hugeKb >= 0 ? hugeKb / sizeKb : -1;
  }

 private:
  uint8_t* data_;
  size_t size_;
};

// A benchmark buffer of n bytes, mapped before timing, on 4 KiB pages or on
// huge pages: the page size sets the speed of process_vm_readv (cma), so
// the benches say which one a row used.
class Buffer {
 public:
  Buffer(size_t n, bool hugePages) : size_(n) {
    if (hugePages) {
      huge_.emplace(n);
    } else {
      small_ = prefaulted(n);
    }
  }
  uint8_t* data() { return huge_ ? huge_->data() : small_.data(); }
  size_t size() const { return size_; }
  // For a huge-page buffer, HugePageBuffer::hugeShare(); 0 otherwise.
  double hugeShare() const { return huge_ ? huge_->hugeShare() : 0; }

 private:
  size_t size_;
  std::vector<uint8_t> small_;
  std::optional<HugePageBuffer> huge_;
};

}  // namespace trellis::bench
