#include <limits>
#include <random>

#include <gtest/gtest.h>

#include <trellis/core/wire.h>

namespace trellis::wire {
namespace {

std::vector<uint8_t> bytesOf(std::initializer_list<int> v) {
  std::vector<uint8_t> out;
  for (int b : v) {
    out.push_back(static_cast<uint8_t>(b));
  }
  return out;
}

TEST(WireTest, RoundTripsEveryType) {
  WireWriter w;
  w.putU8(0xab);
  w.putBool(true);
  w.putFixed32(0xdeadbeef);
  w.putFixed64(0x0123456789abcdefULL);
  w.putVarint(0);
  w.putVarint(300);
  w.putVarint(std::numeric_limits<uint64_t>::max());
  w.putSignedVarint(-1);
  w.putSignedVarint(std::numeric_limits<int64_t>::min());
  w.putSignedVarint(std::numeric_limits<int64_t>::max());
  w.putString("key/with/slashes");
  w.putString("");
  const size_t mark = w.beginNested();
  w.putVarint(5);
  w.putString("inner");
  w.endNested(mark);
  w.putBytes(bytesOf({1, 2, 3}));

  WireReader r(w.bytes(), "test message");
  EXPECT_EQ(r.u8(), 0xab);
  EXPECT_TRUE(r.boolean());
  EXPECT_EQ(r.fixed32(), 0xdeadbeefu);
  EXPECT_EQ(r.fixed64(), 0x0123456789abcdefULL);
  EXPECT_EQ(r.varint(), 0u);
  EXPECT_EQ(r.varint(), 300u);
  EXPECT_EQ(r.varint(), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(r.signedVarint(), -1);
  EXPECT_EQ(r.signedVarint(), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(r.signedVarint(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(r.string(64, "key"), "key/with/slashes");
  EXPECT_EQ(r.string(64, "empty"), "");
  {
    WireReader n = r.nested(100, "section");
    EXPECT_EQ(n.varint(), 5u);
    EXPECT_EQ(n.string(10, "name"), "inner");
    n.expectEnd();
    EXPECT_TRUE(n.ok()) << n.error().what();
  }
  auto b = r.bytes(3, "payload");
  EXPECT_EQ(std::vector<uint8_t>(b.begin(), b.end()), bytesOf({1, 2, 3}));
  r.expectEnd();
  EXPECT_TRUE(r.ok()) << r.error().what();
}

TEST(WireTest, VarintEncodingIsLeb128) {
  WireWriter w;
  w.putVarint(300);
  EXPECT_EQ(w.bytes(), bytesOf({0xac, 0x02}));
}

TEST(WireTest, TruncatedFixedFailsWithOffset) {
  auto buf = bytesOf({1, 2, 3});
  WireReader r(buf, "store request");
  EXPECT_EQ(r.u8(), 1);
  EXPECT_EQ(r.fixed32("length"), 0u);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), Code::kDataLoss);
  EXPECT_EQ(r.error().message(),
            "store request: offset 1: field 'length': truncated: need 4 bytes, "
            "2 left");
}

TEST(WireTest, ErrorIsStickyAndLaterReadsReturnZero) {
  auto buf = bytesOf({0x80});  // varint with continuation bit and no more bytes
  WireReader r(buf);
  EXPECT_EQ(r.varint("a"), 0u);
  const Error first = r.error();
  EXPECT_NE(first.message().find("truncated varint"), std::string::npos);
  EXPECT_EQ(r.u8("b"), 0);
  EXPECT_EQ(r.string(10, "c"), "");
  EXPECT_EQ(r.remaining(), 0u);
  EXPECT_EQ(r.error(), first);
}

TEST(WireTest, OverlongAndOverflowingVarints) {
  std::vector<uint8_t> eleven(11, 0x80);
  WireReader a(eleven);
  a.varint("v");
  EXPECT_NE(a.error().message().find("overflows 64 bits"), std::string::npos)
      << a.error().message();

  auto overflow =
      bytesOf({0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02});
  WireReader b(overflow);
  b.varint("v");
  EXPECT_NE(b.error().message().find("overflows 64 bits"), std::string::npos);
}

TEST(WireTest, LengthOverLimitFailsBeforeReading) {
  WireWriter w;
  w.putVarint(1u << 30);  // claims 1 GiB follows
  WireReader r(w.bytes(), "frame");
  EXPECT_TRUE(r.bytes(4096, "value").empty());
  EXPECT_EQ(
      r.error().message(),
      "frame: offset 5: field 'value': length 1073741824 exceeds limit 4096");
}

TEST(WireTest, LengthOverRemainingFails) {
  WireWriter w;
  w.putString("abcdef");
  auto buf = w.release();
  buf.resize(4);
  WireReader r(buf);
  EXPECT_EQ(r.string(100, "name"), "");
  EXPECT_NE(r.error().message().find("truncated: need 6 bytes, 3 left"),
            std::string::npos);
}

TEST(WireTest, BoundedVarint) {
  WireWriter w;
  w.putVarint(17);
  WireReader r(w.bytes());
  EXPECT_EQ(r.varint(16, "count"), 0u);
  EXPECT_NE(r.error().message().find("'count': value 17 exceeds limit 16"),
            std::string::npos);
}

TEST(WireTest, BadBoolean) {
  auto buf = bytesOf({2});
  WireReader r(buf);
  r.boolean("flag");
  EXPECT_FALSE(r.ok());
}

TEST(WireTest, NestedFailurePropagatesToParentWithAbsoluteOffset) {
  WireWriter w;
  w.putU8(9);
  const size_t mark = w.beginNested();
  w.putU8(1);
  w.endNested(mark);
  WireReader r(w.bytes(), "msg");
  r.u8();
  {
    WireReader n = r.nested(10, "inner");
    n.u8();
    n.fixed32("x");  // past the section's end, though not past the buffer's
    EXPECT_FALSE(n.ok());
  }
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().message(),
            "msg: offset 6: field 'x': truncated: need 4 bytes, 0 left");
}

TEST(WireTest, NestedLengthOverLimit) {
  WireWriter w;
  w.putFixed32(1000);
  WireReader r(w.bytes());
  WireReader n = r.nested(10, "body");
  EXPECT_FALSE(n.ok());
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("nested length 1000 exceeds limit 10"),
            std::string::npos);
}

TEST(WireTest, TrailingBytes) {
  auto buf = bytesOf({1, 2});
  WireReader r(buf);
  r.u8();
  r.expectEnd();
  EXPECT_NE(r.error().message().find("1 unexpected trailing bytes"),
            std::string::npos);
}

TEST(WireTest, RandomGarbageNeverReadsOutOfBounds) {
  // Sanitizer builds turn any out-of-bounds access here into a failure.
  std::mt19937 rng(1234);
  for (int i = 0; i < 2000; ++i) {
    std::vector<uint8_t> buf(rng() % 40);
    for (auto& b : buf) {
      b = static_cast<uint8_t>(rng());
    }
    WireReader r(buf);
    while (r.ok() && r.remaining() > 0) {
      switch (rng() % 6) {
        case 0:
          r.varint();
          break;
        case 1:
          r.fixed32();
          break;
        case 2:
          r.string(16, "s");
          break;
        case 3:
          r.bytes(1 << 20, "b");
          break;
        case 4:
          r.nested(64, "n").varint();
          break;
        default:
          r.signedVarint();
          break;
      }
    }
  }
}

}  // namespace
}  // namespace trellis::wire
