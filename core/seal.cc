#include <array>
#include <cstring>

#include <openssl/evp.h>

#include <trellis/core/check.h>
#include <trellis/core/error.h>
#include <trellis/core/seal.h>

namespace trellis::seal {
namespace {

using Digest = std::array<uint8_t, 32>;
constexpr size_t kTagAt = kMagicBytes;
constexpr size_t kLengthAt = kTagAt + 8;
constexpr size_t kDigestAt = kLengthAt + 8;
static_assert(kDigestAt + sizeof(Digest) == kHeaderBytes);

Digest sha256(std::string_view data) {
  Digest d{};
  unsigned int n = 0;
  if (EVP_Digest(data.data(), data.size(), d.data(), &n, EVP_sha256(),
                 nullptr) != 1 ||
      n != d.size()) {
    throwError(Error::internal("seal: SHA-256 failed"));
  }
  return d;
}

void putU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
}

uint64_t getU64(std::string_view in, size_t at) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i) {
    v |= static_cast<uint64_t>(static_cast<uint8_t>(in[at + i])) << (8 * i);
  }
  return v;
}

}  // namespace

std::string header(std::string_view magic, uint64_t tag,
                   std::string_view payload) {
  TRELLIS_CHECK(magic.size() == kMagicBytes, "seal: a magic is 8 bytes");
  std::string out(magic);
  out.reserve(kHeaderBytes);
  putU64(out, tag);
  putU64(out, payload.size());
  const Digest d = sha256(payload);
  out.append(reinterpret_cast<const char*>(d.data()), d.size());
  return out;
}

std::string open(std::string_view magic, std::string_view sealed, Opened* out) {
  TRELLIS_CHECK(magic.size() == kMagicBytes, "seal: a magic is 8 bytes");
  if (sealed.size() < kHeaderBytes) {
    return "is shorter (" + std::to_string(sealed.size()) +
           " bytes) than its header (" + std::to_string(kHeaderBytes) + ")";
  }
  if (sealed.substr(0, kMagicBytes) != magic) {
    return "has another kind's magic";
  }
  const uint64_t length = getU64(sealed, kLengthAt);
  const size_t held = sealed.size() - kHeaderBytes;
  if (length != held) {
    return "is torn: its header announces " + std::to_string(length) +
           " bytes of payload, it holds " + std::to_string(held);
  }
  const std::string_view payload = sealed.substr(kHeaderBytes);
  const Digest d = sha256(payload);
  if (std::memcmp(d.data(), sealed.data() + kDigestAt, d.size()) != 0) {
    return "is corrupted: its SHA-256 does not match its payload";
  }
  out->tag = getU64(sealed, kTagAt);
  out->payload = payload;
  return "";
}

}  // namespace trellis::seal
