#include <algorithm>
#include <unordered_set>

#include <trellis/core/text.h>
#include <trellis/elastic/round_record.h>

namespace trellis::elastic {

using namespace detail;

namespace {

constexpr std::string_view kMagicWord = "trellis-rdzv-round";

bool printable(char c) {
  return static_cast<unsigned char>(c) >= 0x20 &&
         static_cast<unsigned char>(c) < 0x7f;
}

// Line 1: the magic word and our version, or an error that tells another
// version (agents of two releases in one job) from text that is no record.
Error checkFirstLine(std::string_view line) {
  const std::string expected =
      std::string(kMagicWord) + " " + std::to_string(kRoundRecordVersion);
  if (line == expected) {
    return Error();
  }
  if (line.size() > kMagicWord.size() + 1 &&
      line.substr(0, kMagicWord.size() + 1) == std::string(kMagicWord) + " ") {
    const auto version = parseDecimal(line.substr(kMagicWord.size() + 1));
    if (version && *version >= 0) {
      return garbage("it is format version " + std::to_string(*version) +
                     "; this elastic-run reads version " +
                     std::to_string(kRoundRecordVersion) +
                     " (do all nodes run the same Trellis release?)");
    }
  }
  return garbage("line 1 is not '" + expected + "': not a round record");
}

}  // namespace

namespace detail {

Error garbage(const std::string& why) {
  return Error::protocol(std::string("rendezvous record '") + kRoundKey +
                         "' is not valid: " + why);
}

void checkToken(std::string_view what, std::string_view s) {
  if (!isRecordToken(s)) {
    throw InvalidArgumentError(Error::invalidArgument(
        std::string(what) + " '" + std::string(s) +
        "' cannot go into the rendezvous record: it must be 1 to " +
        std::to_string(kMaxRecordField) +
        " printable ASCII characters without spaces"));
  }
}

}  // namespace detail

const char* roundPhaseName(RoundPhase phase) {
  switch (phase) {
    case RoundPhase::kJoining:
      return "joining";
    case RoundPhase::kClosed:
      return "closed";
    case RoundPhase::kFailed:
      return "failed";
  }
  return "?";
}

bool isRecordToken(std::string_view s) {
  if (s.empty() || s.size() > kMaxRecordField) {
    return false;
  }
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return printable(c) && c != ' '; });
}

std::string encodeRoundRecord(const RoundRecord& r) {
  checkToken("the run id", r.runId);
  std::string out(kMagicWord);
  out += " " + std::to_string(kRoundRecordVersion);
  out += "\nrun " + r.runId;
  out += "\nnproc " + std::to_string(r.nproc);
  out += "\nround " + std::to_string(r.round);
  out += std::string("\nphase ") + roundPhaseName(r.phase);
  out += "\nrestarts " + std::to_string(r.restarts);
  for (const auto& n : r.participants) {
    checkToken("the node id", n.id);
    checkToken("the node address", n.addr);
    out += "\nnode " + n.id + " " + n.addr;
  }
  for (const auto& w : r.waiting) {
    checkToken("the node id", w);
    out += "\nwaiting " + w;
  }
  std::string note = r.note.substr(0, kMaxRecordField);
  for (char& c : note) {
    if (!printable(c)) {
      c = '?';
    }
  }
  out += "\nnote " + note + "\n";
  return out;
}

Error decodeRoundRecord(std::string_view text, RoundRecord* out) {
  if (text.empty()) {
    return garbage("it is empty");
  }
  if (text.size() > kMaxRecordBytes) {
    return garbage("it is " + std::to_string(text.size()) +
                   " bytes long; a record is at most " +
                   std::to_string(kMaxRecordBytes));
  }
  RoundRecord r;
  bool seen[6] = {};  // run nproc round phase restarts note
  // Views into `text`, which outlives the decode: duplicates are found in
  // constant time, so a record of kMaxRecordNodes nodes costs no more than
  // reading it.
  std::unordered_set<std::string_view> nodeIds;
  std::unordered_set<std::string_view> waitingIds;
  size_t pos = 0;
  size_t lineNo = 0;
  auto number = [](std::string_view v, int64_t lo, int64_t hi,
                   int64_t* to) -> bool {
    const auto n = parseDecimal(v);
    if (!n || *n < lo || *n > hi) {
      return false;
    }
    *to = *n;
    return true;
  };
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    if (nl == std::string_view::npos) {
      return garbage("line " + std::to_string(lineNo + 1) +
                     " does not end with a newline (truncated?)");
    }
    const std::string_view line = text.substr(pos, nl - pos);
    pos = nl + 1;
    ++lineNo;
    const std::string where = "line " + std::to_string(lineNo);
    if (lineNo == 1) {
      if (Error e = checkFirstLine(line); !e.ok()) {
        return e;
      }
      continue;
    }
    const size_t sp = line.find(' ');
    if (sp == std::string_view::npos) {
      return garbage(where + " has no value");
    }
    const std::string_view field = line.substr(0, sp);
    const std::string_view value = line.substr(sp + 1);
    auto once = [&](int i) {
      if (seen[i]) {
        return false;
      }
      seen[i] = true;
      return true;
    };
    int64_t n = 0;
    if (field == "run") {
      if (!once(0) || !isRecordToken(value)) {
        return garbage(where + ": a bad or repeated run id");
      }
      r.runId = value;
    } else if (field == "nproc") {
      if (!once(1) || !number(value, 1, 1 << 20, &n)) {
        return garbage(where + ": a bad or repeated nproc (1 to " +
                       std::to_string(1 << 20) + ")");
      }
      r.nproc = static_cast<int32_t>(n);
    } else if (field == "round") {
      if (!once(2) || !number(value, 0, int64_t{1} << 62, &n)) {
        return garbage(where + ": a bad or repeated round number");
      }
      r.round = n;
    } else if (field == "phase") {
      if (!once(3)) {
        return garbage(where + ": a repeated phase");
      }
      if (value == "joining") {
        r.phase = RoundPhase::kJoining;
      } else if (value == "closed") {
        r.phase = RoundPhase::kClosed;
      } else if (value == "failed") {
        r.phase = RoundPhase::kFailed;
      } else {
        return garbage(where + ": unknown phase");
      }
    } else if (field == "restarts") {
      if (!once(4) || !number(value, 0, 1 << 30, &n)) {
        return garbage(where + ": a bad or repeated restart count");
      }
      r.restarts = static_cast<int32_t>(n);
    } else if (field == "node") {
      const size_t sp2 = value.find(' ');
      if (sp2 == std::string_view::npos ||
          !isRecordToken(value.substr(0, sp2)) ||
          !isRecordToken(value.substr(sp2 + 1))) {
        return garbage(where + ": a node needs an id and an address");
      }
      if (r.participants.size() >= kMaxRecordNodes) {
        return garbage(where + ": more than " +
                       std::to_string(kMaxRecordNodes) + " nodes");
      }
      const std::string_view id = value.substr(0, sp2);
      if (!nodeIds.insert(id).second) {
        return garbage(where + ": node '" + std::string(id) +
                       "' appears twice");
      }
      r.participants.push_back(
          RoundNode{std::string(id), std::string(value.substr(sp2 + 1))});
    } else if (field == "waiting") {
      if (!isRecordToken(value) || !waitingIds.insert(value).second) {
        return garbage(where + ": a bad or repeated waiting node");
      }
      if (r.waiting.size() >= kMaxRecordNodes) {
        return garbage(where + ": more than " +
                       std::to_string(kMaxRecordNodes) + " waiting nodes");
      }
      r.waiting.emplace_back(value);
    } else if (field == "note") {
      if (!once(5) || value.size() > kMaxRecordField ||
          !std::all_of(value.begin(), value.end(), printable)) {
        return garbage(where + ": a bad or repeated note");
      }
      r.note = value;
    } else {
      return garbage(where + ": unknown field");
    }
  }
  static constexpr const char* kNames[6] = {"run",   "nproc",    "round",
                                            "phase", "restarts", "note"};
  for (int i = 0; i < 6; ++i) {
    if (!seen[i]) {
      return garbage(std::string("the '") + kNames[i] + "' line is missing");
    }
  }
  for (const auto& w : r.waiting) {
    if (nodeIds.count(w) != 0) {
      return garbage("node '" + w + "' is both a participant and waiting");
    }
  }
  if (r.phase == RoundPhase::kClosed && r.participants.empty()) {
    return garbage("a closed round without nodes");
  }
  *out = std::move(r);
  return Error();
}

}  // namespace trellis::elastic
