#include <array>
#include <cstring>

#include <openssl/evp.h>

#include <trellis/core/check.h>
#include <trellis/core/error.h>
#include <trellis/core/seal.h>
#include <trellis/core/wire.h>

namespace trellis::seal {
namespace {

using Digest = std::array<uint8_t, 32>;
constexpr size_t kTagAt = kMagicBytes;
constexpr size_t kDigestAt = kTagAt + 16;
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

}  // namespace

std::string header(std::string_view magic, uint64_t tag,
                   std::string_view payload) {
  TRELLIS_CHECK(magic.size() == kMagicBytes, "seal: a magic is 8 bytes");
  wire::WireWriter out;
  out.reserve(kHeaderBytes);
  out.putRaw(magic);
  out.putFixed64(tag);
  out.putFixed64(payload.size());
  const Digest d = sha256(payload);
  out.putRaw(d);
  return std::string(out.bytes().begin(), out.bytes().end());
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
  // The header's size was checked: these reads cannot fail.
  wire::WireReader fields(sealed.substr(kTagAt, kDigestAt - kTagAt), "seal");
  const uint64_t tag = fields.fixed64("tag");
  const uint64_t length = fields.fixed64("length");
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
  out->tag = tag;
  out->payload = payload;
  return "";
}

}  // namespace trellis::seal
