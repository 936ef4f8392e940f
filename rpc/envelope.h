#pragma once

// Parsing and validation of RPC envelopes (internal; docs/rpc_wire.md).
// Kept free of libtorch so that the fuzz target stays small.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "envelope.pb.h"
#include <trellis/core/error.h>

namespace trellis::rpc {

// 2: rref/'s fields became an extension payload; 3: a response may also
// answer another request (also_answers), which a version 2 caller would
// leave pending; 4: small tensors travel inside the argument bytes (a
// tensor's first byte may be 2), which a version 3 peer rejects
// (docs/rpc_wire.md).
constexpr uint32_t kEnvelopeVersion = 4;
constexpr size_t kMaxFunctionNameBytes = 1024;
constexpr size_t kMaxErrorMessageBytes = 64 << 10;
constexpr int kMaxProfileEvents = 1024;
// Bounds of Envelope.extension and extension_payload (the extensions'
// wire ids are in rpc/extension.h; what a payload says is checked by its
// extension).
constexpr uint32_t kMaxExtensionId = 255;
constexpr size_t kMaxExtensionPayloadBytes = 1024;

// Parses `bytes` into `out` and checks every field a peer controls: the
// version, the kind (`expectRequest`), from_worker < worldSize, name and
// message lengths, the profile event count, the extension id and its
// payload's length (a payload only with an extension, only in a request). A
// ProtocolError names the field.
Error parseEnvelope(std::string_view bytes, int32_t worldSize,
                    bool expectRequest, wire::Envelope* out);

// What a sender does to a reply before it goes out, so that parseEnvelope
// on the other side accepts it whatever the user's code put in it: an
// error message or name longer than its bound is cut (the cut says how
// many bytes went), and profile events past kMaxProfileEvents are dropped
// but for one that says how many. A receiver closes the pipe on an
// envelope out of bounds, failing every call on it; a long exception
// message must fail its own call only.
void fitReplyToLimits(wire::Envelope* env);

// A worker's entry in the rendezvous store, which any process holding the
// store (and the job token) could have written:
// "<name>\n<address>\n<maxMessageBytes>" (docs/rpc_wire.md).
struct WorkerEntry {
  std::string name;
  std::string address;
  size_t maxMessageBytes = 0;
};
constexpr size_t kMaxWorkerNameBytes = 128;
constexpr size_t kMaxWorkerAddressBytes = 512;
std::string encodeWorkerEntry(const WorkerEntry& entry);
// A valid name, a uv:// address of at most kMaxWorkerAddressBytes, a limit
// in [1, 2^63) in decimal; else a ProtocolError naming the part.
Error parseWorkerEntry(std::string_view bytes, WorkerEntry* out);
// 1-128 characters of [A-Za-z0-9_.:-].
bool validWorkerName(std::string_view name);

}  // namespace trellis::rpc
