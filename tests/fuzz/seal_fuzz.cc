// Fuzz target for sealed blobs (core/seal.h): elastic checkpoints and
// DistributedOptimizer states are opened with it before libtorch's archive
// reader, which can crash on corrupted input, sees a byte.
//
// The first byte picks the magic (bit 0) and the mode (bit 1):
//  - open: the rest is a sealed blob as read from a file. Checked: open
//    neither crashes nor reads out of bounds; what it accepts reseals to
//    exactly the same bytes; what it refuses is said in words.
//  - damage: the rest is a tag (8 bytes), a position (2), a mask (1) and a
//    payload. The payload is sealed, which must open; then the byte at the
//    position is XORed with the mask. Checked: the damaged blob is refused,
//    unless the byte is one of the tag's (whose readers check it: the
//    checkpoint against its file name, the optimizer against 0).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include <trellis/core/seal.h>

namespace {

std::string sealed(std::string_view magic, uint64_t tag,
                   std::string_view payload) {
  std::string out = trellis::seal::header(magic, tag, payload);
  out.append(payload);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) {
    return 0;
  }
  const std::string_view magic = (data[0] & 1) != 0 ? "TRLSOPT1" : "TRLSCKP1";
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1,
                              size - 1);
  trellis::seal::Opened opened;
  if ((data[0] & 2) == 0) {
    const std::string why = trellis::seal::open(magic, rest, &opened);
    if (why.empty()) {
      if (sealed(magic, opened.tag, opened.payload) != rest) {
        std::abort();
      }
    } else if (why.size() < 8) {
      std::abort();
    }
    return 0;
  }
  if (rest.size() < 11) {
    return 0;
  }
  uint64_t tag = 0;
  std::memcpy(&tag, rest.data(), 8);
  const size_t position =
      static_cast<uint8_t>(rest[8]) |
      (static_cast<size_t>(static_cast<uint8_t>(rest[9])) << 8);
  const auto mask = static_cast<uint8_t>(rest[10]);
  const std::string_view payload = rest.substr(11);
  std::string blob = sealed(magic, tag, payload);
  if (!trellis::seal::open(magic, blob, &opened).empty() || opened.tag != tag ||
      opened.payload != payload) {
    std::abort();
  }
  if (mask == 0) {
    return 0;
  }
  const size_t at = position % blob.size();
  blob[at] = static_cast<char>(static_cast<uint8_t>(blob[at]) ^ mask);
  const bool inTag =
      at >= trellis::seal::kMagicBytes && at < trellis::seal::kMagicBytes + 8;
  const std::string why = trellis::seal::open(magic, blob, &opened);
  if (inTag ? !why.empty() || opened.tag == tag : why.empty()) {
    std::abort();
  }
  return 0;
}
