// Fuzz target for the TCPStore request decoder (store/protocol.h): arbitrary
// bytes must never make it read out of bounds, allocate from an unchecked
// length or crash; whatever it accepts must re-encode to the same bytes and
// respect the limits; what it refuses for a limit alone must be well
// formed. The response decoder gets the same bytes too.
#include <cstdint>
#include <cstdlib>
#include <span>

#include <trellis/store/protocol.h>

namespace {

using trellis::store::Limits;
namespace protocol = trellis::store::protocol;

void require(bool cond) {
  if (!cond) {
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Small limits so that the limit checks themselves are exercised.
  Limits limits;
  limits.maxKeyBytes = 64;
  limits.maxValueBytes = 256;
  limits.maxKeysPerOp = 16;
  limits.maxFrameBytes = 4096;
  const std::span<const uint8_t> in(data, size);

  protocol::Request req;
  const trellis::Error e = protocol::decodeRequest(in, limits, &req);
  if (e.ok()) {
    require(req.keys.size() <= limits.maxKeysPerOp);
    for (const auto& k : req.keys) {
      require(k.size() <= limits.maxKeyBytes);
    }
    for (const auto& v : req.values) {
      require(v.size() <= limits.maxValueBytes);
    }
    // Re-encoding gives a request that decodes to the same fields (not
    // necessarily the same bytes: varints may arrive non-minimal).
    const auto again = protocol::encodeRequest(req);
    require(again.size() <= size);
    protocol::Request back;
    require(protocol::decodeRequest(again, limits, &back).ok());
    require(back.op == req.op && back.keys == req.keys &&
            back.values == req.values && back.delta == req.delta &&
            back.timeoutMs == req.timeoutMs);
  } else if (e.code() == trellis::Code::kResourceExhausted) {
    // Over a limit but well formed: it decodes under limits as large as
    // the frame, and the server keeps the connection.
    Limits unbounded;
    unbounded.maxKeyBytes = limits.maxFrameBytes;
    unbounded.maxValueBytes = limits.maxFrameBytes;
    unbounded.maxKeysPerOp = limits.maxFrameBytes;
    protocol::Request whole;
    require(protocol::decodeRequest(in, unbounded, &whole).ok());
  } else {
    require(e.code() == trellis::Code::kDataLoss);
  }

  if (size > 0) {
    const auto op = static_cast<protocol::Op>(data[0] % 12);
    protocol::Response resp;
    const trellis::Error re =
        protocol::decodeResponse(op, in.subspan(1), limits, &resp);
    require(re.ok() || re.code() == trellis::Code::kDataLoss);
  }
  return 0;
}
