#include <algorithm>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include <trellis/collectives/flight_report.h>
#include <trellis/collectives/progress.h>

namespace trellis::collectives::detail {

namespace {

using nlohmann::json;

// Field readers: each fails with the field's name and what was wrong.
class Reader {
 public:
  Reader(const json& j, std::string where) : j_(j), where_(std::move(where)) {}

  Error string(const char* key, std::string* out, bool nullable = false) {
    const json* v = find(key);
    if (v == nullptr) {
      return missing(key);
    }
    if (nullable && v->is_null()) {
      out->clear();
      return Error();
    }
    if (!v->is_string()) {
      return wrong(key, "a string");
    }
    const auto& s = v->get_ref<const std::string&>();
    if (s.size() > kMaxDumpString) {
      return wrong(key, "at most " + std::to_string(kMaxDumpString) + " bytes");
    }
    *out = s;
    return Error();
  }

  template <typename T>
  Error integer(const char* key, T* out, int64_t lo, int64_t hi) {
    const json* v = find(key);
    if (v == nullptr) {
      return missing(key);
    }
    if (v->is_number_unsigned()) {
      const auto x = v->get<uint64_t>();
      if (x > static_cast<uint64_t>(hi)) {
        return range(key, lo, hi);
      }
      *out = static_cast<T>(x);
      return Error();
    }
    if (!v->is_number_integer()) {
      return wrong(key, "an integer");
    }
    const auto x = v->get<int64_t>();
    if (x < lo || x > hi) {
      return range(key, lo, hi);
    }
    *out = static_cast<T>(x);
    return Error();
  }

  Error optionalTime(const char* key, std::optional<int64_t>* out) {
    const json* v = find(key);
    if (v == nullptr || v->is_null()) {
      out->reset();
      return Error();
    }
    int64_t x = 0;
    if (Error e = integer(key, &x, 0, INT64_MAX); !e.ok()) {
      return e;
    }
    *out = x;
    return Error();
  }

  const json* find(const char* key) const {
    auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }

  Error wrong(const char* key, const std::string& what) const {
    return Error(Code::kInvalidArgument,
                 where_ + ": field '" + key + "' must be " + what);
  }

 private:
  Error missing(const char* key) const {
    return Error(Code::kInvalidArgument,
                 where_ + ": field '" + key + "' is missing");
  }
  Error range(const char* key, int64_t lo, int64_t hi) const {
    return wrong(key,
                 "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }

  const json& j_;
  std::string where_;
};

#define TRELLIS_TRY(expr)                       \
  do {                                          \
    if (Error e_ = (expr); !e_.ok()) return e_; \
  } while (0)

Error parseEntry(const json& j, size_t index, DumpEntry* e) {
  if (!j.is_object()) {
    return Error(Code::kInvalidArgument,
                 "entries[" + std::to_string(index) + "] is not an object");
  }
  Reader r(j, "entries[" + std::to_string(index) + "]");
  TRELLIS_TRY(r.integer("id", &e->id, 0, INT64_MAX));
  TRELLIS_TRY(r.integer("seq", &e->seq, 0, INT64_MAX));
  TRELLIS_TRY(r.string("op", &e->op));
  TRELLIS_TRY(r.string("dtype", &e->dtype));
  TRELLIS_TRY(r.string("reduce_op", &e->reduceOp));
  TRELLIS_TRY(r.integer("count", &e->count, 0, INT64_MAX));
  TRELLIS_TRY(r.integer("root", &e->root, -1, kMaxDumpWorldSize));
  TRELLIS_TRY(r.integer("peer", &e->peer, -1, kMaxDumpWorldSize));
  TRELLIS_TRY(r.integer("tag", &e->tag, INT64_MIN, INT64_MAX));
  TRELLIS_TRY(r.string("state", &e->state));
  static const std::set<std::string> kStates = {"scheduled", "started",
                                                "completed", "failed"};
  if (!kStates.count(e->state)) {
    return r.wrong("state", "one of scheduled, started, completed, failed");
  }
  TRELLIS_TRY(r.string("description", &e->description));
  TRELLIS_TRY(r.string("error", &e->error, /*nullable=*/true));
  TRELLIS_TRY(r.optionalTime("enqueued_us", &e->enqueuedUs));
  TRELLIS_TRY(r.optionalTime("started_us", &e->startedUs));
  TRELLIS_TRY(r.optionalTime("ended_us", &e->endedUs));
  const json* shape = r.find("shape");
  if (shape == nullptr || !shape->is_array() || shape->size() > 64) {
    return r.wrong("shape", "an array of at most 64 integers");
  }
  for (const json& d : *shape) {
    if (!d.is_number_integer()) {
      return r.wrong("shape", "an array of integers");
    }
    e->shape.push_back(d.get<int64_t>());
  }
  return Error();
}

std::string ranksText(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + rankList(ranks);
}

// One group's dumps, by rank.
std::string compareGroup(const std::vector<const Dump*>& dumps, bool* problem) {
  const Dump& first = *dumps.front();
  std::string out = "group '" + first.group + "' (" + first.groupId + ", " +
                    first.backend + ", world size " +
                    std::to_string(first.worldSize) + "):\n";
  std::map<int, const Dump*> byRank;
  for (const Dump* d : dumps) {
    if (d->worldSize != first.worldSize) {
      out += "  " + d->source + " says world size " +
             std::to_string(d->worldSize) + ", " + first.source + " says " +
             std::to_string(first.worldSize) + "\n";
      *problem = true;
    }
    if (byRank.count(d->rank)) {
      out += "  two files for rank " + std::to_string(d->rank) + ": " +
             byRank[d->rank]->source + " and " + d->source +
             " (the first is used)\n";
      continue;
    }
    byRank[d->rank] = d;
  }
  std::vector<int> absent;
  for (int r = 0; r < first.worldSize; ++r) {
    if (!byRank.count(r)) {
      absent.push_back(r);
    }
  }
  if (!absent.empty()) {
    out += "  no file from " + ranksText(absent) +
           ": it could not write (stopped, hung or dead) or was never asked\n";
    *problem = true;
  }
  // Each rank's collectives by sequence number; the window all rings
  // still hold starts at the latest first entry.
  std::map<int, std::map<uint64_t, const DumpEntry*>> seqs;
  uint64_t lo = 1, hi = 0;
  for (const auto& [rank, d] : byRank) {
    auto& m = seqs[rank];
    for (const DumpEntry& e : d->entries) {
      if (e.seq > 0) {
        m[e.seq] = &e;
      }
    }
    if (!m.empty()) {
      lo = std::max(lo, m.begin()->first);
      hi = std::max(hi, m.rbegin()->first);
    }
  }
  for (uint64_t s = lo; s <= hi; ++s) {
    std::map<std::string, std::vector<int>> byPrint;
    std::vector<int> never;
    std::map<std::string, std::vector<int>> byState;
    std::string what;
    for (const auto& [rank, m] : seqs) {
      auto it = m.find(s);
      if (it == m.end()) {
        never.push_back(rank);
        continue;
      }
      byPrint[it->second->fingerprint()].push_back(rank);
      std::string st = it->second->state;
      if (!it->second->error.empty()) {
        st += " (" + it->second->error + ")";
      }
      byState[st].push_back(rank);
      what = it->second->description;
    }
    if (byPrint.size() > 1) {
      out += "  first disagreement at seq " + std::to_string(s) + ":";
      for (const auto& [print, ranks] : byPrint) {
        out += " " + ranksText(ranks) + " called " + print + ";";
      }
      out.back() = '\n';
      *problem = true;
      return out;
    }
    if (!never.empty()) {
      out += "  first collective not entered by every rank: " + what +
             "; never entered by " + ranksText(never) + " (";
      for (size_t i = 0; i < never.size(); ++i) {
        const auto& m = seqs[never[i]];
        out += (i ? "; " : "") + std::string("rank ") +
               std::to_string(never[i]) + " last recorded " +
               (m.empty() ? std::string("nothing")
                          : m.rbegin()->second->description + ", " +
                                m.rbegin()->second->state);
      }
      out += ")\n  likely culprit: " + ranksText(never) + "\n";
      *problem = true;
      return out;
    }
    if (byState.size() > 1 || byState.begin()->first != "completed") {
      out +=
          "  first collective that did not complete everywhere: " + what + ":";
      // The ranks still in it first, those that completed it last.
      std::vector<std::pair<std::string, std::vector<int>>> states(
          byState.begin(), byState.end());
      std::stable_sort(
          states.begin(), states.end(), [](const auto& x, const auto& y) {
            return (x.first == "completed") < (y.first == "completed");
          });
      for (const auto& [state, ranks] : states) {
        out += " " + ranksText(ranks) + " " + state + ";";
      }
      out.back() = '\n';
      if (!absent.empty()) {
        out += "  likely culprit: " + ranksText(absent) +
               " (no file: it could not write)\n";
      }
      *problem = true;
      return out;
    }
  }
  if (hi >= lo) {
    out += "  every rank with a file completed seq " + std::to_string(lo) +
           " to " + std::to_string(hi) + " with the same collectives\n";
  } else {
    out += "  no collective recorded\n";
  }
  return out;
}

}  // namespace

std::string DumpEntry::fingerprint() const {
  std::string s = op + "(" + dtype + "[" + std::to_string(count) + "]";
  if (op == "allreduce" || op == "reduce" || op == "reduceScatter" ||
      op == "allreduceCoalesced") {
    s += ", " + reduceOp;
  }
  if (root >= 0) {
    s += ", root " + std::to_string(root);
  }
  return s + ")";
}

Error parseDump(std::string_view text, Dump* out) {
  const json j = json::parse(text.begin(), text.end(), nullptr,
                             /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return Error(Code::kInvalidArgument, "not valid JSON");
  }
  if (!j.is_object()) {
    return Error(Code::kInvalidArgument, "not a JSON object");
  }
  Reader r(j, "dump");
  int version = 0;
  TRELLIS_TRY(r.integer("version", &version, 0, 1000));
  if (version != 1) {
    return Error(Code::kInvalidArgument, "dump version " +
                                             std::to_string(version) +
                                             " (this tool reads version 1)");
  }
  TRELLIS_TRY(r.string("group", &out->group));
  TRELLIS_TRY(r.string("group_id", &out->groupId));
  TRELLIS_TRY(r.string("backend", &out->backend));
  TRELLIS_TRY(r.string("host", &out->host));
  TRELLIS_TRY(r.string("reason", &out->reason));
  TRELLIS_TRY(r.integer("world_size", &out->worldSize, 1, kMaxDumpWorldSize));
  TRELLIS_TRY(r.integer("rank", &out->rank, 0, out->worldSize - 1));
  TRELLIS_TRY(r.integer("pid", &out->pid, 0, INT64_MAX));
  const json* entries = r.find("entries");
  if (entries == nullptr || !entries->is_array()) {
    return r.wrong("entries", "an array");
  }
  if (entries->size() > kMaxDumpEntries) {
    return r.wrong("entries",
                   "at most " + std::to_string(kMaxDumpEntries) + " long");
  }
  out->entries.clear();
  out->entries.reserve(entries->size());
  for (size_t i = 0; i < entries->size(); ++i) {
    DumpEntry e;
    TRELLIS_TRY(parseEntry((*entries)[i], i, &e));
    out->entries.push_back(std::move(e));
  }
  return Error();
}

Report compareDumps(const std::vector<Dump>& dumps) {
  Report report;
  std::map<std::string, std::vector<const Dump*>> groups;
  for (const Dump& d : dumps) {
    groups[d.groupId].push_back(&d);
  }
  for (const auto& [id, list] : groups) {
    report.text += compareGroup(list, &report.problem);
  }
  if (groups.empty()) {
    report.text = "no dumps\n";
  }
  return report;
}

}  // namespace trellis::collectives::detail
