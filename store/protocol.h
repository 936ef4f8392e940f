#pragma once

// The TCPStore wire protocol, version 1 (docs/store.md, byte by byte).
// Internal to the store (not installed); the fuzz target and tests use it.
//
// Connection: client hello (9 bytes) -> server hello (10 bytes) -> job-token
// challenge when the server has a token -> request/response frames, one
// request in flight per connection. A frame is a fixed32 little-endian
// payload length followed by the payload. Every length is checked against
// Limits before anything is sized from it.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <trellis/core/auth.h>
#include <trellis/core/error.h>
#include <trellis/store/tcp_store.h>

namespace trellis::store::protocol {

constexpr std::array<uint8_t, 4> kMagic = {'T', 'R', 'S', 'T'};
constexpr uint32_t kVersion = 1;
constexpr size_t kClientHelloBytes = 9;   // magic, fixed32 version, u8 flags
constexpr size_t kServerHelloBytes = 10;  // magic, version, flags, status
constexpr size_t kFrameHeaderBytes = 4;
constexpr size_t kMaxErrorMessageBytes = size_t{64} * 1024;

// Client hello flags.
constexpr uint8_t kClientHasToken = 0x01;
// Server hello flags.
constexpr uint8_t kServerRequiresToken = 0x01;

// Server hello status.
enum class HelloStatus : uint8_t {
  kOk = 0,
  kBadMagic = 1,
  kUnsupportedVersion = 2,
  kAuthMismatch = 3,
};

// The auth verdict byte the server sends after checking the client's proof.
constexpr uint8_t kAuthAccepted = 0;
constexpr uint8_t kAuthRejected = 1;

enum class Op : uint8_t {
  kSet = 1,
  kGet = 2,
  kAdd = 3,
  kCompareSet = 4,
  kWait = 5,
  kCheck = 6,
  kDelete = 7,
  kNumKeys = 8,
  kMultiGet = 9,
  kMultiSet = 10,
  kPing = 11,
};
const char* opName(Op op);

struct Request {
  Op op = Op::kPing;
  std::vector<std::string> keys;
  // kSet: {value}; kCompareSet: {expected, desired}; kMultiSet: one per key.
  std::vector<Bytes> values;
  int64_t delta = 0;       // kAdd
  uint64_t timeoutMs = 0;  // kGet, kWait, kMultiGet; 0 = none
};

struct Response {
  Error error;                // non-ok: status byte = its code
  std::vector<Bytes> values;  // kGet, kCompareSet: one; kMultiGet: n
  int64_t integer = 0;        // kAdd, kNumKeys
  bool flag = false;          // kCheck, kDelete
};

std::array<uint8_t, kClientHelloBytes> encodeClientHello(uint32_t version,
                                                         uint8_t flags);
std::array<uint8_t, kServerHelloBytes> encodeServerHello(uint8_t flags,
                                                         HelloStatus status);

// The server's view of a client hello (exactly kClientHelloBytes).
struct ClientHello {
  bool magicOk = false;
  uint32_t version = 0;
  bool hasToken = false;
};
ClientHello decodeClientHello(std::span<const uint8_t, kClientHelloBytes> b);
// The status the server answers a hello with.
HelloStatus judgeClientHello(const ClientHello& hello, bool serverHasToken);
// Why a hello was refused, for the server's log ("" for kOk).
std::string describeRefusal(const ClientHello& hello, HelloStatus status);

// The client's check of the server's hello: ProtocolError for a peer that is
// no Trellis store or speaks another version, AuthError when one side has a
// job token and the other none (the message says what to do), naming
// `peer`.
Error checkServerHello(std::span<const uint8_t, kServerHelloBytes> b,
                       bool clientHasToken, const std::string& peer);

// The client's answer to the server's challenge `challenge`: its own nonce,
// then its proof (auth::computeProof, role "connector"). On success the
// client's nonce is stored in `clientNonce`; AuthError otherwise.
constexpr size_t kClientAnswerBytes = auth::kNonceBytes + auth::kMacBytes;
Error checkClientAnswer(const auth::JobToken& token,
                        const auth::Nonce& challenge,
                        std::span<const uint8_t, kClientAnswerBytes> answer,
                        const std::string& peer, auth::Nonce* clientNonce);

// Request payloads (without the frame header). decodeRequest never reads
// outside `payload` and never allocates more than the payload's own size.
// A malformed payload is a DATA_LOSS Error naming the field and offset; a
// well-formed one with a key, value or key count over `limits` is
// RESOURCE_EXHAUSTED naming the first of them (the server answers that one
// request with it and keeps the connection).
Bytes encodeRequest(const Request& req);
Error decodeRequest(std::span<const uint8_t> payload, const Limits& limits,
                    Request* out);

Bytes encodeResponse(Op op, const Response& resp);
Error decodeResponse(Op op, std::span<const uint8_t> payload,
                     const Limits& limits, Response* out);

// Throws InvalidArgumentError when a request breaks `limits` (client side,
// before anything is sent).
void checkRequest(const Request& req, const Limits& limits);

// Prepends the fixed32 length.
Bytes frame(const Bytes& payload);

}  // namespace trellis::store::protocol
