#pragma once

// Parsing and validation of RPC envelopes (internal; docs/rpc_wire.md).
// Kept free of libtorch so that the fuzz target stays small.

#include <cstdint>
#include <string_view>

#include "envelope.pb.h"
#include <trellis/core/error.h>

namespace trellis::rpc {

constexpr uint32_t kEnvelopeVersion = 1;
constexpr size_t kMaxFunctionNameBytes = 1024;
constexpr size_t kMaxErrorMessageBytes = 64 << 10;
constexpr int kMaxProfileEvents = 1024;

// Parses `bytes` into `out` and checks every field a peer controls: the
// version, the kind (`expectRequest`), from_worker < worldSize, name and
// message lengths, the profile event count. A ProtocolError names the field.
Error parseEnvelope(std::string_view bytes, int32_t worldSize,
                    bool expectRequest, wire::Envelope* out);

}  // namespace trellis::rpc
