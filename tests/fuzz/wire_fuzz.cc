// Fuzz target for core/wire: arbitrary bytes must never make WireReader read
// out of bounds, allocate from an unchecked length, or crash; and whatever a
// WireWriter encodes must decode to the same values.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>

#include <trellis/core/wire.h>

namespace {

using trellis::wire::WireReader;
using trellis::wire::WireWriter;

void require(bool cond) {
  if (!cond) {
    std::abort();
  }
}

// Interprets the head of the input as a script of reads over the tail.
void scriptedDecode(const uint8_t* data, size_t size) {
  if (size < 2) {
    return;
  }
  const size_t scriptLen = std::min<size_t>(data[0], size - 1);
  std::span<const uint8_t> script(data + 1, scriptLen);
  std::span<const uint8_t> body(data + 1 + scriptLen, size - 1 - scriptLen);
  WireReader r(body, "fuzz");
  for (uint8_t op : script) {
    const size_t before = r.remaining();
    const size_t limit = static_cast<size_t>(1) << (op >> 4);
    switch (op & 0x0f) {
      case 0:
        r.u8("u8");
        break;
      case 1:
        r.boolean("bool");
        break;
      case 2:
        r.fixed32("f32");
        break;
      case 3:
        r.fixed64("f64");
        break;
      case 4:
        r.varint("v");
        break;
      case 5:
        r.varint(limit, "bounded");
        break;
      case 6:
        r.signedVarint("s");
        break;
      case 7: {
        auto s = r.string(limit, "str");
        require(s.size() <= limit);
        break;
      }
      case 8: {
        auto b = r.bytes(limit, "bytes");
        require(b.size() <= limit);
        break;
      }
      case 9: {
        auto b = r.raw(op >> 4, "raw");
        require(b.empty() || b.size() == static_cast<size_t>(op >> 4));
        break;
      }
      case 10: {
        WireReader n = r.nested(limit, "nested");
        n.varint("inner");
        n.string(limit, "inner-str");
        n.expectEnd();
        require(n.ok() || !r.ok());
        break;
      }
      default:
        r.expectEnd();
        break;
    }
    require(r.remaining() <= before);
    if (!r.ok()) {
      require(r.error().code() == trellis::Code::kDataLoss);
      require(r.remaining() == 0);
    }
  }
}

// Encodes values taken from the input, then decodes and compares.
void roundTrip(const uint8_t* data, size_t size) {
  uint64_t a = 0;
  if (size > 0) {
    std::memcpy(&a, data, std::min<size_t>(size, sizeof(a)));
  }
  const auto s = static_cast<int64_t>(a ^ 0x5555555555555555ULL);
  const std::string text =
      size > 0 ? std::string(reinterpret_cast<const char*>(data),
                             std::min<size_t>(size, 64))
               : std::string();
  WireWriter w;
  w.putVarint(a);
  w.putSignedVarint(s);
  w.putFixed64(a);
  const size_t mark = w.beginNested();
  w.putString(text);
  w.endNested(mark);
  WireReader r(w.bytes(), "roundtrip");
  require(r.varint() == a);
  require(r.signedVarint() == s);
  require(r.fixed64() == a);
  WireReader n = r.nested(128, "n");
  require(n.string(64, "t") == text);
  n.expectEnd();
  r.expectEnd();
  require(r.ok() && n.ok());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  scriptedDecode(data, size);
  roundTrip(data, size);
  return 0;
}
