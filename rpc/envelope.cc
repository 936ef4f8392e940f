#include "envelope.h"

#include <algorithm>
#include <cctype>
#include <optional>
#include <string>

#include <trellis/core/text.h>

namespace trellis::rpc {

Error parseEnvelope(std::string_view bytes, int32_t worldSize,
                    bool expectRequest, wire::Envelope* out) {
  if (!out->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return Error::protocol("envelope: not a valid protobuf message");
  }
  if (out->version() != kEnvelopeVersion) {
    return Error::protocol(
        "envelope: version " + std::to_string(out->version()) +
        ", this worker speaks " + std::to_string(kEnvelopeVersion));
  }
  const auto want =
      expectRequest ? wire::Envelope::REQUEST : wire::Envelope::RESPONSE;
  if (out->kind() != want) {
    return Error::protocol(std::string("envelope: kind ") +
                           std::to_string(out->kind()) +
                           (expectRequest ? " on a pipe that carries requests"
                                          : " on a pipe that carries replies"));
  }
  if (worldSize <= 0 ||
      out->from_worker() >= static_cast<uint32_t>(worldSize)) {
    return Error::protocol("envelope: from_worker " +
                           std::to_string(out->from_worker()) +
                           " is not a rank of this group");
  }
  if (out->function().size() > kMaxFunctionNameBytes) {
    return Error::protocol("envelope: function name longer than " +
                           std::to_string(kMaxFunctionNameBytes) + " bytes");
  }
  if (expectRequest && out->function().empty()) {
    return Error::protocol("envelope: request without a function name");
  }
  if (out->has_error()) {
    const auto& e = out->error();
    if (e.code() == 0 || e.code() > 16) {
      return Error::protocol("envelope: error code " +
                             std::to_string(e.code()) + " out of range");
    }
    if (e.message().size() > kMaxErrorMessageBytes ||
        e.worker().size() > kMaxFunctionNameBytes ||
        e.function().size() > kMaxFunctionNameBytes ||
        e.exception_type().size() > kMaxFunctionNameBytes) {
      return Error::protocol("envelope: error fields too long");
    }
  }
  // Distributed autograd: a context id names its creator's rank in its top
  // 16 bits; a message id only exists inside a context.
  if (out->autograd_context_id() != 0 &&
      (out->autograd_context_id() >> 48) >= static_cast<uint64_t>(worldSize)) {
    return Error::protocol("envelope: autograd_context_id " +
                           std::to_string(out->autograd_context_id()) +
                           " was not created by a rank of this group");
  }
  if (out->autograd_message_id() != 0 && out->autograd_context_id() == 0) {
    return Error::protocol(
        "envelope: autograd_message_id without autograd_context_id");
  }
  if (out->extension() > kMaxExtensionId) {
    return Error::protocol("envelope: extension " +
                           std::to_string(out->extension()) + " out of range");
  }
  if (out->extension_payload().size() > kMaxExtensionPayloadBytes) {
    return Error::protocol("envelope: extension payload longer than " +
                           std::to_string(kMaxExtensionPayloadBytes) +
                           " bytes");
  }
  if ((out->extension() != 0 || !out->extension_payload().empty()) &&
      !expectRequest) {
    return Error::protocol("envelope: extension fields in a response");
  }
  if (out->also_answers() != 0 &&
      (expectRequest || out->also_answers() == out->request_id())) {
    return Error::protocol(
        expectRequest ? "envelope: also_answers set in a request"
                      : "envelope: also_answers names the response's own "
                        "request");
  }
  if (out->one_way() && !expectRequest) {
    return Error::protocol("envelope: one_way set in a response");
  }
  if (out->one_way() && out->autograd_context_id() != 0) {
    return Error::protocol(
        "envelope: a one-way request inside a distributed-autograd context");
  }
  if (!out->extension_payload().empty() && out->extension() == 0) {
    return Error::protocol("envelope: extension payload without extension");
  }
  if (out->events_size() > kMaxProfileEvents) {
    return Error::protocol("envelope: more than " +
                           std::to_string(kMaxProfileEvents) +
                           " profile events");
  }
  for (const auto& ev : out->events()) {
    if (ev.name().size() > kMaxFunctionNameBytes ||
        ev.worker().size() > kMaxFunctionNameBytes || ev.duration_us() < 0) {
      return Error::protocol("envelope: malformed profile event");
    }
  }
  return Error();
}

void fitReplyToLimits(wire::Envelope* env) {
  if (env->has_error()) {
    auto* e = env->mutable_error();
    cutWithNote(*e->mutable_message(), kMaxErrorMessageBytes);
    cutWithNote(*e->mutable_worker(), kMaxFunctionNameBytes);
    cutWithNote(*e->mutable_function(), kMaxFunctionNameBytes);
    cutWithNote(*e->mutable_exception_type(), kMaxFunctionNameBytes);
  }
  auto* events = env->mutable_events();
  if (events->size() > kMaxProfileEvents) {
    const int dropped = events->size() - (kMaxProfileEvents - 1);
    const wire::ProfileEvent last = events->Get(kMaxProfileEvents - 2);
    events->DeleteSubrange(kMaxProfileEvents - 1, dropped);
    auto* note = events->Add();
    note->set_name("rpc profiler: " + std::to_string(dropped) +
                   " more nested events dropped (at most " +
                   std::to_string(kMaxProfileEvents) + " per reply)");
    note->set_worker(last.worker());
    note->set_start_us(last.start_us() + last.duration_us());
    note->set_thread(last.thread());
  }
  for (auto& ev : *events) {
    cutWithNote(*ev.mutable_name(), kMaxFunctionNameBytes);
    cutWithNote(*ev.mutable_worker(), kMaxFunctionNameBytes);
    if (ev.duration_us() < 0) {
      ev.set_duration_us(0);
    }
  }
}

bool validWorkerName(std::string_view name) {
  if (name.empty() || name.size() > kMaxWorkerNameBytes) {
    return false;
  }
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' ||
           c == '-' || c == '.' || c == ':';
  });
}

std::string encodeWorkerEntry(const WorkerEntry& entry) {
  return entry.name + "\n" + entry.address + "\n" +
         std::to_string(entry.maxMessageBytes);
}

Error parseWorkerEntry(std::string_view bytes, WorkerEntry* out) {
  const size_t nl = bytes.find('\n');
  const size_t nl2 =
      nl == std::string_view::npos ? nl : bytes.find('\n', nl + 1);
  if (nl2 == std::string_view::npos) {
    return Error::protocol("not three lines (name, address, maxMessageBytes)");
  }
  const std::string_view name = bytes.substr(0, nl);
  const std::string_view address = bytes.substr(nl + 1, nl2 - nl - 1);
  const std::optional<int64_t> limit = parseDecimal(bytes.substr(nl2 + 1));
  if (!validWorkerName(name)) {
    return Error::protocol(
        "the worker name is not 1-128 characters of "
        "[A-Za-z0-9_.:-]");
  }
  if (address.rfind("uv://", 0) != 0 ||
      address.size() > kMaxWorkerAddressBytes) {
    return Error::protocol("the address is not a uv:// address of at most " +
                           std::to_string(kMaxWorkerAddressBytes) + " bytes");
  }
  if (!limit || *limit <= 0) {
    return Error::protocol("maxMessageBytes is not a positive decimal number");
  }
  out->name = std::string(name);
  out->address = std::string(address);
  out->maxMessageBytes = static_cast<size_t>(*limit);
  return Error();
}

}  // namespace trellis::rpc
