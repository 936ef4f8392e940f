// Fuzz target for what the collectives watchdog reads from outside the
// process: another rank's progress report (from the store; progress.h) and
// a flight-recorder dump (from a file; flight_report.h). The first byte
// picks the decoder.
//
// Checked: neither decoder crashes, throws or reads out of bounds; a
// report it accepts re-encodes to one that decodes the same; the analysis
// and the dump comparison run on whatever was accepted.
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <trellis/collectives/flight_report.h>
#include <trellis/collectives/progress.h>

namespace {

namespace c = trellis::collectives::detail;

[[noreturn]] void fatal() { std::abort(); }

void progress(std::string_view text) {
  const c::RankReport r = c::decodeProgress(text);
  if (r.kind != c::RankReport::Kind::kValid) {
    if (r.problem.empty()) {
      fatal();
    }
    return;
  }
  c::Progress p;
  p.startedSeq = r.startedSeq;
  p.completedSeq = r.completedSeq;
  p.failed = r.failed;
  const c::RankReport again =
      c::decodeProgress(c::encodeProgress(p, r.beat, r.wallUs));
  if (again.kind != c::RankReport::Kind::kValid ||
      again.startedSeq != r.startedSeq ||
      again.completedSeq != r.completedSeq || again.beat != r.beat ||
      again.wallUs != r.wallUs || again.failed != r.failed) {
    fatal();
  }
  std::vector<c::RankReport> all = {r, c::RankReport{}, again};
  (void)c::analyse(r.startedSeq, r.startedDescription, 0, all, r.wallUs,
                   std::chrono::milliseconds(1000));
}

void dump(std::string_view text) {
  c::Dump d;
  trellis::Error e = c::parseDump(text, &d);
  if (!e.ok()) {
    if (e.message().empty()) {
      fatal();
    }
    return;
  }
  c::Dump other = d;
  other.rank = d.worldSize > 1 ? (d.rank + 1) % d.worldSize : d.rank;
  (void)c::compareDumps({d, other});
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) {
    return 0;
  }
  const std::string_view text(reinterpret_cast<const char*>(data) + 1,
                              size - 1);
  if (data[0] & 1) {
    dump(text);
  } else {
    progress(text);
  }
  return 0;
}
