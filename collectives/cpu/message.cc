#include <limits>

#include <trellis/collectives/cpu/message.h>
#include <trellis/core/wire.h>

namespace trellis::collectives::detail {

std::string_view toString(OpType op) {
  switch (op) {
    case OpType::kAllreduce:
      return "allreduce";
    case OpType::kBroadcast:
      return "broadcast";
    case OpType::kReduce:
      return "reduce";
    case OpType::kAllgather:
      return "allgather";
    case OpType::kGather:
      return "gather";
    case OpType::kScatter:
      return "scatter";
    case OpType::kReduceScatter:
      return "reduceScatter";
    case OpType::kAlltoall:
      return "alltoall";
    case OpType::kBarrier:
      return "barrier";
    case OpType::kSend:
      return "send";
    case OpType::kRecv:
      return "recv";
    case OpType::kAllreduceCoalesced:
      return "allreduceCoalesced";
  }
  return "unknown";
}

namespace {

bool hasReduceOp(OpType op) {
  return op == OpType::kAllreduce || op == OpType::kReduce ||
         op == OpType::kReduceScatter || op == OpType::kAllreduceCoalesced;
}

}  // namespace

std::string Fingerprint::toString() const {
  std::string s = "seq " + std::to_string(seq) + " ";
  s += detail::toString(op);
  if (op == OpType::kBarrier) {
    return s + "()";
  }
  s += "(";
  s += detail::toString(dtype);
  s += "[" + std::to_string(count) + "]";
  if (hasReduceOp(op)) {
    s += ", ";
    s += collectives::toString(reduceOp);
  }
  if (root >= 0) {
    s += ", root " + std::to_string(root);
  }
  return s + ")";
}

std::string encode(const Header& h) {
  wire::WireWriter w;
  w.reserve(48);
  w.putU8(kWireVersion);
  w.putU8(static_cast<uint8_t>(h.kind));
  switch (h.kind) {
    case Header::Kind::kHello:
      w.putVarint(static_cast<uint32_t>(h.rank));
      w.putVarint(static_cast<uint32_t>(h.worldSize));
      w.putString(h.groupId);
      break;
    case Header::Kind::kCollective:
      w.putVarint(h.fp.seq);
      w.putU8(static_cast<uint8_t>(h.fp.op));
      w.putU8(static_cast<uint8_t>(h.fp.dtype));
      w.putU8(static_cast<uint8_t>(h.fp.reduceOp));
      w.putSignedVarint(h.fp.root);
      w.putVarint(h.fp.count);
      w.putVarint(h.step);
      w.putVarint(h.bytes);
      break;
    case Header::Kind::kP2P:
      w.putSignedVarint(h.tag);
      w.putU8(static_cast<uint8_t>(h.fp.dtype));
      w.putVarint(h.bytes);
      break;
    case Header::Kind::kAbort:
      w.putVarint(static_cast<uint32_t>(h.rank));
      w.putU8(static_cast<uint8_t>(h.code));
      w.putString(h.reason.size() > kMaxReasonBytes
                      ? h.reason.substr(0, kMaxReasonBytes)
                      : h.reason);
      break;
  }
  const auto& b = w.bytes();
  return std::string(b.begin(), b.end());
}

Error decode(std::string_view bytes, Header* out) {
  wire::WireReader r(bytes, "collective message");
  const uint8_t version = r.u8("version");
  const uint8_t kind = r.u8("kind");
  if (!r.ok()) {
    return r.error();
  }
  if (version != kWireVersion) {
    return Error::protocol("collective message: version " +
                           std::to_string(version) + ", this build speaks " +
                           std::to_string(kWireVersion));
  }
  Header h;
  constexpr uint64_t kMaxRank = std::numeric_limits<int32_t>::max();
  switch (kind) {
    case static_cast<uint8_t>(Header::Kind::kHello):
      h.kind = Header::Kind::kHello;
      h.rank = static_cast<int32_t>(r.varint(kMaxRank, "rank"));
      h.worldSize = static_cast<int32_t>(r.varint(kMaxRank, "world size"));
      h.groupId = std::string(r.string(kMaxGroupIdBytes, "group id"));
      break;
    case static_cast<uint8_t>(Header::Kind::kCollective): {
      h.kind = Header::Kind::kCollective;
      h.fp.seq = r.varint("seq");
      const uint8_t op = r.u8("op");
      const uint8_t dtype = r.u8("dtype");
      const uint8_t reduceOp = r.u8("reduce op");
      const int64_t root = r.signedVarint("root");
      h.fp.count = r.varint("count");
      h.step = static_cast<uint32_t>(
          r.varint(std::numeric_limits<uint32_t>::max(), "step"));
      h.bytes = r.varint("bytes");
      if (!r.ok()) {
        break;
      }
      if (op < static_cast<uint8_t>(OpType::kAllreduce) ||
          op > static_cast<uint8_t>(OpType::kAllreduceCoalesced)) {
        r.fail("op", "unknown op " + std::to_string(op));
      }
      const auto dt = dtypeFromWire(dtype);
      if (!dt) {
        r.fail("dtype", "unknown dtype " + std::to_string(dtype));
      }
      if (reduceOp > static_cast<uint8_t>(ReduceOp::kBxor)) {
        r.fail("reduce op", "unknown reduce op " + std::to_string(reduceOp));
      }
      if (root < -1 || root > static_cast<int64_t>(kMaxRank)) {
        r.fail("root", "root " + std::to_string(root) + " out of range");
      }
      if (!r.ok()) {
        break;
      }
      h.fp.op = static_cast<OpType>(op);
      h.fp.dtype = *dt;
      h.fp.reduceOp = static_cast<ReduceOp>(reduceOp);
      h.fp.root = static_cast<int32_t>(root);
      break;
    }
    case static_cast<uint8_t>(Header::Kind::kP2P): {
      h.kind = Header::Kind::kP2P;
      h.tag = r.signedVarint("tag");
      const uint8_t dtype = r.u8("dtype");
      h.bytes = r.varint("bytes");
      if (!r.ok()) {
        break;
      }
      const auto dt = dtypeFromWire(dtype);
      if (!dt) {
        r.fail("dtype", "unknown dtype " + std::to_string(dtype));
        break;
      }
      h.fp.dtype = *dt;
      break;
    }
    case static_cast<uint8_t>(Header::Kind::kAbort):
      h.kind = Header::Kind::kAbort;
      h.rank = static_cast<int32_t>(r.varint(kMaxRank, "rank"));
      {
        const uint8_t code = r.u8("code");
        // OK is not a reason to give up.
        if (r.ok() && (code == 0 ||
                       code > static_cast<uint8_t>(Code::kUnauthenticated))) {
          r.fail("code", "unknown error code " + std::to_string(code));
        }
        h.code = static_cast<Code>(code);
      }
      h.reason = std::string(r.string(kMaxReasonBytes, "reason"));
      break;
    default:
      return Error::protocol("collective message: unknown kind " +
                             std::to_string(kind) + " at offset 1");
  }
  r.expectEnd();
  if (!r.ok()) {
    return r.error();
  }
  *out = std::move(h);
  return Error();
}

}  // namespace trellis::collectives::detail
