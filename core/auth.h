#pragma once

// Job-token authentication on OpenSSL (docs/wire.md, "Authentication").
//
// Every pipe and store connection proves knowledge of the job token before
// anything else is read. The exchange is mutual and binds both nonces and
// the direction, so a proof can be neither replayed nor reflected:
//   1. acceptor  -> connector: nonceA (32 random bytes)
//   2. connector -> acceptor : nonceC, proof("connector", nonceA, nonceC)
//   3. acceptor verifies, then -> connector: proof("acceptor", nonceC, nonceA)
//   4. connector verifies.
// proof(role, x, y) = HMAC-SHA256(token, "trellis-auth-v1\0" role "\0" x y).
// Comparisons are constant-time. The token is never logged.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include <trellis/core/error.h>

namespace trellis::auth {

constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
constexpr size_t kMinTokenChars = 16;
constexpr size_t kMaxTokenChars = 1024;
constexpr const char* kTokenEnvVar = "TRELLIS_JOB_TOKEN";

using Nonce = std::array<uint8_t, kNonceBytes>;
using Mac = std::array<uint8_t, kMacBytes>;

class JobToken {
 public:
  // 32 bytes from the OS CSPRNG, hex-encoded (64 characters).
  static JobToken generate();
  // Validates length (16..1024) and that every character is printable ASCII;
  // throws InvalidArgumentError saying which rule failed (never the token).
  static JobToken fromString(std::string_view secret);
  // Reads TRELLIS_JOB_TOKEN; nullopt when unset or empty. A malformed value
  // throws InvalidArgumentError naming the variable.
  static std::optional<JobToken> fromEnvironment();

  const std::string& secret() const { return secret_; }

 private:
  explicit JobToken(std::string secret) : secret_(std::move(secret)) {}
  std::string secret_;
};

// Random bytes from the OS CSPRNG; throws InternalError if it fails.
Nonce randomNonce();

Mac hmacSha256(std::span<const uint8_t> key, std::span<const uint8_t> data);

// Constant time in the length of the inputs; false when lengths differ.
[[nodiscard]] bool constantTimeEqual(std::span<const uint8_t> a,
                                     std::span<const uint8_t> b);

// proof(role, first, second) as defined above.
Mac computeProof(const JobToken& token, std::string_view role,
                 const Nonce& first, const Nonce& second);

// OK when `proof` matches; otherwise an UNAUTHENTICATED Error that names
// `peer` (an address or id) but not the token.
Error verifyProof(const JobToken& token, std::string_view role,
                  const Nonce& first, const Nonce& second,
                  std::span<const uint8_t> proof, std::string_view peer);

}  // namespace trellis::auth
