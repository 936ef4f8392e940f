#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <trellis/collectives/flight_recorder.h>

namespace trellis::collectives::detail {

std::string_view toString(OpState s) {
  switch (s) {
    case OpState::kScheduled:
      return "scheduled";
    case OpState::kStarted:
      return "started";
    case OpState::kCompleted:
      return "completed";
    case OpState::kFailed:
      return "failed";
  }
  return "unknown";
}

std::string FlightEntry::describe() const {
  if (fp.op != OpType::kSend && fp.op != OpType::kRecv) {
    return fp.toString();
  }
  std::string s(detail::toString(fp.op));
  s += "(" + std::string(detail::toString(fp.dtype)) + "[" +
       std::to_string(fp.count) + "], ";
  if (fp.op == OpType::kSend) {
    s += "to rank " + std::to_string(peer);
  } else if (peer < 0) {
    s += "from any rank";
  } else {
    s += "from rank " + std::to_string(peer);
  }
  return s + ", tag " + std::to_string(tag) + ")";
}

FlightRecorder::FlightRecorder(size_t capacity) : capacity_(capacity) {}

FlightEntry* FlightRecorder::inRing(uint64_t id) {
  if (capacity_ == 0 || ring_.empty()) {
    return nullptr;
  }
  FlightEntry& e = ring_[(id - 1) % capacity_];
  return e.id == id ? &e : nullptr;
}

FlightEntry* FlightRecorder::inPending(uint64_t id) {
  for (FlightEntry& e : pending_) {
    if (e.id == id) {
      return &e;
    }
  }
  return nullptr;
}

uint64_t FlightRecorder::scheduled(const Fingerprint& fp, int peer, int64_t tag,
                                   std::span<const int64_t> shape) {
  FlightEntry e;
  e.fp = fp;
  e.peer = peer;
  e.tag = tag;
  e.ndim = static_cast<uint8_t>(std::min<size_t>(shape.size(), 255));
  for (size_t i = 0; i < shape.size() && i < kMaxRecordedDims; ++i) {
    e.shape[i] = shape[i];
  }
  e.enqueued = std::chrono::steady_clock::now();
  MutexLock lock(mu_);
  e.id = nextId_++;
  if (capacity_ > 0) {
    if (ring_.size() < capacity_) {
      ring_.push_back(e);
    } else {
      ring_[(e.id - 1) % capacity_] = e;
    }
  }
  pending_.push_back(std::move(e));
  return nextId_ - 1;
}

void FlightRecorder::started(uint64_t id) {
  const auto now = std::chrono::steady_clock::now();
  MutexLock lock(mu_);
  FlightEntry* p = inPending(id);
  if (p == nullptr) {
    return;
  }
  p->state = OpState::kStarted;
  p->started = now;
  if (FlightEntry* r = inRing(id)) {
    r->state = OpState::kStarted;
    r->started = now;
  }
  if (p->fp.seq > progress_.startedSeq) {
    progress_.startedSeq = p->fp.seq;
    progress_.started = p->fp;
  }
}

void FlightRecorder::finished(uint64_t id, const Error& error) {
  const auto now = std::chrono::steady_clock::now();
  MutexLock lock(mu_);
  const OpState state = error.ok() ? OpState::kCompleted : OpState::kFailed;
  if (FlightEntry* r = inRing(id)) {
    r->state = state;
    r->ended = now;
    if (!error.ok()) {
      r->error = error.what();
    }
  }
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (it->id == id) {
      if (error.ok() && it->fp.seq > progress_.completedSeq) {
        progress_.completedSeq = it->fp.seq;
      }
      pending_.erase(it);
      break;
    }
  }
  if (!error.ok()) {
    progress_.failed = true;
  }
}

std::vector<FlightEntry> FlightRecorder::entries() const {
  MutexLock lock(mu_);
  std::vector<FlightEntry> out;
  out.reserve(ring_.size());
  if (ring_.size() < capacity_ || capacity_ == 0) {
    out = ring_;
  } else {
    // Full: the oldest is the slot after the newest.
    const size_t newest = (nextId_ - 2) % capacity_;
    for (size_t i = 1; i <= capacity_; ++i) {
      out.push_back(ring_[(newest + i) % capacity_]);
    }
  }
  return out;
}

std::optional<FlightEntry> FlightRecorder::startedBefore(
    SteadyTime cutoff) const {
  MutexLock lock(mu_);
  const FlightEntry* oldest = nullptr;
  for (const FlightEntry& e : pending_) {
    if (e.state == OpState::kStarted &&
        (oldest == nullptr || e.started < oldest->started)) {
      oldest = &e;
    }
  }
  if (oldest == nullptr || oldest->started >= cutoff) {
    return std::nullopt;
  }
  return *oldest;
}

Progress FlightRecorder::progress() const {
  MutexLock lock(mu_);
  return progress_;
}

namespace {

// Steady times in a dump become wall-clock microseconds, through one pair
// of readings taken at dump time.
struct Clock {
  SteadyTime steady = std::chrono::steady_clock::now();
  std::chrono::system_clock::time_point wall = std::chrono::system_clock::now();
  nlohmann::json us(SteadyTime t) const {
    if (t == SteadyTime{}) {
      return nullptr;
    }
    const auto w =
        wall + std::chrono::duration_cast<std::chrono::system_clock::duration>(
                   t - steady);
    return std::chrono::duration_cast<std::chrono::microseconds>(
               w.time_since_epoch())
        .count();
  }
};

std::string hostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) {
    return "unknown";
  }
  return buf;
}

}  // namespace

std::string toJson(const GroupInfo& group,
                   const std::vector<FlightEntry>& entries,
                   const std::string& reason) {
  const Clock clock;
  nlohmann::json j;
  j["version"] = 1;
  j["group"] = group.name;
  j["group_id"] = group.groupId;
  j["backend"] = group.backend;
  j["rank"] = group.rank;
  j["world_size"] = group.size;
  j["timeout_ms"] = group.timeout.count();
  j["pid"] = static_cast<int64_t>(getpid());
  j["host"] = hostName();
  j["reason"] = reason;
  j["dumped_us"] = clock.us(clock.steady);
  auto& list = j["entries"] = nlohmann::json::array();
  for (const FlightEntry& e : entries) {
    nlohmann::json x;
    x["id"] = e.id;
    x["seq"] = e.fp.seq;
    x["op"] = std::string(detail::toString(e.fp.op));
    x["dtype"] = std::string(detail::toString(e.fp.dtype));
    x["count"] = e.fp.count;
    x["reduce_op"] = std::string(collectives::toString(e.fp.reduceOp));
    x["root"] = e.fp.root;
    x["peer"] = e.peer;
    x["tag"] = e.tag;
    auto& shape = x["shape"] = nlohmann::json::array();
    for (size_t i = 0; i < e.ndim && i < kMaxRecordedDims; ++i) {
      shape.push_back(e.shape[i]);
    }
    x["ndim"] = e.ndim;
    x["state"] = std::string(toString(e.state));
    x["enqueued_us"] = clock.us(e.enqueued);
    x["started_us"] = clock.us(e.started);
    x["ended_us"] = clock.us(e.ended);
    x["error"] =
        e.error.empty() ? nlohmann::json(nullptr) : nlohmann::json(e.error);
    x["description"] = e.describe();
    list.push_back(std::move(x));
  }
  // Error texts come from peers and may hold any bytes: replace what is not
  // UTF-8 rather than fail the dump.
  return j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Error writeDump(const std::string& dir, const GroupInfo& group,
                const std::vector<FlightEntry>& entries,
                const std::string& reason, std::string* path) {
  std::string file;
  for (char c : group.groupId) {
    const bool safe = std::isalnum(static_cast<unsigned char>(c)) || c == '-' ||
                      c == '_' || c == '.';
    file += safe ? c : '.';
  }
  file += "-rank" + std::to_string(group.rank) + ".json";
  const std::string target = dir + "/" + file;
  *path = target;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return Error(Code::kFailedPrecondition,
                 "flight recorder: cannot create " + dir + ": " + ec.message());
  }
  const std::string text = toJson(group, entries, reason);
  const std::string tmp = target + ".tmp" + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "we");
  if (f == nullptr) {
    return Error(
        Code::kFailedPrecondition,
        "flight recorder: cannot write " + tmp + ": " + std::strerror(errno));
  }
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed || std::rename(tmp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return Error(
        Code::kFailedPrecondition,
        "flight recorder: cannot write " + target + ": " + std::strerror(err));
  }
  return Error();
}

}  // namespace trellis::collectives::detail
