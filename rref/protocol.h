#pragma once

// The RRef protocol's messages as a peer sends them (docs/rref.md), and
// the payload rref/'s agent extension puts on remote() and method calls
// (docs/rpc_wire.md), internal to rref/ and its fuzz target: pure decoding
// and range checks, no agent. Every id a peer names must be within the
// group: an RRef or fork id's worker is a rank of the group, as is an
// owner.

#include <cstdint>
#include <string>
#include <string_view>

#include <trellis/core/error.h>
#include <trellis/rpc/codec.h>
#include <trellis/rref/rref_id.h>

namespace trellis::rpc::detail {

using ProtocolRRefId = RRefId;

// fork (rref, new fork), delete (rref, fork) and accept (child, child):
// two ids. DATA_LOSS naming the field when the bytes are not exactly that
// or an id names a worker outside [0, worldSize).
Error decodeTwoIds(Decoder& d, int32_t worldSize, ProtocolRRefId* a,
                   ProtocolRRefId* b);

// fetch (toHere): the RRef's id and the type name the caller expects.
constexpr size_t kMaxRRefTypeBytes = 4096;
Error decodeFetch(Decoder& d, int32_t worldSize, ProtocolRRefId* id,
                  std::string* type);

// An RRef travelling as an argument or result: its id, its owner, the
// child fork made for the receiver, and its value's type name. On a
// malformed one, or one whose type is not `wantType`, `d` fails (naming
// the field) and false is returned.
struct RRefWire {
  ProtocolRRefId id;
  int32_t owner = -1;
  ProtocolRRefId child;
};
bool decodeRRefWire(Decoder& d, int32_t worldSize, std::string_view wantType,
                    RRefWire* out);
void encodeRRefWire(Encoder& e, const RRefWire& w, std::string_view type);

// What a remote() or a method call on an RRef asks of the callee's RRef
// extension (Envelope.extension_payload): keep the result as the owner
// value of `rref` (with `fork`, the caller's user reference), and/or run
// the method on the owner value of `target`. At least one of the two.
// With storeResult only, `valueInReply`: the creator takes the value in
// the reply when it is a number or bool (docs/rref.md, "Numbers travel
// with the confirmation").
struct RRefCall {
  bool storeResult = false;
  ProtocolRRefId rref;
  ProtocolRRefId fork;
  bool valueInReply = false;
  bool method = false;
  ProtocolRRefId target;
};
std::string encodeRRefCall(const RRefCall& call);
// DATA_LOSS naming the field when `bytes` are not exactly one RRefCall or
// name a worker outside [0, worldSize).
Error decodeRRefCall(std::string_view bytes, int32_t worldSize, RRefCall* out);

}  // namespace trellis::rpc::detail
