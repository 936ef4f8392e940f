#pragma once
// Reading flight-recorder dumps back (flight_recorder.h writes them) and
// comparing the ranks of a group: the first collective on which they
// disagree, or that some never entered, or that did not complete
// everywhere (docs/collectives.md, "Flight recorder"). The
// trellis-flight-recorder tool is a thin main() around these. Not
// installed; no libtorch.
//
// A dump is a file from disk and so untrusted: parseDump checks every
// field's type and range and returns a clear error (never throws).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <trellis/core/error.h>

namespace trellis::collectives::detail {

// Bounds on what a dump may make the reader hold.
constexpr size_t kMaxDumpEntries = 1'000'000;
constexpr size_t kMaxDumpString = 64 * 1024;
constexpr int kMaxDumpWorldSize = 1 << 24;

struct DumpEntry {
  uint64_t id = 0;
  uint64_t seq = 0;  // 0: point-to-point
  std::string op, dtype, reduceOp, state, description, error;
  uint64_t count = 0;
  int64_t root = -1, peer = -1, tag = 0;
  std::vector<int64_t> shape;
  std::optional<int64_t> enqueuedUs, startedUs, endedUs;
  // What every rank must agree on: op, dtype, count, reduce op, root.
  std::string fingerprint() const;
};

struct Dump {
  std::string source;  // the file it came from, for messages
  std::string group, groupId, backend, host, reason;
  int rank = 0;
  int worldSize = 0;
  int64_t pid = 0;
  std::vector<DumpEntry> entries;
};

Error parseDump(std::string_view json, Dump* out);

struct Report {
  std::string text;
  bool problem = false;  // a disagreement or a stuck collective was found
};

// Groups the dumps by group id and reports on each.
Report compareDumps(const std::vector<Dump>& dumps);

}  // namespace trellis::collectives::detail
