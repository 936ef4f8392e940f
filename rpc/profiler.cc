#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <utility>

#include <nlohmann/json.hpp>

#include <trellis/core/error.h>
#include <trellis/rpc/profiler.h>

namespace trellis::rpc {
namespace {

struct Collector {
  Mutex mu;
  std::atomic<int> active{0};
  // Events of the current profiling session; cleared when the last
  // profiler ends. `base` keeps each profiler's start index valid.
  std::vector<ProfileEvent> events TRELLIS_GUARDED_BY(mu);
  size_t base TRELLIS_GUARDED_BY(mu) = 0;
};

Collector& collector() {
  static Collector c;
  return c;
}

std::atomic<uint64_t> gNextThreadId{1};
thread_local uint64_t tThreadId = 0;
thread_local std::shared_ptr<NestedEvents> tNested;

}  // namespace

uint64_t profilerThreadId() {
  if (tThreadId == 0) {
    tThreadId = gNextThreadId.fetch_add(1, std::memory_order_relaxed);
  }
  return tThreadId;
}

void NestedEvents::add(ProfileEvent event) {
  MutexLock lock(mu);
  events.push_back(std::move(event));
}

std::vector<ProfileEvent> NestedEvents::take() {
  std::vector<ProfileEvent> out;
  MutexLock lock(mu);
  out.swap(events);
  return out;
}

NestedProfileScope::NestedProfileScope(std::shared_ptr<NestedEvents> sink)
    : previous_(std::exchange(tNested, std::move(sink))) {}

NestedProfileScope::~NestedProfileScope() { tNested = std::move(previous_); }

const std::shared_ptr<NestedEvents>& NestedProfileScope::current() {
  return tNested;
}

int64_t profilerNowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Profiler::Profiler() {
  Collector& c = collector();
  MutexLock lock(c.mu);
  start_ = c.base + c.events.size();
  c.active.fetch_add(1);
}

Profiler::~Profiler() {
  Collector& c = collector();
  MutexLock lock(c.mu);
  if (c.active.fetch_sub(1) == 1) {
    c.base += c.events.size();
    c.events.clear();
  }
}

bool Profiler::active() {
  return collector().active.load(std::memory_order_relaxed) > 0;
}

void Profiler::record(ProfileEvent event) {
  Collector& c = collector();
  MutexLock lock(c.mu);
  if (c.active.load() > 0) {
    c.events.push_back(std::move(event));
  }
}

std::vector<ProfileEvent> Profiler::events() const {
  Collector& c = collector();
  MutexLock lock(c.mu);
  const size_t from = start_ > c.base ? start_ - c.base : 0;
  if (from >= c.events.size()) {
    return {};
  }
  return std::vector<ProfileEvent>(c.events.begin() + from, c.events.end());
}

std::string Profiler::chromeTrace() const {
  auto evs = events();
  nlohmann::json trace = nlohmann::json::array();
  std::map<std::string, int> pids;
  for (const auto& e : evs) {
    auto [it, fresh] = pids.emplace(e.worker, static_cast<int>(pids.size()));
    if (fresh) {
      trace.push_back({{"ph", "M"},
                       {"name", "process_name"},
                       {"pid", it->second},
                       {"args", {{"name", e.worker}}}});
    }
    trace.push_back({{"ph", "X"},
                     {"cat", "rpc"},
                     {"name", e.name},
                     {"pid", it->second},
                     {"tid", e.thread},
                     {"ts", e.startUs},
                     {"dur", e.durationUs}});
  }
  nlohmann::json out;
  out["traceEvents"] = std::move(trace);
  out["displayTimeUnit"] = "ms";
  // Names come from peers as bytes (envelope.proto): what is not UTF-8 is
  // replaced, where json would throw.
  return out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void Profiler::exportChromeTrace(const std::string& path) const {
  const std::string json = chromeTrace();
  std::FILE* f = std::fopen(path.c_str(), "we");
  if (f == nullptr) {
    throwError(Error::fromErrno(errno, "open " + path));
  }
  const size_t n = std::fwrite(json.data(), 1, json.size(), f);
  const int err = errno;
  if (std::fclose(f) != 0 || n != json.size()) {
    throwError(Error::fromErrno(err != 0 ? err : EIO, "write " + path));
  }
}

}  // namespace trellis::rpc
