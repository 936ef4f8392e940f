#pragma once

// The rendezvous ROUND RECORD and its codec (docs/elastic.md, "The round
// record"): the one value every agent of a c10d or etcd job reads from the
// store and changes with compareSet (rendezvous.h runs the rounds).
//
// The text comes from a store or an etcd server that any holder of the job
// token (c10d) or anyone who can reach etcd can write: it is untrusted.
// decodeRoundRecord checks every line, field and count against the limits
// below before it keeps anything, never throws, and names the store key and
// the line in its error. It is fuzzed (tests/fuzz/elastic_round_record_fuzz.cc,
// built from this file and core alone).
//
// Depends on core only. Thread safety: values and pure functions.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <trellis/core/error.h>

namespace trellis::elastic {

// The store keys, all under kKeyPrefix.
inline constexpr const char* kKeyPrefix = "trellis/rdzv/";
inline constexpr const char* kRoundKey = "trellis/rdzv/round";
// The format's version, on the record's first line. A reader meets another
// version only when agents of different Trellis releases share a job.
inline constexpr int kRoundRecordVersion = 1;
// Limits the decoder enforces (a record is read from the network).
inline constexpr size_t kMaxRecordNodes = 4096;
inline constexpr size_t kMaxRecordField = 512;
// Above the largest record the limits allow (kMaxRecordNodes participants
// and as many waiting nodes, every field at its longest: about 6.3 MiB):
// longer text is refused before a line of it is read.
inline constexpr size_t kMaxRecordBytes = size_t{8} << 20;

enum class RoundPhase : uint8_t {
  kJoining,  // open: nodes join until MAX, or MIN and the last call
  kClosed,   // the group is fixed; latecomers go to the waiting list
  kFailed,   // the restart budget is spent: every node gives up
};
const char* roundPhaseName(RoundPhase phase);

struct RoundNode {
  std::string id;    // unique per agent process (host:pid:random)
  std::string addr;  // where this node's workers can be reached
  friend bool operator==(const RoundNode&, const RoundNode&) = default;
};

struct RoundRecord {
  std::string runId;  // --rdzv-id of the node that created the record
  int32_t nproc = 0;  // --nproc-per-node every node must have
  int64_t round = 0;
  RoundPhase phase = RoundPhase::kJoining;
  // Failure restarts so far: TORCHELASTIC_RESTART_COUNT of this round.
  int32_t restarts = 0;
  std::vector<RoundNode> participants;  // join order = group rank
  std::vector<std::string> waiting;     // node ids that came after close
  std::string note;  // why the round opened or the job failed (one line)
  friend bool operator==(const RoundRecord&, const RoundRecord&) = default;
};

// Text, one field per line, each line ending in '\n':
//   trellis-rdzv-round 1
//   run <id>
//   nproc <n>               (1 .. 2^20)
//   round <n>               (0 .. 2^62)
//   phase joining|closed|failed
//   restarts <n>            (0 .. 2^30)
//   node <id> <addr>        (one per participant, in order; at most
//                            kMaxRecordNodes, no id twice)
//   waiting <id>            (one per waiting node; as many, no id twice,
//                            none a participant)
//   note <text to the end of the line>
// run, nproc, round, phase, restarts and note exactly once, in any order.
// Ids, addresses and the run id are 1..kMaxRecordField printable ASCII
// characters without spaces; encode() throws InvalidArgumentError for one
// that is not (the agent checks its own first); control characters in the
// note become '?' and a longer note is cut to kMaxRecordField.
std::string encodeRoundRecord(const RoundRecord& record);
// A ProtocolError naming kRoundKey and what was wrong (the line, the
// field, the limit; never the untrusted bytes themselves); `out` is
// untouched unless it returns OK. Never throws.
Error decodeRoundRecord(std::string_view text, RoundRecord* out);
// Whether `s` can be an id, an address or a run id in a record.
bool isRecordToken(std::string_view s);

namespace detail {
// A ProtocolError naming the round record and `why`.
Error garbage(const std::string& why);
// Throws InvalidArgumentError naming `what` unless `s` can be a record
// field.
void checkToken(std::string_view what, std::string_view s);
}  // namespace detail

}  // namespace trellis::elastic
