#include <string>

#include <gtest/gtest.h>

#include <trellis/core/seal.h>

namespace trellis::seal {
namespace {

constexpr char kMagic[] = "TRLSTEST";

std::string sealOf(uint64_t tag, const std::string& payload) {
  return header(kMagic, tag, payload) + payload;
}

TEST(Seal, OpensWhatItSealed) {
  for (const std::string& payload :
       {std::string(), std::string("x"), std::string(100000, '\x7f')}) {
    const std::string blob = sealOf(1234567890123, payload);
    ASSERT_EQ(blob.size(), kHeaderBytes + payload.size());
    Opened opened;
    EXPECT_EQ(open(kMagic, blob, &opened), "");
    EXPECT_EQ(opened.tag, 1234567890123u);
    EXPECT_EQ(opened.payload, payload);
    EXPECT_EQ(opened.payload.data(), blob.data() + kHeaderBytes);
  }
}

// Each way a file goes bad is named; nothing is filled in.
TEST(Seal, NamesEachDamage) {
  const std::string blob = sealOf(7, "the payload");
  const auto why = [](const std::string& bytes) {
    Opened opened;
    const std::string w = open(kMagic, bytes, &opened);
    EXPECT_EQ(opened.tag, 0u);
    EXPECT_TRUE(opened.payload.empty());
    return w;
  };
  EXPECT_EQ(why(blob.substr(0, 20)),
            "is shorter (20 bytes) than its header (56)");
  EXPECT_EQ(why("TRLSOTHR" + blob.substr(8)), "has another kind's magic");
  EXPECT_EQ(why(blob.substr(0, blob.size() - 3)),
            "is torn: its header announces 11 bytes of payload, it holds 8");
  EXPECT_EQ(why(blob + "more"),
            "is torn: its header announces 11 bytes of payload, it holds 15");
  for (size_t at : {size_t{24}, size_t{55}, blob.size() - 1}) {
    std::string bad = blob;
    bad[at] ^= 0x01;
    EXPECT_EQ(why(bad), "is corrupted: its SHA-256 does not match its payload")
        << "byte " << at;
  }
}

}  // namespace
}  // namespace trellis::seal
