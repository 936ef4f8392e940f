#include <cstdlib>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <trellis/core/auth.h>
#include <trellis/core/text.h>

namespace trellis::auth {

namespace {
constexpr std::string_view kProofLabel{"trellis-auth-v1\0", 16};
}  // namespace

JobToken JobToken::generate() {
  std::array<uint8_t, 32> raw{};
  if (RAND_bytes(raw.data(), static_cast<int>(raw.size())) != 1) {
    throw InternalError(
        Error::internal("RAND_bytes failed to generate a job token"));
  }
  std::string hex = toHex(raw);
  OPENSSL_cleanse(raw.data(), raw.size());
  return JobToken(std::move(hex));
}

JobToken JobToken::fromString(std::string_view secret) {
  if (secret.size() < kMinTokenChars || secret.size() > kMaxTokenChars) {
    throw InvalidArgumentError(Error::invalidArgument(
        "job token must be " + std::to_string(kMinTokenChars) + " to " +
        std::to_string(kMaxTokenChars) + " characters long, got " +
        std::to_string(secret.size())));
  }
  for (size_t i = 0; i < secret.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(secret[i]);
    if (c < 0x21 || c > 0x7e) {
      throw InvalidArgumentError(Error::invalidArgument(
          "job token must be printable ASCII without spaces; character " +
          std::to_string(i) + " is not"));
    }
  }
  return JobToken(std::string(secret));
}

std::optional<JobToken> JobToken::fromEnvironment() {
  const char* env = std::getenv(kTokenEnvVar);
  if (env == nullptr || *env == '\0') {
    return std::nullopt;
  }
  try {
    return fromString(env);
  } catch (const InvalidArgumentError& e) {
    throw InvalidArgumentError(e.error().withContext(kTokenEnvVar));
  }
}

Nonce randomNonce() {
  Nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) {
    throw InternalError(
        Error::internal("RAND_bytes failed to generate a nonce"));
  }
  return n;
}

Mac hmacSha256(std::span<const uint8_t> key, std::span<const uint8_t> data) {
  Mac out{};
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), data.data(),
           data.size(), out.data(), &len) == nullptr ||
      len != out.size()) {
    throw InternalError(Error::internal("HMAC-SHA256 failed"));
  }
  return out;
}

bool constantTimeEqual(std::span<const uint8_t> a, std::span<const uint8_t> b) {
  if (a.size() != b.size()) {
    return false;
  }
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

Mac computeProof(const JobToken& token, std::string_view role,
                 const Nonce& first, const Nonce& second) {
  std::string msg;
  msg.reserve(kProofLabel.size() + role.size() + 1 + 2 * kNonceBytes);
  msg.append(kProofLabel);
  msg.append(role);
  msg.push_back('\0');
  msg.append(reinterpret_cast<const char*>(first.data()), first.size());
  msg.append(reinterpret_cast<const char*>(second.data()), second.size());
  const auto& s = token.secret();
  return hmacSha256(
      std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size()),
      std::span(reinterpret_cast<const uint8_t*>(msg.data()), msg.size()));
}

Error verifyProof(const JobToken& token, std::string_view role,
                  const Nonce& first, const Nonce& second,
                  std::span<const uint8_t> proof, std::string_view peer) {
  const Mac expected = computeProof(token, role, first, second);
  if (!constantTimeEqual(expected, proof)) {
    return Error::auth("job token proof from " + std::string(peer) +
                       " does not match (wrong or missing TRELLIS_JOB_TOKEN?)");
  }
  return Error();
}

}  // namespace trellis::auth
