// The cpu backend's message descriptor: round trips and the errors a
// malformed one gets.
#include <gtest/gtest.h>

#include <trellis/collectives/cpu/message.h>

namespace trellis::collectives::detail {
namespace {

Header roundTrip(const Header& h) {
  Header out;
  const Error e = decode(encode(h), &out);
  EXPECT_TRUE(e.ok()) << e.what();
  return out;
}

TEST(CollectiveMessage, EveryKindRoundTrips) {
  Header hello;
  hello.kind = Header::Kind::kHello;
  hello.rank = 3;
  hello.worldSize = 8;
  hello.groupId = "default#2";
  Header h = roundTrip(hello);
  EXPECT_EQ(h.rank, 3);
  EXPECT_EQ(h.worldSize, 8);
  EXPECT_EQ(h.groupId, "default#2");

  Header data;
  data.kind = Header::Kind::kCollective;
  data.fp = {1ull << 40, OpType::kReduce, DType::kBFloat16, ReduceOp::kMax,
             5,          123456789};
  data.step = 17;
  data.bytes = 246913578;
  h = roundTrip(data);
  EXPECT_EQ(h.fp, data.fp);
  EXPECT_EQ(h.step, 17u);
  EXPECT_EQ(h.bytes, data.bytes);

  Header p2p;
  p2p.kind = Header::Kind::kP2P;
  p2p.tag = -7;
  p2p.fp.dtype = DType::kInt64;
  p2p.bytes = 64;
  h = roundTrip(p2p);
  EXPECT_EQ(h.tag, -7);
  EXPECT_EQ(h.fp.dtype, DType::kInt64);

  Header abort;
  abort.kind = Header::Kind::kAbort;
  abort.rank = 1;
  abort.code = Code::kDeadlineExceeded;
  abort.reason = "timed out";
  h = roundTrip(abort);
  EXPECT_EQ(h.code, Code::kDeadlineExceeded);
  EXPECT_EQ(h.reason, "timed out");
}

TEST(CollectiveMessage, FingerprintReadsLikeTheCall) {
  Fingerprint fp{
      42, OpType::kAllreduce, DType::kFloat32, ReduceOp::kSum, -1, 1048576};
  EXPECT_EQ(fp.toString(), "seq 42 allreduce(float32[1048576], sum)");
  fp = {7, OpType::kBroadcast, DType::kInt64, ReduceOp::kSum, 2, 3};
  EXPECT_EQ(fp.toString(), "seq 7 broadcast(int64[3], root 2)");
  fp = {8, OpType::kBarrier, DType::kUInt8, ReduceOp::kSum, -1, 0};
  EXPECT_EQ(fp.toString(), "seq 8 barrier()");
}

Error decodeBytes(std::string bytes) {
  Header h;
  return decode(bytes, &h);
}

TEST(CollectiveMessage, MalformedInputIsAProtocolErrorNamingTheField) {
  Header data;
  data.kind = Header::Kind::kCollective;
  data.fp = {1, OpType::kAllreduce, DType::kFloat32, ReduceOp::kSum, -1, 4};
  const std::string good = encode(data);
  struct Case {
    std::string bytes;
    std::string needle;
  };
  std::string badVersion = good;
  badVersion[0] = 9;
  std::string badKind = good;
  badKind[1] = 77;
  std::string badOp = good;
  badOp[3] = 99;  // version, kind, seq (1 byte), op
  std::string badDtype = good;
  badDtype[4] = 42;
  std::string badReduce = good;
  badReduce[5] = 8;
  const Case cases[] = {
      {"", "version"},
      {badVersion, "version 9"},
      {badKind, "unknown kind 77"},
      {badOp, "unknown op 99"},
      {badDtype, "unknown dtype 42"},
      {badReduce, "unknown reduce op 8"},
      {good.substr(0, good.size() - 1), "truncated"},
      {good + "x", ""},
  };
  for (const auto& c : cases) {
    const Error e = decodeBytes(c.bytes);
    EXPECT_EQ(e.code(), Code::kDataLoss) << c.needle;
    EXPECT_NE(e.message().find(c.needle), std::string::npos) << e.message();
  }
  Header abort;
  abort.kind = Header::Kind::kAbort;
  abort.code = Code::kAborted;
  std::string okCode = encode(abort);
  std::string zero = okCode;
  zero[3] = 0;  // version, kind, rank, code
  EXPECT_EQ(decodeBytes(zero).code(), Code::kDataLoss);
}

}  // namespace
}  // namespace trellis::collectives::detail
