#pragma once
// The cpu backend's wire format (docs/collectives.md, "Wire format"): the
// descriptor of every transport message between two ranks of a group. Pure
// encode/decode, no I/O, so it is unit-tested and fuzzed on its own.
//
// Every data message carries the whole fingerprint of the collective it
// belongs to (sequence number, op, dtype, reduce op, root, element count)
// and the algorithm step. A receiver compares it with its own before it
// reads a byte of data: ranks that call different collectives, or the same
// one with different sizes, fail on the first message, with both sides in
// the error, at no extra round trip.
#include <cstdint>
#include <string>
#include <string_view>

#include <trellis/collectives/dtype.h>
#include <trellis/collectives/types.h>
#include <trellis/core/error.h>

namespace trellis::collectives::detail {

enum class OpType : uint8_t {
  kAllreduce = 1,
  kBroadcast = 2,
  kReduce = 3,
  kAllgather = 4,
  kGather = 5,
  kScatter = 6,
  kReduceScatter = 7,
  kAlltoall = 8,
  kBarrier = 9,
  kSend = 10,
  kRecv = 11,
  kAllreduceCoalesced = 12,
};
std::string_view toString(OpType op);

// What every rank of a group must agree on for one collective.
struct Fingerprint {
  uint64_t seq = 0;  // per group, from 1, in issue order
  OpType op = OpType::kAllreduce;
  DType dtype = DType::kFloat32;
  ReduceOp reduceOp = ReduceOp::kSum;
  int32_t root = -1;   // -1: the op has no root
  uint64_t count = 0;  // elements per rank (op-specific, docs)
  // "seq 42 allreduce(float32[1048576], sum)"
  std::string toString() const;
  friend bool operator==(const Fingerprint&, const Fingerprint&) = default;
};

constexpr uint8_t kWireVersion = 1;
// Bounds on what a peer's descriptor may make this process hold.
constexpr size_t kMaxGroupIdBytes = 512;
constexpr size_t kMaxReasonBytes = 16 * 1024;

struct Header {
  enum class Kind : uint8_t {
    kHello = 1,       // first message on every pipe, both directions
    kCollective = 2,  // one step of a collective's data
    kP2P = 3,         // a tagged send
    kAbort = 4,       // the sender gave up on the group; reason follows
  };
  Kind kind = Kind::kCollective;
  // kHello
  int32_t rank = 0;
  int32_t worldSize = 0;
  std::string groupId;
  // kCollective
  Fingerprint fp;
  uint32_t step = 0;
  // kP2P
  int64_t tag = 0;
  // kCollective, kP2P: bytes of data in the message's one tensor
  uint64_t bytes = 0;
  // kAbort (and `rank`: who gave up)
  Code code = Code::kAborted;
  std::string reason;
};

std::string encode(const Header& header);
// A ProtocolError (naming the field and offset) for anything malformed:
// unknown version, kind, op, dtype or reduce op, out-of-range numbers,
// over-long strings, trailing bytes.
Error decode(std::string_view bytes, Header* out);

}  // namespace trellis::collectives::detail
