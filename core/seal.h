#pragma once

// Sealed blobs: a payload behind a header that says what it is and lets a
// reader tell a whole one from a torn or corrupted one before anything
// parses it (docs/wire.md, "Sealed blobs"). Used for what Trellis writes
// to disk or hands to the user to keep: elastic checkpoints
// (elastic/checkpoint.h) and DistributedOptimizer's state
// (dist_autograd/optimizer.h). libtorch's archive reader can crash the
// process on corrupted input, so nothing reaches it unopened.
//
// Layout, integers little-endian:
//   magic (8 bytes, the kind's) | tag (u64, the kind's: a step, or 0) |
//   payload length (u64) | SHA-256 of the payload (32) | payload
//
// A checksum against truncation and corruption, not authentication: a
// writer who can replace the file can reseal it. Thread-safe (no state).

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace trellis::seal {

constexpr size_t kMagicBytes = 8;
constexpr size_t kHeaderBytes = kMagicBytes + 8 + 8 + 32;

// The header of `payload`: write it, then the payload. `magic` must be
// kMagicBytes long (checked).
std::string header(std::string_view magic, uint64_t tag,
                   std::string_view payload);

struct Opened {
  uint64_t tag = 0;
  std::string_view payload;  // points into the sealed bytes
};

// Opens `sealed` (header and payload), which must carry `magic`. Returns
// "" and fills `*out` when it is whole; otherwise says what is wrong, in
// words that follow the blob's name: "is shorter (5 bytes) than its
// header", "has another kind's magic", "is torn: ...", "is corrupted: ...".
// Reads nothing outside `sealed`, whatever it holds.
std::string open(std::string_view magic, std::string_view sealed, Opened* out);

}  // namespace trellis::seal
