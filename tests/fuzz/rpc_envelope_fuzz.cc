// Fuzzes the RPC envelope parser and validator (rpc/envelope.cc): any bytes
// must give either a valid envelope or a ProtocolError, never a crash or an
// unbounded allocation. A valid one keeps the bounds the agent relies on,
// the extension fields' among them (an extension payload only in a
// request, only with an extension id, at most kMaxExtensionPayloadBytes)
// and one_way's (only in a request, never with an autograd context). A
// valid reply stays valid through fitReplyToLimits.
//
// Input: byte 0's bit 7 set: the rest is a worker's rendezvous entry
// (parseWorkerEntry), which must be refused with a ProtocolError or keep
// its bounds and its values through encodeWorkerEntry. Else bit 0 says
// request, bits 1-6 a world size of 1-64, and the rest is an envelope.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "envelope.h"

namespace {

void workerEntry(std::string_view bytes) {
  trellis::rpc::WorkerEntry entry;
  const trellis::Error e = trellis::rpc::parseWorkerEntry(bytes, &entry);
  if (!e.ok()) {
    if (e.code() != trellis::Code::kDataLoss) {
      __builtin_trap();
    }
    return;
  }
  if (!trellis::rpc::validWorkerName(entry.name) ||
      entry.address.size() > trellis::rpc::kMaxWorkerAddressBytes ||
      entry.address.rfind("uv://", 0) != 0 || entry.maxMessageBytes == 0) {
    __builtin_trap();
  }
  // "007" parses as 7: the values, not the bytes, must round-trip.
  trellis::rpc::WorkerEntry again;
  if (!trellis::rpc::parseWorkerEntry(trellis::rpc::encodeWorkerEntry(entry),
                                      &again)
           .ok() ||
      again.name != entry.name || again.address != entry.address ||
      again.maxMessageBytes != entry.maxMessageBytes) {
    __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) {
    return 0;
  }
  std::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((data[0] & 0x80) != 0) {
    workerEntry(bytes);
    return 0;
  }
  const bool request = (data[0] & 1) != 0;
  const int32_t world = 1 + ((data[0] >> 1) & 0x3f);
  trellis::rpc::wire::Envelope env;
  trellis::Error e = trellis::rpc::parseEnvelope(bytes, world, request, &env);
  if (e.ok()) {
    if (env.extension() > trellis::rpc::kMaxExtensionId ||
        env.extension_payload().size() >
            trellis::rpc::kMaxExtensionPayloadBytes ||
        (!env.extension_payload().empty() && env.extension() == 0) ||
        (!request && env.extension() != 0) ||
        (env.one_way() && (!request || env.autograd_context_id() != 0))) {
      __builtin_trap();
    }
    // A valid envelope re-serialises and parses back to the same checks.
    trellis::rpc::wire::Envelope again;
    e = trellis::rpc::parseEnvelope(env.SerializeAsString(), world, request,
                                    &again);
    if (!e.ok()) {
      __builtin_trap();
    }
    // Fitting a valid reply to the limits (what a callee does before it
    // sends) changes nothing the receiver checks.
    if (!request) {
      trellis::rpc::fitReplyToLimits(&again);
      if (!trellis::rpc::parseEnvelope(again.SerializeAsString(), world, false,
                                       &again)
               .ok()) {
        __builtin_trap();
      }
    }
  } else if (e.code() != trellis::Code::kDataLoss) {
    __builtin_trap();
  }
  return 0;
}
