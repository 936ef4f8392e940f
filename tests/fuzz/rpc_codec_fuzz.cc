// Fuzz target for rpc/codec: argument bytes and received tensor spans from
// the network must never crash the decoder, make it allocate from an
// unchecked count, or throw; anything it accepts must re-encode to a fixed
// point (encode(decode(encode(v))) == encode(v)).
//
// Input layout: byte 0 = flags (bits 0-2: number of received spans, mod 5;
// bit 3: deliver spans one byte off alignment; bits 4-5: which top-level
// type to decode), then one little-endian u16 length per span (mod 4097),
// then the argument bytes. Span contents repeat the argument bytes.
#include <ATen/core/Tensor.h>
// Not <ATen/ops/empty.h>: with libtorch 1.13 it does not compile under
// clang 14 in C++20 mode (the fuzz preset's compiler).
#include <ATen/EmptyTensor.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include <trellis/rpc/codec.h>
#include <trellis/rpc/serializable.h>

namespace rpc_codec_fuzz {

enum class Kind : uint8_t { kA = 1, kB = 2 };

struct Record {
  Kind kind = Kind::kA;
  std::map<int32_t, std::vector<std::string>> names;
  at::Tensor tensor;
  std::optional<std::array<uint16_t, 3>> extra;
};

}  // namespace rpc_codec_fuzz

TRELLIS_SERIALIZABLE(rpc_codec_fuzz::Record, kind, names, tensor, extra);

namespace {

using namespace trellis::rpc;
using rpc_codec_fuzz::Record;

using Nested = std::vector<std::map<std::string, std::optional<at::Tensor>>>;
using Big = std::tuple<Nested, int64_t, double, std::set<int32_t>,
                       std::pair<bool, std::vector<float>>,
                       std::shared_ptr<std::string>, Record>;
using Flat = std::tuple<std::string, std::vector<double>, std::vector<bool>,
                        int16_t, uint32_t>;

void require(bool cond) {
  if (!cond) {
    std::abort();
  }
}

std::vector<uint8_t> spanBytes(const at::Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  return std::vector<uint8_t>(p, p + t.numel());
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& spans) {
  std::vector<at::Tensor> out;
  for (const auto& s : spans) {
    out.push_back(s.clone());
  }
  return out;
}

template <typename T>
void fixedPoint(const T& v) {
  Encoder e1;
  encodeValue(e1, v);
  Decoder d(e1.wire().bytes(), copies(e1.tensors()));
  T again = decodeValue<T>(d);
  require(d.finish().ok());
  Encoder e2;
  encodeValue(e2, again);
  require(e1.wire().bytes() == e2.wire().bytes());
  require(e1.tensors().size() == e2.tensors().size());
  for (size_t i = 0; i < e1.tensors().size(); ++i) {
    require(spanBytes(e1.tensors()[i]) == spanBytes(e2.tensors()[i]));
  }
}

template <typename T>
void decodeAs(std::span<const uint8_t> args, std::vector<at::Tensor> spans) {
  DecodeLimits limits;
  limits.maxStringBytes = 1 << 16;
  limits.maxElements = 1 << 16;
  limits.maxDims = 8;
  Decoder d(args, std::move(spans), nullptr, limits);
  T v = decodeValue<T>(d);
  const trellis::Error err = d.finish();
  if (!err.ok()) {
    require(err.code() == trellis::Code::kDataLoss);
    return;
  }
  fixedPoint(v);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) {
    return 0;
  }
  const uint8_t flags = data[0];
  const size_t n = (flags & 7) % 5;
  const bool misaligned = (flags & 8) != 0;
  size_t pos = 1;
  if (size < pos + 2 * n) {
    return 0;
  }
  std::vector<size_t> lengths;
  for (size_t i = 0; i < n; ++i) {
    lengths.push_back((data[pos] | (data[pos + 1] << 8)) % 4097);
    pos += 2;
  }
  std::span<const uint8_t> args(data + pos, size - pos);

  std::vector<at::Tensor> spans;
  for (size_t i = 0; i < n; ++i) {
    const auto len = static_cast<int64_t>(lengths[i]);
    at::Tensor buf(
        at::detail::empty_cpu({len + 1}, at::kByte, false, c10::nullopt));
    at::Tensor span =
        misaligned ? buf.slice(0, 1, len + 1) : buf.slice(0, 0, len);
    auto* p = static_cast<uint8_t*>(span.data_ptr());
    for (int64_t k = 0; k < len; ++k) {
      p[k] = args.empty() ? 0 : args[(k + i) % args.size()];
    }
    spans.push_back(span);
  }

  switch ((flags >> 4) & 3) {
    case 0:
      decodeAs<Big>(args, std::move(spans));
      break;
    case 1:
      decodeAs<std::vector<at::Tensor>>(args, std::move(spans));
      break;
    case 2:
      decodeAs<Record>(args, std::move(spans));
      break;
    default:
      decodeAs<Flat>(args, std::move(spans));
      break;
  }
  return 0;
}
