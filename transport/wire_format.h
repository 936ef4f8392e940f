#pragma once

// Internal: encoders and decoders of the transport's wire format
// (docs/transport.md, "Wire format"). Decoders take untrusted bytes: they
// never read out of bounds and check every length against the limits before
// anything is sized from it; failures are ProtocolErrors (DATA_LOSS) naming
// the field.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <trellis/core/auth.h>
#include <trellis/core/error.h>
#include <trellis/core/wire.h>
#include <trellis/transport/context.h>
#include <trellis/transport/message.h>

namespace trellis::transport::wire_format {

// ---- Handshake -------------------------------------------------------------
// Every handshake message: "TRLS" | u8 type | fixed32 body length | body.
constexpr std::array<uint8_t, 4> kMagic = {'T', 'R', 'L', 'S'};
constexpr uint32_t kProtocolVersion = 1;
constexpr size_t kHandshakeHeaderBytes = 9;
constexpr size_t kMaxHandshakeBodyBytes = 4096;
constexpr size_t kMaxNameBytes = 64;
constexpr size_t kMaxNames = 32;
constexpr size_t kMaxHostIdBytes = 256;
constexpr size_t kMaxReasonBytes = 512;

enum class HandshakeType : uint8_t {
  kHello = 1,       // connector -> acceptor
  kHelloReply = 2,  // acceptor -> connector
  kAuth = 3,        // connector -> acceptor
  kAccept = 4,      // acceptor -> connector
};

// Validates magic, type and length; returns the body length.
Error decodeHandshakeHeader(std::span<const uint8_t> header,
                            HandshakeType expected, size_t* bodyLength);

struct Hello {
  uint32_t version = kProtocolVersion;
  std::vector<std::string> transports;  // in priority order
  std::vector<std::string> channels;
  std::string hostId;
  uint64_t pid = 0;
  bool tokenConfigured = false;
  auth::Nonce nonce{};  // kHelloReply only: the acceptor's challenge
};

struct AuthMessage {
  auth::Nonce nonce{};             // the connector's challenge
  std::optional<auth::Mac> proof;  // present iff a token is configured
};

enum class AcceptStatus : uint8_t {
  kOk = 0,
  kAuthFailed = 1,
  kNoCommonTransport = 2,
};

struct AcceptMessage {
  AcceptStatus status = AcceptStatus::kOk;
  std::string reason;
  std::optional<auth::Mac> proof;
  std::string transport;
  std::string channel;
};

std::vector<uint8_t> encodeHello(HandshakeType type, const Hello& hello);
std::vector<uint8_t> encodeAuth(const AuthMessage& m);
std::vector<uint8_t> encodeAccept(const AcceptMessage& m);

// The version is read first: a different one is a ProtocolError naming both
// versions and nothing else is parsed.
Error decodeHello(std::span<const uint8_t> body, HandshakeType type,
                  Hello* out);
Error decodeAuth(std::span<const uint8_t> body, AuthMessage* out);
Error decodeAccept(std::span<const uint8_t> body, AcceptMessage* out);

// ---- Message frames --------------------------------------------------------
// fixed32 layout length | layout | descriptor | payloads | inline tensors.
// layout = u8 frame type (1) | varint descriptor length | varint #payloads |
//          varint length... | varint #tensors | (varint length, u8 device
//          type, varint device index)...
constexpr size_t kFrameHeaderBytes = 4;
constexpr uint8_t kFrameMessage = 1;
constexpr uint32_t kMaxDeviceIndex = 1024;

struct FrameLayout {
  size_t descriptorLength = 0;
  std::vector<size_t> payloadLengths;
  std::vector<Descriptor::TensorInfo> tensors;
};

// The largest layout the limits allow.
size_t maxLayoutBytes(const Limits& limits);

// Checks a message against the limits before it is sent (InvalidArgument).
Error checkOutgoing(const Message& m, const Limits& limits);

// Appends the frame header and layout of `m` to `out`.
void encodeFrameHead(const Message& m, std::vector<uint8_t>* out);

Error decodeFrameHeader(std::span<const uint8_t> header, const Limits& limits,
                        size_t* layoutLength);
Error decodeLayout(std::span<const uint8_t> layout, const Limits& limits,
                   FrameLayout* out);

}  // namespace trellis::transport::wire_format
