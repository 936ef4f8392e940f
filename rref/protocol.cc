#include <trellis/core/wire.h>
#include <trellis/rref/protocol.h>

namespace trellis::rpc::detail {

namespace {

// A worker id as the varint the codec wrote for a uint32, within the group.
uint32_t workerId(Decoder& d, int32_t worldSize, const char* field) {
  return static_cast<uint32_t>(
      d.wire().varint(static_cast<uint64_t>(worldSize) - 1, field));
}

}  // namespace

Error decodeTwoIds(Decoder& d, int32_t worldSize, ProtocolRRefId* a,
                   ProtocolRRefId* b) {
  auto& r = d.wire();
  a->worker = workerId(d, worldSize, "rref.worker");
  a->local = r.varint("rref.local");
  b->worker = workerId(d, worldSize, "fork.worker");
  b->local = r.varint("fork.local");
  return d.finish();
}

Error decodeFetch(Decoder& d, int32_t worldSize, ProtocolRRefId* id,
                  std::string* type) {
  auto& r = d.wire();
  id->worker = workerId(d, worldSize, "rref.worker");
  id->local = r.varint("rref.local");
  *type = std::string(r.string(kMaxRRefTypeBytes, "rref.type"));
  return d.finish();
}

bool decodeRRefWire(Decoder& d, int32_t worldSize, std::string_view wantType,
                    RRefWire* out) {
  auto& r = d.wire();
  out->id.worker = workerId(d, worldSize, "rref.worker");
  out->id.local = r.varint("rref.local");
  out->owner = static_cast<int32_t>(workerId(d, worldSize, "rref.owner"));
  out->child.worker = workerId(d, worldSize, "rref.fork.worker");
  out->child.local = r.varint("rref.fork.local");
  const std::string_view type = r.string(kMaxRRefTypeBytes, "rref.type");
  if (!d.ok()) {
    return false;
  }
  if (type != wantType) {
    d.fail("rref.type",
           "the RRef holds another type than the receiver's RRef<T>");
    return false;
  }
  return true;
}

void encodeRRefWire(Encoder& e, const RRefWire& w, std::string_view type) {
  auto& out = e.wire();
  out.putVarint(w.id.worker);
  out.putVarint(w.id.local);
  out.putVarint(static_cast<uint64_t>(w.owner));
  out.putVarint(w.child.worker);
  out.putVarint(w.child.local);
  out.putString(type);
}

namespace {

constexpr uint8_t kStoreResult = 1;
constexpr uint8_t kMethod = 2;
constexpr uint8_t kValueInReply = 4;

void putId(::trellis::wire::WireWriter& w, const ProtocolRRefId& id) {
  w.putVarint(id.worker);
  w.putVarint(id.local);
}

ProtocolRRefId readId(::trellis::wire::WireReader& r, int32_t worldSize,
                      const char* worker, const char* local) {
  ProtocolRRefId id;
  id.worker = static_cast<uint32_t>(
      r.varint(static_cast<uint64_t>(worldSize) - 1, worker));
  id.local = r.varint(local);
  return id;
}

}  // namespace

std::string encodeRRefCall(const RRefCall& call) {
  ::trellis::wire::WireWriter w;
  w.putU8(static_cast<uint8_t>(
      (call.storeResult ? kStoreResult : 0) | (call.method ? kMethod : 0) |
      (call.storeResult && call.valueInReply ? kValueInReply : 0)));
  if (call.storeResult) {
    putId(w, call.rref);
    putId(w, call.fork);
  }
  if (call.method) {
    putId(w, call.target);
  }
  const auto& bytes = w.bytes();
  return std::string(bytes.begin(), bytes.end());
}

Error decodeRRefCall(std::string_view bytes, int32_t worldSize, RRefCall* out) {
  ::trellis::wire::WireReader r(bytes, "RRef call payload");
  const uint8_t flags = r.u8("flags");
  if (r.ok() && ((flags & (kStoreResult | kMethod)) == 0 ||
                 (flags & ~(kStoreResult | kMethod | kValueInReply)) != 0)) {
    r.fail("flags", "must ask to keep the result, call a method, or both");
  }
  if (r.ok() && (flags & kValueInReply) != 0 && (flags & kStoreResult) == 0) {
    r.fail("flags", "asks for the value in the reply without keeping it");
  }
  out->storeResult = (flags & kStoreResult) != 0;
  out->method = (flags & kMethod) != 0;
  out->valueInReply = (flags & kValueInReply) != 0;
  if (out->storeResult) {
    out->rref = readId(r, worldSize, "rref.worker", "rref.local");
    out->fork = readId(r, worldSize, "fork.worker", "fork.local");
  }
  if (out->method) {
    out->target = readId(r, worldSize, "target.worker", "target.local");
  }
  r.expectEnd();
  return r.error();
}

}  // namespace trellis::rpc::detail
