#pragma once
// What each rank tells the others about how far it got, and the culprit
// analysis the watchdog runs on those reports when an op times out
// (docs/collectives.md, "Watchdog"). Pure functions, no I/O: unit-tested
// and fuzzed on their own. Not installed; no libtorch.
//
// A report is one short text value in the group's store under
// "progress/<rank>", rewritten by the rank's watchdog every tick:
//   "trellis-progress 1 <beat> <wall µs> <started seq> <completed seq>
//    <failed 0|1>\n<description of the started op>"
// The store is shared by every rank and so untrusted: decodeProgress
// bounds every field and never throws.
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <trellis/collectives/flight_recorder.h>

namespace trellis::collectives::detail {

constexpr size_t kMaxProgressBytes = 1024;

struct RankReport {
  enum class Kind : uint8_t { kMissing, kMalformed, kValid };
  Kind kind = Kind::kMissing;
  std::string problem;  // kMalformed: what was wrong
  uint64_t beat = 0;
  int64_t wallUs = 0;  // when it was published (the rank's clock)
  uint64_t startedSeq = 0;
  uint64_t completedSeq = 0;
  bool failed = false;
  std::string startedDescription;
};

std::string encodeProgress(const Progress& p, uint64_t beat, int64_t wallUs);
RankReport decodeProgress(std::string_view text);

struct Analysis {
  // One sentence per kind of rank, culprits first: "rank 2 never entered
  // seq 5; it last started seq 4 barrier(), which completed".
  std::string summary;
  // Ranks that did not enter the op, or are in it but no longer report.
  std::vector<int> culprits;
  // Ranks that look behind but still report: worth a second look a moment
  // later, since their report may predate their entering the op.
  std::vector<int> behindButAlive;
};

// `seq`/`description`: the op that timed out on rank `self`; `reports`
// indexed by rank (self's included); a report older than `staleAfter` at
// `nowUs` means the rank's watchdog stopped reporting (the process is
// stopped, hung or dead).
Analysis analyse(uint64_t seq, const std::string& description, int self,
                 const std::vector<RankReport>& reports, int64_t nowUs,
                 std::chrono::milliseconds staleAfter);

// "0-2, 5, 7-8".
std::string rankList(const std::vector<int>& ranks);

}  // namespace trellis::collectives::detail
