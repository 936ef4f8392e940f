// Fuzz target for the cpu backend's message descriptor
// (collectives/cpu/message.h): what a peer sends before any data.
//
// Checked: decode() never crashes or reads out of bounds; it fails only
// with DATA_LOSS; whatever it accepts re-encodes to bytes that decode to
// the same header (varints may have had a longer form in the input); the
// fingerprint's text form is built without trouble.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <trellis/collectives/cpu/message.h>

namespace {

namespace c = trellis::collectives::detail;

[[noreturn]] void fatal() { std::abort(); }

bool sameHeader(const c::Header& a, const c::Header& b) {
  return a.kind == b.kind && a.rank == b.rank && a.worldSize == b.worldSize &&
         a.groupId == b.groupId && a.fp == b.fp && a.step == b.step &&
         a.tag == b.tag && a.bytes == b.bytes && a.code == b.code &&
         a.reason == b.reason;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  c::Header h;
  const trellis::Error e = c::decode(in, &h);
  if (!e.ok()) {
    if (e.code() != trellis::Code::kDataLoss) {
      fatal();
    }
    return 0;
  }
  const std::string again = c::encode(h);
  c::Header h2;
  if (!c::decode(again, &h2).ok() || !sameHeader(h, h2)) {
    fatal();
  }
  (void)h.fp.toString();
  return 0;
}
