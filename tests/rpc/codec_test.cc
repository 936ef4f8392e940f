#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "envelope.h"
#include "envelope.pb.h"
#include <trellis/rpc/autograd_hooks.h>
#include <trellis/rpc/codec.h>
#include <trellis/rpc/serializable.h>

namespace codec_test {

struct Point {
  int64_t x = 0;
  double y = 0;
  std::string label;
  std::vector<at::Tensor> tensors;
};

enum class Color : uint16_t { kRed = 1, kBlue = 700 };

// The most fields the macro takes.
struct Wide {
  int8_t f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15;
  std::string f16;
};

struct NotSerializable {
  int x;
};

}  // namespace codec_test

TRELLIS_SERIALIZABLE(codec_test::Point, x, y, label, tensors);
TRELLIS_SERIALIZABLE(codec_test::Wide, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10,
                     f11, f12, f13, f14, f15, f16);

namespace trellis::rpc {
namespace {

using codec_test::Color;
using codec_test::Point;

// What the transport does: the receiver gets fresh 1-D uint8 buffers with
// the bytes of each span.
std::vector<at::Tensor> deliver(const std::vector<at::Tensor>& spans) {
  std::vector<at::Tensor> out;
  for (const auto& s : spans) {
    EXPECT_EQ(s.dim(), 1);
    EXPECT_EQ(s.scalar_type(), at::kByte);
    EXPECT_TRUE(s.is_contiguous());
    out.push_back(s.clone());
  }
  return out;
}

struct Encoded {
  std::vector<uint8_t> bytes;
  std::vector<at::Tensor> spans;
};

// `apart`: every tensor as a transport tensor of its own (the span path
// most tests here are about); false: as a sender does, small CPU tensors
// inside the bytes.
template <typename T>
Encoded encode(const T& v, bool apart = true) {
  Encoder e;
  if (apart) {
    e.sendTensorsApart();
  }
  encodeValue(e, v);
  return {e.wire().bytes(), e.tensors()};
}

template <typename T>
T roundTrip(const T& v, bool apart = true) {
  Encoded enc = encode(v, apart);
  Decoder d(enc.bytes, deliver(enc.spans));
  T out = decodeValue<T>(d);
  const Error err = d.finish();
  EXPECT_TRUE(err.ok()) << err.what();
  return out;
}

template <typename T>
Error decodeError(const std::vector<uint8_t>& bytes,
                  std::vector<at::Tensor> tensors = {},
                  DecodeLimits limits = {}) {
  Decoder d(bytes, std::move(tensors), nullptr, limits);
  T v = decodeValue<T>(d);
  (void)v;
  return d.finish();
}

void expectProtocolError(const Error& err, const std::string& field) {
  EXPECT_EQ(err.code(), Code::kDataLoss) << err.what();
  EXPECT_THAT(err.message(), ::testing::HasSubstr(field)) << err.what();
}

bool sameTensor(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) {
    return false;
  }
  if (!a.defined()) {
    return true;
  }
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         a.requires_grad() == b.requires_grad() && a.detach().equal(b.detach());
}

at::Tensor sample(at::ScalarType dtype) {
  at::Tensor base = at::arange(24, at::kFloat).reshape({2, 3, 4});
  if (dtype == at::kBool) {
    return base.remainder(2).to(at::kBool);
  }
  return base.to(dtype);
}

// ---------------------------------------------------------------------------
// Scalars and strings.

TEST(CodecTest, IntegersRoundTripAtTheirExtremes) {
  EXPECT_EQ(roundTrip(true), true);
  EXPECT_EQ(roundTrip(false), false);
  EXPECT_EQ(roundTrip(int8_t{-128}), -128);
  EXPECT_EQ(roundTrip(uint8_t{255}), 255);
  EXPECT_EQ(roundTrip(std::numeric_limits<int16_t>::min()),
            std::numeric_limits<int16_t>::min());
  EXPECT_EQ(roundTrip(std::numeric_limits<uint16_t>::max()),
            std::numeric_limits<uint16_t>::max());
  EXPECT_EQ(roundTrip(std::numeric_limits<int32_t>::min()),
            std::numeric_limits<int32_t>::min());
  EXPECT_EQ(roundTrip(std::numeric_limits<uint32_t>::max()),
            std::numeric_limits<uint32_t>::max());
  EXPECT_EQ(roundTrip(std::numeric_limits<int64_t>::min()),
            std::numeric_limits<int64_t>::min());
  EXPECT_EQ(roundTrip(std::numeric_limits<int64_t>::max()),
            std::numeric_limits<int64_t>::max());
  EXPECT_EQ(roundTrip(std::numeric_limits<uint64_t>::max()),
            std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(roundTrip(-5LL), -5LL);
  EXPECT_EQ(roundTrip(7UL), 7UL);
}

TEST(CodecTest, FloatsKeepTheirBits) {
  EXPECT_EQ(roundTrip(1.5f), 1.5f);
  EXPECT_EQ(roundTrip(-0.0), -0.0);
  EXPECT_TRUE(std::signbit(roundTrip(-0.0)));
  EXPECT_TRUE(std::isnan(roundTrip(std::nan(""))));
  EXPECT_EQ(roundTrip(std::numeric_limits<double>::infinity()),
            std::numeric_limits<double>::infinity());
  EXPECT_EQ(roundTrip(std::numeric_limits<float>::denorm_min()),
            std::numeric_limits<float>::denorm_min());
}

TEST(CodecTest, EnumsStringsAndVoid) {
  EXPECT_EQ(roundTrip(Color::kBlue), Color::kBlue);
  EXPECT_EQ(roundTrip(std::string()), "");
  const std::string withNul("a\0b\xff", 4);
  EXPECT_EQ(roundTrip(withNul), withNul);
  EXPECT_EQ(roundTrip(std::string(100000, 'x')), std::string(100000, 'x'));
  roundTrip(std::monostate{});
  EXPECT_TRUE(encode(std::monostate{}).bytes.empty());
}

// ---------------------------------------------------------------------------
// Containers.

TEST(CodecTest, ContainersRoundTrip) {
  const std::vector<int32_t> ints{1, -2, 3, std::numeric_limits<int>::min()};
  EXPECT_EQ(roundTrip(ints), ints);
  const std::vector<double> doubles{0.5, -1e300, 3};
  EXPECT_EQ(roundTrip(doubles), doubles);
  const std::vector<uint8_t> bytes{0, 1, 255};
  EXPECT_EQ(roundTrip(bytes), bytes);
  const std::vector<bool> bools{true, false, true};
  EXPECT_EQ(roundTrip(bools), bools);
  const std::vector<std::string> strings{"a", "", "ccc"};
  EXPECT_EQ(roundTrip(strings), strings);
  EXPECT_EQ(roundTrip(std::vector<int64_t>{}), std::vector<int64_t>{});

  const std::array<double, 3> arr{1, 2, 3};
  EXPECT_EQ(roundTrip(arr), arr);
  const std::array<std::string, 2> sarr{"x", "yz"};
  EXPECT_EQ(roundTrip(sarr), sarr);

  const std::map<std::string, int64_t> m{{"a", 1}, {"b", -2}};
  EXPECT_EQ(roundTrip(m), m);
  const std::unordered_map<int32_t, std::string> um{{1, "one"}, {2, "two"}};
  EXPECT_EQ(roundTrip(um), um);
  const std::set<uint16_t> s{3, 1, 2};
  EXPECT_EQ(roundTrip(s), s);
  const std::unordered_set<std::string> us{"p", "q"};
  EXPECT_EQ(roundTrip(us), us);

  EXPECT_EQ(roundTrip(std::optional<int>()), std::nullopt);
  EXPECT_EQ(roundTrip(std::optional<int>(4)), 4);
  const auto pair = std::make_pair(std::string("k"), 2.5f);
  EXPECT_EQ(roundTrip(pair), pair);
  const auto tuple = std::make_tuple(int8_t{1}, std::string("t"),
                                     std::vector<uint64_t>{9, 8}, Color::kRed);
  EXPECT_EQ(roundTrip(tuple), tuple);
  EXPECT_EQ(roundTrip(std::tuple<>()), std::tuple<>());

  EXPECT_EQ(roundTrip(std::shared_ptr<std::string>()), nullptr);
  auto sp = roundTrip(std::make_shared<std::string>("shared"));
  ASSERT_NE(sp, nullptr);
  EXPECT_EQ(*sp, "shared");
}

TEST(CodecTest, VectorOfArithmeticIsOneLittleEndianBlock) {
  const std::vector<uint32_t> v{0x04030201, 0x08070605};
  const auto bytes = encode(v).bytes;
  const std::vector<uint8_t> expected{2, 1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_EQ(bytes, expected);
}

TEST(CodecTest, NestedTensorsRoundTrip) {
  using Nested = std::vector<std::map<std::string, std::optional<at::Tensor>>>;
  Nested v(3);
  v[0]["a"] = at::ones({2, 2});
  v[0]["none"] = std::nullopt;
  v[0]["undef"] = at::Tensor();
  v[2]["b"] = at::arange(5, at::kLong);
  Encoded enc = encode(v);
  EXPECT_EQ(enc.spans.size(), 2u);
  Decoder d(enc.bytes, deliver(enc.spans));
  Nested out = decodeValue<Nested>(d);
  ASSERT_TRUE(d.finish().ok()) << d.error().what();
  ASSERT_EQ(out.size(), 3u);
  EXPECT_TRUE(out[1].empty());
  EXPECT_TRUE(sameTensor(*out[0]["a"], *v[0]["a"]));
  EXPECT_FALSE(out[0]["none"].has_value());
  ASSERT_TRUE(out[0]["undef"].has_value());
  EXPECT_FALSE(out[0]["undef"]->defined());
  EXPECT_TRUE(sameTensor(*out[2]["b"], *v[2]["b"]));
}

TEST(CodecTest, SerializableStructRoundTrips) {
  Point p;
  p.x = -3;
  p.y = 0.25;
  p.label = "pt";
  p.tensors = {at::ones({3}), at::Tensor()};
  Point out = roundTrip(p);
  EXPECT_EQ(out.x, -3);
  EXPECT_EQ(out.y, 0.25);
  EXPECT_EQ(out.label, "pt");
  ASSERT_EQ(out.tensors.size(), 2u);
  EXPECT_TRUE(sameTensor(out.tensors[0], p.tensors[0]));
  EXPECT_FALSE(out.tensors[1].defined());
  EXPECT_EQ(typeName<Point>(),
            "codec_test::Point{x:i64,y:f64,label:str,tensors:vec<Tensor>}");
}

TEST(CodecTest, SixteenFieldStruct) {
  codec_test::Wide w{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, -15, "s"};
  codec_test::Wide out = roundTrip(w);
  EXPECT_EQ(out.f1, 1);
  EXPECT_EQ(out.f15, -15);
  EXPECT_EQ(out.f16, "s");
  EXPECT_EQ(Codec<codec_test::Wide>::kMinBytes, 16u);
  EXPECT_EQ(encode(w).bytes.size(), 17u);
}

TEST(CodecTest, ProtobufMessagesRoundTrip) {
  wire::Envelope env;
  env.set_version(3);
  env.set_kind(wire::Envelope::REQUEST);
  env.set_function("add");
  env.set_signature(0xfeedfacecafebeefULL);
  env.mutable_error()->set_message("boom");
  wire::Envelope out = roundTrip(env);
  EXPECT_EQ(out.SerializeAsString(), env.SerializeAsString());
  EXPECT_EQ(typeName<wire::Envelope>(), "proto<trellis.rpc.wire.Envelope>");

  // A string that is not a valid message fails the decoder.
  Encoder e;
  e.wire().putString(std::string("\xff\xff\xff", 3));
  expectProtocolError(decodeError<wire::Envelope>(e.wire().bytes()), "proto");
}

// ---------------------------------------------------------------------------
// Tensors.

TEST(CodecTest, EveryAllowedDtypeRoundTrips) {
  for (auto dtype : {at::kHalf, at::kFloat, at::kDouble, at::kBFloat16,
                     at::kChar, at::kShort, at::kInt, at::kLong, at::kByte,
                     at::kBool, at::kComplexFloat, at::kComplexDouble}) {
    SCOPED_TRACE(c10::toString(dtype));
    at::Tensor t = sample(dtype);
    for (bool apart : {true, false}) {
      at::Tensor out = roundTrip(t, apart);
      EXPECT_TRUE(sameTensor(out, t));
      EXPECT_EQ(out.strides(), t.strides());
    }
  }
}

// docs/rpc_wire.md, "Small tensors".
TEST(CodecTest, SmallCpuTensorsTravelInsideTheArgumentBytes) {
  const at::Tensor t = sample(at::kFloat);  // 96 bytes
  Encoder e;
  encodeValue(e, t);
  EXPECT_TRUE(e.outgoing().empty());
  // The data is in the payload but not in what maxMessageBytes bounds.
  EXPECT_EQ(e.payloadBytes() - e.wireBytes(), 96u);
  const std::vector<uint8_t> bytes = e.wire().bytes();
  Decoder d(bytes, {});
  at::Tensor out = decodeValue<at::Tensor>(d);
  ASSERT_TRUE(d.finish().ok()) << d.error().what();
  EXPECT_TRUE(sameTensor(out, t));
  EXPECT_TRUE(out.is_contiguous());
  EXPECT_FALSE(out.requires_grad());
  // Memory of its own, not a view of the bytes it came in.
  const auto* p = static_cast<const uint8_t*>(out.data_ptr());
  EXPECT_TRUE(p < bytes.data() || p >= bytes.data() + bytes.size());
  const at::Tensor before = out.clone();
  Decoder again(bytes, {});
  at::Tensor second = decodeValue<at::Tensor>(again);
  ASSERT_TRUE(again.finish().ok());
  second.add_(1);
  EXPECT_TRUE(out.equal(before));

  // Zero-dim and empty tensors too.
  EXPECT_EQ(roundTrip(at::ones({}, at::kDouble).mul(7), false).item<double>(),
            7);
  const at::Tensor empty = at::empty({0, 3});
  EXPECT_TRUE(encode(empty, false).spans.empty());
  EXPECT_EQ(roundTrip(empty, false).sizes(), empty.sizes());
}

TEST(CodecTest, InlineStopsAtTheTensorAndMessageLimits) {
  constexpr auto kOne = static_cast<int64_t>(Encoder::kInlineTensorBytes);
  // Exactly the limit goes inline; one byte more, apart.
  std::vector<at::Tensor> two = {at::full({kOne}, 3, at::kByte),
                                 at::full({kOne + 1}, 4, at::kByte)};
  Encoded enc = encode(two, false);
  ASSERT_EQ(enc.spans.size(), 1u);
  EXPECT_EQ(enc.spans[0].numel(), kOne + 1);
  auto out = roundTrip(two, false);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(out[0].equal(two[0]));
  EXPECT_TRUE(out[1].equal(two[1]));

  // The message's inline budget: the tensors that fit it go inline, in
  // order, and the rest apart.
  const size_t fit =
      Encoder::kInlineBytesPerMessage / Encoder::kInlineTensorBytes;
  std::vector<at::Tensor> many;
  for (size_t i = 0; i <= fit; ++i) {
    many.push_back(at::full({kOne / 4}, static_cast<int>(i), at::kInt));
  }
  Encoder e;
  encodeValue(e, many);
  ASSERT_EQ(e.outgoing().size(), 1u);
  EXPECT_EQ(e.outgoing()[0][0].item<int>(), static_cast<int>(fit));
  EXPECT_EQ(e.payloadBytes() - e.wireBytes(), Encoder::kInlineBytesPerMessage);
  out = roundTrip(many, false);
  ASSERT_EQ(out.size(), many.size());
  for (size_t i = 0; i < many.size(); ++i) {
    EXPECT_TRUE(out[i].equal(many[i])) << i;
  }

  // A dense layout that is not contiguous keeps its strides apart.
  const at::Tensor t = at::arange(12, at::kFloat).reshape({3, 4}).t();
  enc = encode(t, false);
  ASSERT_EQ(enc.spans.size(), 1u);
  EXPECT_EQ(roundTrip(t, false).strides(), t.strides());
}

TEST(CodecTest, UnsupportedTensorsAreRejectedAtEncode) {
  Encoder e;
  EXPECT_THROW(encodeValue(e, at::empty({2}, at::kComplexHalf)),
               InvalidArgumentError);
  EXPECT_THROW(e.addTensor(at::Tensor()), InvalidArgumentError);
}

TEST(CodecTest, ZeroDimAndEmptyTensors) {
  at::Tensor scalar = at::ones({}, at::kDouble).mul(7);
  at::Tensor out = roundTrip(scalar);
  EXPECT_EQ(out.dim(), 0);
  EXPECT_EQ(out.item<double>(), 7);

  at::Tensor empty = at::empty({0, 3});
  Encoded enc = encode(empty);
  ASSERT_EQ(enc.spans.size(), 1u);
  EXPECT_EQ(enc.spans[0].numel(), 0);
  out = roundTrip(empty);
  EXPECT_EQ(out.sizes(), empty.sizes());
}

TEST(CodecTest, TransposeKeepsStridesWithoutACopy) {
  at::Tensor t = at::arange(12, at::kFloat).reshape({3, 4}).t();
  Encoded enc = encode(t);
  ASSERT_EQ(enc.spans.size(), 1u);
  EXPECT_EQ(enc.spans[0].data_ptr(), t.data_ptr());
  EXPECT_EQ(enc.spans[0].numel(), 12 * 4);
  at::Tensor out = roundTrip(t);
  EXPECT_EQ(out.strides(), t.strides());
  EXPECT_TRUE(sameTensor(out, t));
}

TEST(CodecTest, SteppedSliceSendsAContiguousCopy) {
  at::Tensor base = at::arange(20, at::kInt);
  at::Tensor t = base.slice(0, 0, 20, 3);
  Encoded enc = encode(t);
  ASSERT_EQ(enc.spans.size(), 1u);
  EXPECT_EQ(enc.spans[0].numel(), t.numel() * 4);
  EXPECT_NE(enc.spans[0].data_ptr(), t.data_ptr());
  at::Tensor out = roundTrip(t);
  EXPECT_TRUE(out.is_contiguous());
  EXPECT_TRUE(sameTensor(out, t));
}

TEST(CodecTest, NarrowViewSendsOnlyItsSpan) {
  at::Tensor big = at::arange(1 << 20, at::kFloat).reshape({1 << 10, 1 << 10});
  at::Tensor v = big.narrow(0, 100, 2);
  Encoded enc = encode(v);
  ASSERT_EQ(enc.spans.size(), 1u);
  EXPECT_EQ(enc.spans[0].numel(), 2 * 1024 * 4);
  EXPECT_EQ(enc.spans[0].data_ptr(), v.data_ptr());
  at::Tensor out = roundTrip(v);
  EXPECT_TRUE(sameTensor(out, v));
  EXPECT_EQ(out.storage_offset(), 0);
}

TEST(CodecTest, RequiresGradIsPreservedAndTheResultIsALeaf) {
  at::Tensor leaf = at::ones({3});
  leaf.set_requires_grad(true);
  at::Tensor nonLeaf = leaf.mul(2);
  at::Tensor out = roundTrip(leaf);
  EXPECT_TRUE(out.requires_grad());
  out = roundTrip(nonLeaf);
  EXPECT_TRUE(out.requires_grad());
  EXPECT_TRUE(out.is_leaf());
  EXPECT_TRUE(out.detach().equal(nonLeaf.detach()));
  EXPECT_FALSE(roundTrip(at::ones({2})).requires_grad());
  out = roundTrip(nonLeaf, false);  // inline
  EXPECT_TRUE(out.requires_grad());
  EXPECT_TRUE(out.is_leaf());
  EXPECT_TRUE(out.detach().equal(nonLeaf.detach()));
}

// Distributed autograd's view of the codec: the encoder lists the tensors
// that require grad (the originals, in order) and the decoder hands the
// received ones to a GradReceiver instead of making them leaves.
class RecordingReceiver : public GradReceiver {
 public:
  void attach(at::Tensor& t) override {
    seen.push_back(t);
    if (failOn >= 0 && static_cast<int>(seen.size()) - 1 == failOn) {
      throw std::runtime_error("receiver refused");
    }
  }
  std::vector<at::Tensor> seen;
  int failOn = -1;
};

TEST(CodecTest, GradTensorsAreListedAndHandedToTheReceiver) {
  at::Tensor a = at::ones({2});
  a.set_requires_grad(true);
  at::Tensor b = a.mul(3);  // non-leaf
  at::Tensor plain = at::zeros({4});
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> v{a, plain, b, a};
  Encoder e;
  encodeValue(e, v);
  ASSERT_EQ(e.gradTensors().size(), 3u);
  EXPECT_TRUE(e.gradTensors()[0].is_same(a));
  EXPECT_TRUE(e.gradTensors()[1].is_same(b));
  EXPECT_TRUE(e.gradTensors()[2].is_same(a));

  const std::vector<uint8_t> bytes = e.wire().bytes();
  RecordingReceiver r;
  Decoder d(bytes, deliver(e.tensors()));
  d.setGradReceiver(&r);
  auto out = decodeValue<decltype(v)>(d);
  ASSERT_TRUE(d.finish().ok());
  ASSERT_EQ(r.seen.size(), 3u);
  EXPECT_TRUE(r.seen[0].is_same(std::get<0>(out)));
  EXPECT_TRUE(r.seen[1].is_same(std::get<2>(out)));
  EXPECT_TRUE(r.seen[2].is_same(std::get<3>(out)));
  // The receiver decides; the codec does not make them leaves that require
  // grad on its own.
  EXPECT_FALSE(std::get<0>(out).requires_grad());
  EXPECT_FALSE(std::get<1>(out).requires_grad());
  EXPECT_TRUE(std::get<2>(out).equal(b.detach()));

  RecordingReceiver refusing;
  refusing.failOn = 1;
  Decoder d2(bytes, deliver(e.tensors()));
  d2.setGradReceiver(&refusing);
  (void)decodeValue<decltype(v)>(d2);
  const Error err = d2.finish();
  EXPECT_FALSE(err.ok());
  EXPECT_NE(err.message().find("receiver refused"), std::string::npos)
      << err.what();
}

TEST(EnvelopeTest, AutogradIdsAreChecked) {
  auto parse = [](uint64_t ctx, uint64_t msg) {
    wire::Envelope env;
    env.set_version(kEnvelopeVersion);
    env.set_kind(wire::Envelope::REQUEST);
    env.set_function("f");
    env.set_autograd_context_id(ctx);
    env.set_autograd_message_id(msg);
    wire::Envelope out;
    return parseEnvelope(env.SerializeAsString(), 4, true, &out);
  };
  EXPECT_TRUE(parse(0, 0).ok());
  EXPECT_TRUE(parse((uint64_t{3} << 48) | 7, 0).ok());
  EXPECT_TRUE(parse((uint64_t{3} << 48) | 7, 12).ok());
  const Error badRank = parse(uint64_t{4} << 48, 0);
  EXPECT_EQ(badRank.code(), Code::kDataLoss);
  EXPECT_NE(badRank.message().find("autograd_context_id"), std::string::npos);
  const Error orphan = parse(0, 5);
  EXPECT_EQ(orphan.code(), Code::kDataLoss);
  EXPECT_NE(orphan.message().find("without autograd_context_id"),
            std::string::npos);
}

TEST(EnvelopeTest, OneWayOnlyInRequestsOutsideContexts) {
  auto parse = [](wire::Envelope::Kind kind, uint64_t ctx) {
    wire::Envelope env;
    env.set_version(kEnvelopeVersion);
    env.set_kind(kind);
    env.set_function("f");
    env.set_one_way(true);
    env.set_autograd_context_id(ctx);
    wire::Envelope out;
    return parseEnvelope(env.SerializeAsString(), 4,
                         kind == wire::Envelope::REQUEST, &out);
  };
  EXPECT_TRUE(parse(wire::Envelope::REQUEST, 0).ok());
  const Error inResponse = parse(wire::Envelope::RESPONSE, 0);
  EXPECT_EQ(inResponse.code(), Code::kDataLoss);
  EXPECT_NE(inResponse.message().find("one_way set in a response"),
            std::string::npos)
      << inResponse.what();
  const Error inContext = parse(wire::Envelope::REQUEST, uint64_t{1} << 48);
  EXPECT_EQ(inContext.code(), Code::kDataLoss);
  EXPECT_NE(inContext.message().find("one-way request inside"),
            std::string::npos)
      << inContext.what();
}

TEST(EnvelopeTest, AlsoAnswersOnlyInResponsesAndNeverTheirOwnRequest) {
  auto parse = [](wire::Envelope::Kind kind, uint64_t id, uint64_t also) {
    wire::Envelope env;
    env.set_version(kEnvelopeVersion);
    env.set_kind(kind);
    env.set_function("f");
    env.set_request_id(id);
    env.set_also_answers(also);
    wire::Envelope out;
    return parseEnvelope(env.SerializeAsString(), 4,
                         kind == wire::Envelope::REQUEST, &out);
  };
  EXPECT_TRUE(parse(wire::Envelope::RESPONSE, 8, 7).ok());
  EXPECT_TRUE(parse(wire::Envelope::RESPONSE, 8, 0).ok());
  const Error inRequest = parse(wire::Envelope::REQUEST, 8, 7);
  EXPECT_EQ(inRequest.code(), Code::kDataLoss);
  EXPECT_NE(inRequest.message().find("also_answers set in a request"),
            std::string::npos)
      << inRequest.what();
  const Error itself = parse(wire::Envelope::RESPONSE, 8, 8);
  EXPECT_EQ(itself.code(), Code::kDataLoss);
  EXPECT_NE(itself.message().find("own request"), std::string::npos)
      << itself.what();
}

// Text fields are bytes on the wire (envelope.proto): an error message or
// a name that is not UTF-8 parses, byte for byte.
TEST(EnvelopeTest, TextThatIsNotUtf8Parses) {
  const std::string latin1 = "caf\xe9 \xff\xfe";
  wire::Envelope env;
  env.set_version(kEnvelopeVersion);
  env.set_kind(wire::Envelope::RESPONSE);
  env.set_function(latin1);
  auto* info = env.mutable_error();
  info->set_code(static_cast<uint32_t>(Code::kUnknown));
  info->set_message("no such file: " + latin1);
  info->set_worker(latin1);
  info->set_function(latin1);
  info->set_exception_type(latin1);
  auto* ev = env.add_events();
  ev->set_name(latin1);
  ev->set_worker(latin1);
  wire::Envelope out;
  const Error e = parseEnvelope(env.SerializeAsString(), 4, false, &out);
  ASSERT_TRUE(e.ok()) << e.what();
  EXPECT_EQ(out.error().message(), "no such file: " + latin1);
  EXPECT_EQ(out.error().exception_type(), latin1);
  EXPECT_EQ(out.events(0).name(), latin1);
}

// A reply whatever the user's code put in it (fitReplyToLimits) parses:
// long text cut, saying so; events past the bound dropped, saying how many.
TEST(EnvelopeTest, AReplyFittedToTheLimitsParses) {
  wire::Envelope env;
  env.set_version(kEnvelopeVersion);
  env.set_kind(wire::Envelope::RESPONSE);
  auto* info = env.mutable_error();
  info->set_code(static_cast<uint32_t>(Code::kUnknown));
  info->set_message("bad batch: " + std::string(200000, 'x'));
  info->set_exception_type(std::string(5000, 'T'));
  info->set_worker("w1");
  for (int i = 0; i < kMaxProfileEvents + 500; ++i) {
    auto* ev = env.add_events();
    ev->set_name(i == 0 ? std::string(3000, 'n') : "rpc#f");
    ev->set_worker("w1");
    ev->set_start_us(i);
    ev->set_duration_us(1);
  }
  wire::Envelope out;
  EXPECT_EQ(parseEnvelope(env.SerializeAsString(), 4, false, &out).code(),
            Code::kDataLoss);
  fitReplyToLimits(&env);
  const Error e = parseEnvelope(env.SerializeAsString(), 4, false, &out);
  ASSERT_TRUE(e.ok()) << e.what();
  const std::string& message = out.error().message();
  EXPECT_EQ(message.size(), kMaxErrorMessageBytes);
  EXPECT_EQ(message.rfind("bad batch: xxx", 0), 0u);
  EXPECT_NE(message.find("[200011 bytes, the rest cut]"), std::string::npos)
      << message.substr(message.size() - 80);
  EXPECT_EQ(out.error().exception_type().size(), kMaxFunctionNameBytes);
  EXPECT_EQ(out.error().worker(), "w1");
  ASSERT_EQ(out.events_size(), kMaxProfileEvents);
  EXPECT_EQ(out.events(0).name().size(), kMaxFunctionNameBytes);
  EXPECT_EQ(out.events(kMaxProfileEvents - 2).name(), "rpc#f");
  EXPECT_EQ(out.events(kMaxProfileEvents - 1).name(),
            "rpc profiler: 501 more nested events dropped (at most 1024 per "
            "reply)");
  // Within the limits, nothing changes.
  wire::Envelope small = out;
  small.mutable_error()->set_message("short");
  small.mutable_events()->DeleteSubrange(2, kMaxProfileEvents - 2);
  const std::string before = small.SerializeAsString();
  fitReplyToLimits(&small);
  EXPECT_EQ(small.SerializeAsString(), before);
}

TEST(CodecTest, ConjugateViewsTravelAsValues) {
  at::Tensor c = sample(at::kComplexFloat).mul(at::ones({}, at::kComplexFloat));
  at::Tensor conj = c.conj();
  EXPECT_TRUE(sameTensor(roundTrip(conj), conj.resolve_conj()));
}

TEST(CodecTest, MisalignedReceivedSpanIsCopied) {
  at::Tensor t = at::arange(6, at::kDouble);
  Encoded enc = encode(t);
  at::Tensor shifted = at::empty({49}, at::kByte);
  at::Tensor span = shifted.slice(0, 1, 49);
  span.copy_(enc.spans[0]);
  Decoder d(enc.bytes, {span});
  at::Tensor out = decodeValue<at::Tensor>(d);
  ASSERT_TRUE(d.finish().ok()) << d.error().what();
  EXPECT_TRUE(sameTensor(out, t));
}

// ---------------------------------------------------------------------------
// Malformed input.

// Writes a tensor description by hand.
std::vector<uint8_t> tensorBytes(uint8_t dtype, std::vector<uint64_t> sizes,
                                 std::vector<uint64_t> strides, uint64_t offset,
                                 uint64_t index, bool requiresGrad = false) {
  ::trellis::wire::WireWriter w;
  w.putBool(true);
  w.putU8(dtype);
  w.putU8(0);
  w.putSignedVarint(-1);
  w.putBool(requiresGrad);
  w.putVarint(sizes.size());
  for (auto s : sizes) {
    w.putVarint(s);
  }
  for (auto s : strides) {
    w.putVarint(s);
  }
  w.putVarint(offset);
  w.putVarint(index);
  return w.release();
}

constexpr uint8_t kFloatCode = 6;

// Writes the description of a tensor carried inline by hand.
std::vector<uint8_t> inlineTensorBytes(uint8_t dtype,
                                       std::vector<uint64_t> sizes,
                                       std::vector<uint8_t> data,
                                       uint8_t device = 0,
                                       bool requiresGrad = false) {
  ::trellis::wire::WireWriter w;
  w.putU8(2);
  w.putU8(dtype);
  w.putU8(device);
  w.putSignedVarint(device == 0 ? -1 : 0);
  w.putBool(requiresGrad);
  w.putVarint(sizes.size());
  for (auto s : sizes) {
    w.putVarint(s);
  }
  w.putBytes(data);
  return w.release();
}

at::Tensor bytesTensor(int64_t n) { return at::zeros({n}, at::kByte); }

TEST(CodecMalformedTest, HandWrittenTensorDecodes) {
  at::Tensor span = at::arange(8, at::kFloat).view(at::kByte).clone();
  const auto bytes = tensorBytes(kFloatCode, {2, 2}, {1, 2}, 4, 0);
  Decoder d(bytes, {span});
  at::Tensor out = decodeValue<at::Tensor>(d);
  ASSERT_TRUE(d.finish().ok()) << d.error().what();
  EXPECT_EQ(out[1][0].item<float>(), 5);
}

TEST(CodecMalformedTest, InlineTensors) {
  std::vector<uint8_t> two(8, 0);
  const float v = 2.5f;
  std::memcpy(two.data() + 4, &v, 4);
  {
    const auto bytes = inlineTensorBytes(kFloatCode, {2}, two);
    Decoder d(bytes, {});
    at::Tensor out = decodeValue<at::Tensor>(d);
    ASSERT_TRUE(d.finish().ok()) << d.error().what();
    EXPECT_EQ(out[1].item<float>(), 2.5f);
  }
  expectProtocolError(decodeError<at::Tensor>({3}), "Tensor.form");
  expectProtocolError(
      decodeError<at::Tensor>(inlineTensorBytes(kFloatCode, {2}, {0, 0, 0, 0})),
      "Tensor.data");
  expectProtocolError(decodeError<at::Tensor>(
                          inlineTensorBytes(kFloatCode, {1}, {0, 0, 0, 0, 0})),
                      "Tensor.data");
  expectProtocolError(
      decodeError<at::Tensor>(inlineTensorBytes(11, {2}, {1, 2})),
      "Tensor.data");
  expectProtocolError(
      decodeError<at::Tensor>(inlineTensorBytes(kFloatCode, {1}, two, 1)),
      "Tensor.device");
  expectProtocolError(decodeError<at::Tensor>(inlineTensorBytes(
                          4, {1}, std::vector<uint8_t>(8), 0, true)),
                      "requires_grad");
  expectProtocolError(
      decodeError<at::Tensor>(inlineTensorBytes(
          0, {Encoder::kInlineTensorBytes + 1},
          std::vector<uint8_t>(Encoder::kInlineTensorBytes + 1))),
      "Tensor.data");
  expectProtocolError(
      decodeError<at::Tensor>(inlineTensorBytes(
          kFloatCode, {uint64_t{1} << 62, uint64_t{1} << 62}, {})),
      "Tensor.sizes");
  std::vector<uint64_t> ones(65, 1);
  expectProtocolError(
      decodeError<at::Tensor>(inlineTensorBytes(kFloatCode, ones, two)),
      "Tensor.dims");
  // The decoder's own dtype check.
  expectProtocolError(decodeError<at::Tensor>(inlineTensorBytes(8, {1}, two)),
                      "Tensor.dtype");
}

TEST(CodecMalformedTest, BadDtype) {
  // 8 is ComplexHalf, 12 QInt8: real ATen types outside the allow-list.
  for (uint8_t code : {8, 12, 16, 200}) {
    expectProtocolError(
        decodeError<at::Tensor>(tensorBytes(code, {1}, {1}, 0, 0),
                                {bytesTensor(8)}),
        "Tensor.dtype");
  }
}

TEST(CodecMalformedTest, LayoutOutsideTheSpan) {
  auto span = [] { return std::vector<at::Tensor>{bytesTensor(16)}; };
  // Four floats fit; reaching element 6 does not.
  expectProtocolError(
      decodeError<at::Tensor>(tensorBytes(kFloatCode, {4}, {2}, 0, 0), span()),
      "Tensor.strides");
  expectProtocolError(
      decodeError<at::Tensor>(tensorBytes(kFloatCode, {4}, {1}, 1, 0), span()),
      "Tensor.strides");
  expectProtocolError(
      decodeError<at::Tensor>(tensorBytes(kFloatCode, {0}, {1}, 5, 0), span()),
      "Tensor.strides");
  // Sizes whose product overflows, and a huge stride.
  const uint64_t big = uint64_t{1} << 62;
  expectProtocolError(
      decodeError<at::Tensor>(tensorBytes(kFloatCode, {big, big}, {0, 0}, 0, 0),
                              span()),
      "Tensor.sizes");
  expectProtocolError(decodeError<at::Tensor>(
                          tensorBytes(kFloatCode, {2}, {big}, 0, 0), span()),
                      "Tensor.strides");
  // Expanded (stride 0) views would let 16 bytes pose as a huge tensor.
  expectProtocolError(
      decodeError<at::Tensor>(tensorBytes(kFloatCode, {1 << 20}, {0}, 0, 0),
                              span()),
      "Tensor.strides");
  // Overlapping but in range.
  expectProtocolError(
      decodeError<at::Tensor>(tensorBytes(kFloatCode, {2, 2}, {1, 1}, 0, 0),
                              span()),
      "Tensor.strides");
  // An element at the very top of int64: one past it overflows (found by
  // rpc_codec_fuzz; the input is in its corpus too).
  expectProtocolError(
      decodeError<at::Tensor>(
          tensorBytes(kFloatCode, {1}, {1},
                      uint64_t{std::numeric_limits<int64_t>::max()}, 0),
          span()),
      "Tensor.strides");
  // Strides above int64.
  expectProtocolError(
      decodeError<at::Tensor>(
          tensorBytes(kFloatCode, {1}, {~uint64_t{0}}, 0, 0), span()),
      "Tensor.strides");
}

TEST(CodecMalformedTest, TooManyDims) {
  std::vector<uint64_t> ones(65, 1);
  expectProtocolError(
      decodeError<at::Tensor>(tensorBytes(kFloatCode, ones, ones, 0, 0),
                              {bytesTensor(4)}),
      "Tensor.dims");
  DecodeLimits small;
  small.maxDims = 2;
  expectProtocolError(decodeError<at::Tensor>(
                          tensorBytes(kFloatCode, {1, 1, 1}, {1, 1, 1}, 0, 0),
                          {bytesTensor(4)}, small),
                      "Tensor.dims");
}

TEST(CodecMalformedTest, TensorIndexOutOfRangeReusedOrUnused) {
  expectProtocolError(
      decodeError<at::Tensor>(tensorBytes(kFloatCode, {1}, {1}, 0, 1),
                              {bytesTensor(4)}),
      "out of range");
  auto twice = tensorBytes(kFloatCode, {1}, {1}, 0, 0);
  auto second = tensorBytes(kFloatCode, {1}, {1}, 0, 0);
  twice.insert(twice.begin(), 2);  // vec count
  twice.insert(twice.end(), second.begin(), second.end());
  expectProtocolError(decodeError<std::vector<at::Tensor>>(
                          twice, {bytesTensor(4), bytesTensor(4)}),
                      "used twice");
  expectProtocolError(
      decodeError<at::Tensor>(tensorBytes(kFloatCode, {1}, {1}, 0, 0),
                              {bytesTensor(4), bytesTensor(4)}),
      "not used");
  // A received span that is not 1-D uint8.
  expectProtocolError(
      decodeError<at::Tensor>(tensorBytes(kFloatCode, {1}, {1}, 0, 0),
                              {at::ones({1}, at::kFloat)}),
      "1-D uint8");
}

TEST(CodecMalformedTest, BadBoolTensorBytesAndRequiresGradOnInts) {
  at::Tensor span = bytesTensor(2);
  span[1] = 2;
  expectProtocolError(
      decodeError<at::Tensor>(tensorBytes(11, {2}, {1}, 0, 0), {span}),
      "Tensor.data");
  expectProtocolError(
      decodeError<at::Tensor>(tensorBytes(4, {1}, {1}, 0, 0, true),
                              {bytesTensor(8)}),
      "requires_grad");
}

TEST(CodecMalformedTest, HugeCountsFailWithoutAllocating) {
  ::trellis::wire::WireWriter w;
  w.putVarint(1000000000);
  w.putRaw(std::string(10, '\0'));
  const auto bytes = w.release();
  expectProtocolError(decodeError<std::vector<int64_t>>(bytes), "vec.count");
  expectProtocolError(decodeError<std::vector<double>>(bytes), "vec.count");
  expectProtocolError(decodeError<std::vector<std::string>>(bytes),
                      "vec.count");
  expectProtocolError(decodeError<std::vector<at::Tensor>>(bytes), "vec.count");
  expectProtocolError(decodeError<std::map<int32_t, std::string>>(bytes),
                      "map.count");
  expectProtocolError(decodeError<std::set<std::string>>(bytes), "set.count");
  expectProtocolError(decodeError<std::string>(bytes), "str");

  // Within the bytes left but above the configured limits.
  DecodeLimits small;
  small.maxElements = 4;
  small.maxStringBytes = 3;
  EXPECT_EQ(decodeError<std::vector<uint8_t>>(
                encode(std::vector<uint8_t>(5)).bytes, {}, small)
                .code(),
            Code::kDataLoss);
  EXPECT_EQ(
      decodeError<std::string>(encode(std::string("four")).bytes, {}, small)
          .code(),
      Code::kDataLoss);
  // A count of zero-byte elements is bounded by maxElements alone.
  EXPECT_EQ(decodeError<std::vector<std::monostate>>(
                encode(std::vector<std::monostate>(5)).bytes, {}, small)
                .code(),
            Code::kDataLoss);
  EXPECT_EQ(roundTrip(std::vector<std::monostate>(5)).size(), 5u);
}

TEST(CodecMalformedTest, BadScalarsDuplicateKeysAndTrailingBytes) {
  expectProtocolError(decodeError<bool>({2}), "bool");
  expectProtocolError(decodeError<int16_t>(encode(int64_t{40000}).bytes),
                      "out of range");
  expectProtocolError(decodeError<uint32_t>(encode(uint64_t{1} << 33).bytes),
                      "exceeds limit");
  expectProtocolError(decodeError<std::optional<int>>({3}), "opt.present");
  ::trellis::wire::WireWriter w;
  w.putVarint(2);
  w.putString("k");
  w.putSignedVarint(1);
  w.putString("k");
  w.putSignedVarint(2);
  expectProtocolError(decodeError<std::map<std::string, int>>(w.bytes()),
                      "duplicate key");
  auto bytes = encode(int32_t{5}).bytes;
  bytes.push_back(0);
  expectProtocolError(decodeError<int32_t>(bytes), "trailing");
}

// Every strict prefix of a valid encoding must fail cleanly.
TEST(CodecMalformedTest, TruncatedAtEveryOffset) {
  using Value =
      std::tuple<std::vector<std::map<std::string, std::optional<at::Tensor>>>,
                 Point, std::array<uint16_t, 3>, double, std::set<int64_t>,
                 std::shared_ptr<std::string>>;
  Value v;
  std::get<0>(v).resize(2);
  std::get<0>(v)[0]["t"] = at::arange(6, at::kFloat).reshape({2, 3}).t();
  std::get<0>(v)[1]["none"] = std::nullopt;
  std::get<1>(v).label = "label";
  std::get<1>(v).tensors = {at::ones({2}, at::kLong)};
  std::get<2>(v) = {1, 2, 3};
  std::get<3>(v) = 2.5;
  std::get<4>(v) = {-1, 1 << 20};
  std::get<5>(v) = std::make_shared<std::string>("sp");
  // Tensors apart, then inline.
  for (bool apart : {true, false}) {
    Encoded enc = encode(v, apart);
    // The transpose is not contiguous: it travels apart either way.
    ASSERT_EQ(enc.spans.size(), apart ? 2u : 1u);
    {
      Decoder d(enc.bytes, deliver(enc.spans));
      decodeValue<Value>(d);
      ASSERT_TRUE(d.finish().ok()) << d.error().what();
    }
    for (size_t n = 0; n < enc.bytes.size(); ++n) {
      std::vector<uint8_t> prefix(enc.bytes.begin(), enc.bytes.begin() + n);
      Error err;
      EXPECT_NO_THROW(err = decodeError<Value>(prefix, deliver(enc.spans)));
      EXPECT_EQ(err.code(), Code::kDataLoss) << "prefix " << n;
    }
  }
  Encoded enc = encode(v);
  // And every truncation of a received span.
  for (size_t i = 0; i < enc.spans.size(); ++i) {
    auto spans = deliver(enc.spans);
    spans[i] = spans[i].slice(0, 0, spans[i].numel() - 1).clone();
    EXPECT_EQ(decodeError<Value>(enc.bytes, spans).code(), Code::kDataLoss);
  }
}

// ---------------------------------------------------------------------------
// Names and fingerprints.

TEST(CodecTest, TypeNamesAreByWireType) {
  EXPECT_EQ(typeName<int64_t>(), "i64");
  EXPECT_EQ(typeName<long long>(), "i64");
  EXPECT_EQ(typeName<unsigned long>(), "u64");
  EXPECT_EQ(typeName<int8_t>(), "i8");
  EXPECT_EQ(typeName<const std::string&>(), "str");
  EXPECT_EQ(typeName<std::vector<float>>(), "vec<f32>");
  EXPECT_EQ((typeName<std::map<std::string, int64_t>>()), "map<str,i64>");
  EXPECT_EQ((typeName<std::unordered_map<std::string, long long>>()),
            "map<str,i64>");
  EXPECT_EQ((typeName<std::array<double, 4>>()), "arr<f64,4>");
  EXPECT_EQ((typeName<std::tuple<bool, std::optional<at::Tensor>>>()),
            "tuple<bool,opt<Tensor>>");
  EXPECT_EQ(typeName<std::shared_ptr<int32_t>>(), "opt<i32>");
  EXPECT_EQ(typeName<Color>(), "enum<u16>");
  EXPECT_EQ(typeName<std::monostate>(), "void");
  EXPECT_EQ(typeName<void>(), "void");
}

TEST(CodecTest, SignatureFingerprints) {
  EXPECT_EQ((signatureString<std::vector<std::string>, int64_t, double>("add")),
            "add(i64,f64)->vec<str>");
  EXPECT_EQ((signatureString<void>("ping")), "ping()->void");
  EXPECT_EQ((signatureFingerprint<int64_t, int64_t, const std::string&>("f")),
            (signatureFingerprint<long long, long long, std::string>("f")));
  EXPECT_NE((signatureFingerprint<int64_t, int64_t>("f")),
            (signatureFingerprint<int64_t, int32_t>("f")));
  EXPECT_NE((signatureFingerprint<int64_t, int64_t>("f")),
            (signatureFingerprint<int64_t, uint64_t>("f")));
  EXPECT_NE((signatureFingerprint<int64_t, int64_t>("f")),
            (signatureFingerprint<int64_t, int64_t>("g")));
  EXPECT_NE((signatureFingerprint<int64_t, int64_t>("f")),
            (signatureFingerprint<double, int64_t>("f")));
  EXPECT_NE((signatureFingerprint<void, int64_t, double>("f")),
            (signatureFingerprint<void, double, int64_t>("f")));
  // FNV-1a 64 reference values.
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cULL);
}

// The receive buffers of small tensors (made without the dispatcher) behave
// as at::empty's: fresh memory each time, usable by ATen ops, in place and
// resized, and decoded into the tensor a message described.
TEST(CodecTest, EmptyBytesIsAPlainFreshByteTensor) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{1000}, size_t{65536}}) {
    at::Tensor a = emptyBytes(n);
    at::Tensor b = emptyBytes(n);
    ASSERT_TRUE(a.defined());
    EXPECT_EQ(a.dim(), 1);
    EXPECT_EQ(a.numel(), static_cast<int64_t>(n));
    EXPECT_EQ(a.scalar_type(), at::kByte);
    EXPECT_TRUE(a.device().is_cpu());
    EXPECT_TRUE(a.is_contiguous());
    EXPECT_FALSE(a.requires_grad());
    if (n == 0) {
      continue;
    }
    EXPECT_NE(a.data_ptr(), b.data_ptr());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data_ptr()) % 64, 0u);
    a.fill_(7);
    b.fill_(9);
    EXPECT_EQ(a.sum().item<int64_t>(), 7 * static_cast<int64_t>(n));
    EXPECT_EQ(b.sum().item<int64_t>(), 9 * static_cast<int64_t>(n));
  }
  at::Tensor grown = emptyBytes(16);
  grown.resize_({4096});
  grown.fill_(1);
  EXPECT_EQ(grown.sum().item<int64_t>(), 4096);

  // What the transport delivers into it decodes as the sent tensor.
  const at::Tensor sent = at::arange(250, at::kFloat).reshape({10, 25});
  Encoder e;
  encodeValue(e, sent);
  std::vector<at::Tensor> rx;
  for (const auto& span : e.tensors()) {
    at::Tensor buf = emptyBytes(static_cast<size_t>(span.numel()));
    std::memcpy(buf.data_ptr(), span.data_ptr(), span.numel());
    rx.push_back(buf);
  }
  Decoder d(e.wire().bytes(), std::move(rx));
  const at::Tensor got = decodeValue<at::Tensor>(d);
  ASSERT_TRUE(d.finish().ok()) << d.error().what();
  EXPECT_TRUE(got.equal(sent));
}

TEST(CodecTest, SerializableTrait) {
  static_assert(kIsSerializable<int64_t>);
  static_assert(kIsSerializable<const std::string&>);
  static_assert(
      kIsSerializable<std::vector<std::map<std::string, at::Tensor>>>);
  static_assert(kIsSerializable<Point>);
  static_assert(kIsSerializable<wire::Envelope>);
  static_assert(!kIsSerializable<codec_test::NotSerializable>);
  static_assert(!kIsSerializable<std::vector<codec_test::NotSerializable>>);
  static_assert(!kIsSerializable<std::optional<codec_test::NotSerializable>>);
  static_assert(!kIsSerializable<char>);
  static_assert(!kIsSerializable<std::string_view>);
  static_assert(!kIsSerializable<int*>);
  SUCCEED();
}

}  // namespace
}  // namespace trellis::rpc
