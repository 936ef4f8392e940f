#include <algorithm>
#include <charconv>
#include <map>

#include <trellis/collectives/progress.h>

namespace trellis::collectives::detail {

namespace {

constexpr std::string_view kMagic = "trellis-progress";
constexpr size_t kMaxDescriptionBytes = 512;

bool nextToken(std::string_view& line, std::string_view* token) {
  while (!line.empty() && line.front() == ' ') {
    line.remove_prefix(1);
  }
  if (line.empty()) {
    return false;
  }
  const size_t end = std::min(line.find(' '), line.size());
  *token = line.substr(0, end);
  line.remove_prefix(end);
  return true;
}

template <typename T>
bool parseNumber(std::string_view token, T* out) {
  const auto [ptr, ec] =
      std::from_chars(token.data(), token.data() + token.size(), *out);
  return ec == std::errc() && ptr == token.data() + token.size();
}

RankReport malformed(std::string problem) {
  RankReport r;
  r.kind = RankReport::Kind::kMalformed;
  r.problem = std::move(problem);
  return r;
}

std::string plural(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + rankList(ranks);
}

}  // namespace

std::string encodeProgress(const Progress& p, uint64_t beat, int64_t wallUs) {
  std::string d = p.startedSeq == 0 ? "" : p.started.toString();
  if (d.size() > kMaxDescriptionBytes) {
    d.resize(kMaxDescriptionBytes);
  }
  return std::string(kMagic) + " 1 " + std::to_string(beat) + " " +
         std::to_string(wallUs) + " " + std::to_string(p.startedSeq) + " " +
         std::to_string(p.completedSeq) + " " + (p.failed ? "1" : "0") + "\n" +
         d;
}

RankReport decodeProgress(std::string_view text) {
  if (text.size() > kMaxProgressBytes) {
    return malformed("report of " + std::to_string(text.size()) +
                     " bytes (at most " + std::to_string(kMaxProgressBytes) +
                     ")");
  }
  const size_t nl = text.find('\n');
  if (nl == std::string_view::npos) {
    return malformed("report without a description line");
  }
  std::string_view line = text.substr(0, nl);
  std::string_view tok;
  if (!nextToken(line, &tok) || tok != kMagic) {
    return malformed("report does not start with '" + std::string(kMagic) +
                     "'");
  }
  int version = 0;
  if (!nextToken(line, &tok) || !parseNumber(tok, &version) || version != 1) {
    return malformed("report of an unknown version");
  }
  RankReport r;
  int failed = 0;
  const char* fields[] = {"beat", "time", "started seq", "completed seq",
                          "failed flag"};
  for (int i = 0; i < 5; ++i) {
    bool ok = nextToken(line, &tok);
    switch (i) {
      case 0:
        ok = ok && parseNumber(tok, &r.beat);
        break;
      case 1:
        ok = ok && parseNumber(tok, &r.wallUs);
        break;
      case 2:
        ok = ok && parseNumber(tok, &r.startedSeq);
        break;
      case 3:
        ok = ok && parseNumber(tok, &r.completedSeq);
        break;
      default:
        ok = ok && parseNumber(tok, &failed) && (failed == 0 || failed == 1);
        break;
    }
    if (!ok) {
      return malformed(std::string("report with a bad ") + fields[i]);
    }
  }
  if (nextToken(line, &tok)) {
    return malformed("report with trailing fields");
  }
  std::string_view d = text.substr(nl + 1);
  if (d.size() > kMaxDescriptionBytes) {
    return malformed("report with a description over " +
                     std::to_string(kMaxDescriptionBytes) + " bytes");
  }
  for (char c : d) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return malformed("report with a control character in its description");
    }
  }
  r.kind = RankReport::Kind::kValid;
  r.failed = failed == 1;
  r.startedDescription = std::string(d);
  return r;
}

std::string rankList(const std::vector<int>& ranks) {
  std::vector<int> s = ranks;
  std::sort(s.begin(), s.end());
  std::string out;
  for (size_t i = 0; i < s.size();) {
    size_t j = i;
    while (j + 1 < s.size() && s[j + 1] == s[j] + 1) {
      ++j;
    }
    out += (out.empty() ? "" : ", ") + std::to_string(s[i]);
    if (j > i) {
      out += "-" + std::to_string(s[j]);
    }
    i = j + 1;
  }
  return out;
}

Analysis analyse(uint64_t seq, const std::string& description, int self,
                 const std::vector<RankReport>& reports, int64_t nowUs,
                 std::chrono::milliseconds staleAfter) {
  // Ranks with the same story are told together, in this order.
  enum Order { kNeverEntered, kSilent, kOther, kWaiting, kDone };
  std::map<std::pair<int, std::string>, std::vector<int>> stories;
  Analysis a;
  const int64_t staleUs = staleAfter.count() * 1000;
  for (size_t i = 0; i < reports.size(); ++i) {
    const int rank = static_cast<int>(i);
    const RankReport& r = reports[i];
    if (r.kind == RankReport::Kind::kMissing) {
      stories[{kNeverEntered,
               "published no progress (it never started an op of this group "
               "or cannot reach the store)"}]
          .push_back(rank);
      a.culprits.push_back(rank);
      continue;
    }
    if (r.kind == RankReport::Kind::kMalformed) {
      stories[{kOther,
               "sent an unreadable progress report (" + r.problem + ")"}]
          .push_back(rank);
      continue;
    }
    const int64_t age = nowUs - r.wallUs;
    if (rank != self && age > staleUs) {
      // What it said last may be long out of date: say only that.
      std::string last;
      if (r.startedSeq == 0) {
        last = "no collective started";
      } else if (r.completedSeq >= r.startedSeq) {
        last = r.startedDescription + " completed";
      } else {
        last = "in " + r.startedDescription;
      }
      stories[{kSilent, "stopped reporting " + std::to_string(age / 1000) +
                            " ms ago, so it is stopped, hung or dead (last "
                            "report: " +
                            last + ")"}]
          .push_back(rank);
      a.culprits.push_back(rank);
      continue;
    }
    if (r.startedSeq < seq) {
      std::string s = "never entered seq " + std::to_string(seq);
      if (r.startedSeq == 0) {
        s += "; it has started no collective of this group";
      } else {
        s += "; it last started " + r.startedDescription +
             (r.completedSeq >= r.startedSeq ? ", which completed"
                                             : ", still running");
      }
      stories[{kNeverEntered, s}].push_back(rank);
      a.culprits.push_back(rank);
      if (rank != self) {
        a.behindButAlive.push_back(rank);
      }
    } else if (r.startedSeq == seq && r.completedSeq < seq) {
      stories[{kWaiting, "wait in " + description}].push_back(rank);
    } else if (r.completedSeq >= seq) {
      stories[{kDone, "completed seq " + std::to_string(seq) +
                          " (last started: " + r.startedDescription + ")"}]
          .push_back(rank);
    } else {
      stories[{kOther, "is in " + r.startedDescription}].push_back(rank);
    }
  }
  std::sort(a.culprits.begin(), a.culprits.end());
  if (a.culprits.empty()) {
    a.summary = "no rank is missing: every rank entered " + description +
                " or got past it and still reports, so the op itself is "
                "stuck (network or backend)";
  } else {
    a.summary = "likely culprit: " + plural(a.culprits);
  }
  for (const auto& [key, ranks] : stories) {
    std::string text = key.second;
    // "wait" reads as a plural; one rank "waits".
    if (ranks.size() == 1 && text.rfind("wait in ", 0) == 0) {
      text = "waits" + text.substr(4);
    }
    a.summary += "; " + plural(ranks) + " " + text;
  }
  return a;
}

}  // namespace trellis::collectives::detail
