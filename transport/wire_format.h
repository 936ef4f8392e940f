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
// 1: the first release. 2: per-device-type channels in the accept message
// and opaque out-of-band records in the frame layout (docs/transport.md).
constexpr uint32_t kProtocolVersion = 2;
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
  // The same-host upgrade (docs/transport.md, "Same-host upgrade").
  kBind = 5,             // connector -> acceptor, on the new shm connection
  kUpgradeFailed = 6,    // connector -> acceptor, on the first connection
  kUpgradeDecision = 7,  // acceptor -> connector, on the first connection
};
constexpr size_t kMaxUpgradeAddressBytes = 128;

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
  std::string channel;      // for CPU tensors; never empty when kOk
  std::string cudaChannel;  // for CUDA tensors; empty: none negotiated
  // Same-host upgrade offer: where to connect (shm://NAME) and the secret
  // binding that connection to this pipe; both empty when none.
  std::string upgradeAddress;
  std::optional<auth::Nonce> upgradeToken;
};

struct BindMessage {
  auth::Nonce token{};
  // With a job token: proof("upgrade", acceptor's nonceA, token).
  std::optional<auth::Mac> proof;
};

enum class UpgradeDecision : uint8_t { kSwitch = 0, kStay = 1 };

std::vector<uint8_t> encodeHello(HandshakeType type, const Hello& hello);
std::vector<uint8_t> encodeAuth(const AuthMessage& m);
std::vector<uint8_t> encodeAccept(const AcceptMessage& m);
std::vector<uint8_t> encodeBind(const BindMessage& m);
std::vector<uint8_t> encodeUpgradeFailed(const std::string& reason);
std::vector<uint8_t> encodeUpgradeDecision(UpgradeDecision d);

// The version is read first: a different one is a ProtocolError naming both
// versions and nothing else is parsed.
Error decodeHello(std::span<const uint8_t> body, HandshakeType type,
                  Hello* out);
Error decodeAuth(std::span<const uint8_t> body, AuthMessage* out);
Error decodeAccept(std::span<const uint8_t> body, AcceptMessage* out);
Error decodeBind(std::span<const uint8_t> body, BindMessage* out);
Error decodeUpgradeFailed(std::span<const uint8_t> body, std::string* reason);
Error decodeUpgradeDecision(std::span<const uint8_t> body,
                            UpgradeDecision* out);
// "shm://NAME", NAME 1-100 of [A-Za-z0-9._-]; else a ProtocolError.
Error checkUpgradeAddress(const std::string& address);

// ---- Message frames --------------------------------------------------------
// fixed32 layout length | layout | descriptor | payloads | inline tensors.
// layout = u8 frame type | varint descriptor length | varint #payloads |
//          varint length... | varint #tensors | (varint length, u8 device
//          type, varint device index [, type 2 only: u8 placement (0 inline,
//          1 out-of-band) [, 1 only: varint record length, record]])...
// A record is opaque here: the channel negotiated for the tensor's device
// type wrote it and reads it. A non-empty CUDA tensor is always out of band.
// A completion frame (type 3) is u8 type | u8 status (the reader's error
// code, core's Code: 0 ok, <= 16) | string reason, and carries nothing after
// its layout.
constexpr size_t kFrameHeaderBytes = 4;
constexpr uint8_t kFrameMessage = 1;
constexpr uint8_t kFrameMessageOutOfBand = 2;
constexpr uint8_t kFrameCompletion = 3;
constexpr uint8_t kPlacementInline = 0;
constexpr uint8_t kPlacementOutOfBand = 1;
constexpr uint32_t kMaxDeviceIndex = 1024;
// All records of one frame together; each is also at most
// Channel::kMaxOutOfBandRecordBytes.
constexpr size_t kMaxOutOfBandRecordBytes = 1024;
constexpr size_t kMaxOutOfBandBytesPerFrame = size_t{1} << 20;

// One tensor's out-of-band record (type 2 frames).
struct OutOfBand {
  bool present = false;
  std::string record;
};

struct FrameLayout {
  uint8_t type = kFrameMessage;
  size_t descriptorLength = 0;
  std::vector<size_t> payloadLengths;
  std::vector<Descriptor::TensorInfo> tensors;
  std::vector<OutOfBand> outOfBand;  // type 2: one per tensor; else empty
  // Type 3 only.
  Code completionCode = Code::kOk;
  std::string completionReason;
};

// The largest layout the limits allow.
size_t maxLayoutBytes(const Limits& limits);

// Checks a message against the limits before it is sent (InvalidArgument).
Error checkOutgoing(const Message& m, const Limits& limits);

// Appends the frame header and layout of `m` to `out`. With `outOfBand`
// (one entry per tensor, some present), a type-2 layout carrying each
// present entry's record in place of the tensor's bytes.
void encodeFrameHead(const Message& m, std::vector<uint8_t>* out,
                     const std::vector<OutOfBand>* outOfBand = nullptr);
// A completion frame (header + layout); `reason` is cut to kMaxReasonBytes.
std::vector<uint8_t> encodeCompletion(Code code, const std::string& reason);

Error decodeFrameHeader(std::span<const uint8_t> header, const Limits& limits,
                        size_t* layoutLength);
Error decodeLayout(std::span<const uint8_t> layout, const Limits& limits,
                   FrameLayout* out);

}  // namespace trellis::transport::wire_format
