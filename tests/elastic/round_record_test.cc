// The round record's codec (elastic/round_record.h) against malformed
// text: truncated records, counts past the limits, numbers that overflow,
// another format version, oversized text, contradictions. Every refusal is
// a ProtocolError that names the store key and leaves the output alone.

#include <string>

#include <gtest/gtest.h>

#include <trellis/core/error.h>
#include <trellis/elastic/round_record.h>

namespace {

namespace e = trellis::elastic;

e::RoundRecord sample() {
  e::RoundRecord r;
  r.runId = "job7";
  r.nproc = 4;
  r.round = 12;
  r.phase = e::RoundPhase::kClosed;
  r.restarts = 3;
  r.participants = {{"h1:10:ab", "10.0.0.1"}, {"h2:11:cd", "::1"}};
  r.waiting = {"h3:12:ef"};
  r.note = "node x stopped heartbeating";
  return r;
}

const std::string kHead =
    "trellis-rdzv-round 1\nrun a\nnproc 1\nround 0\nphase joining\n"
    "restarts 0\nnote x\n";

// Decodes `text`, expecting a refusal; returns its message.
std::string refusal(const std::string& text) {
  e::RoundRecord out;
  out.runId = "untouched";
  const trellis::Error err = e::decodeRoundRecord(text, &out);
  EXPECT_FALSE(err.ok()) << text.substr(0, 200);
  EXPECT_EQ(err.code(), trellis::Code::kDataLoss) << err.message();
  EXPECT_NE(err.message().find(std::string("'") + e::kRoundKey + "'"),
            std::string::npos)
      << err.message();
  EXPECT_EQ(out.runId, "untouched");
  return err.message();
}

TEST(RoundRecord, EveryTruncationIsRefusedOrIsAWholeShorterRecord) {
  const std::string full = e::encodeRoundRecord(sample());
  for (size_t n = 0; n < full.size(); ++n) {
    const std::string cut = full.substr(0, n);
    e::RoundRecord out;
    const trellis::Error err = e::decodeRoundRecord(cut, &out);
    if (err.ok()) {
      // Only a cut at a line end can decode (the note is last, so not even
      // that here).
      ADD_FAILURE() << "a record cut at " << n << " bytes decoded";
      continue;
    }
    EXPECT_NE(err.message().find(e::kRoundKey), std::string::npos);
    if (n > 0 && cut.back() != '\n') {
      EXPECT_NE(err.message().find("does not end with a newline"),
                std::string::npos)
          << err.message();
    }
  }
}

TEST(RoundRecord, NodeCountsStopAtTheLimit) {
  std::string text = kHead;
  for (size_t i = 0; i < e::kMaxRecordNodes; ++i) {
    text += "node n" + std::to_string(i) + " 10.0.0.1\n";
  }
  e::RoundRecord out;
  ASSERT_TRUE(e::decodeRoundRecord(text, &out).ok());
  EXPECT_EQ(out.participants.size(), e::kMaxRecordNodes);
  EXPECT_NE(
      refusal(text + "node one-more 10.0.0.1\n")
          .find("more than " + std::to_string(e::kMaxRecordNodes) + " nodes"),
      std::string::npos);

  std::string waiting = kHead;
  for (size_t i = 0; i <= e::kMaxRecordNodes; ++i) {
    waiting += "waiting w" + std::to_string(i) + "\n";
  }
  EXPECT_NE(refusal(waiting).find("waiting nodes"), std::string::npos);
}

TEST(RoundRecord, NumbersOutOfRangeOrOverflowingAreRefused) {
  for (const char* line :
       {"nproc 99999999999999999999999", "nproc 1048577", "nproc -1",
        "round 9223372036854775808", "round 4611686018427387905",
        "restarts 1073741825", "restarts 0x10", "nproc 1 ", "round +1"}) {
    std::string text = kHead;
    const std::string field =
        std::string(line).substr(0, std::string(line).find(' '));
    const size_t at = text.find("\n" + field + " ") + 1;
    text.replace(at, text.find('\n', at) - at, line);
    EXPECT_NE(refusal(text).find("line"), std::string::npos) << line;
  }
}

TEST(RoundRecord, AnotherFormatVersionIsNamed) {
  std::string v2 = kHead;
  v2.replace(0, std::string("trellis-rdzv-round 1").size(),
             "trellis-rdzv-round 2");
  const std::string msg = refusal(v2);
  EXPECT_NE(msg.find("format version 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("reads version 1"), std::string::npos) << msg;

  EXPECT_NE(refusal("{\"round\": 1}\n").find("not a round record"),
            std::string::npos);
  EXPECT_NE(refusal("trellis-rdzv-round x\n").find("not a round record"),
            std::string::npos);
}

TEST(RoundRecord, OversizedTextIsRefusedBeforeItIsRead) {
  const std::string big(e::kMaxRecordBytes + 1, 'x');
  const std::string msg = refusal(big);
  EXPECT_NE(msg.find("at most " + std::to_string(e::kMaxRecordBytes)),
            std::string::npos)
      << msg;
}

TEST(RoundRecord, MissingRepeatedAndContradictoryFieldsAreNamed) {
  std::string noNote = kHead;
  noNote.erase(noNote.find("note x\n"));
  EXPECT_NE(refusal(noNote).find("'note' line is missing"), std::string::npos);
  EXPECT_NE(refusal(kHead + "run b\n").find("line 8"), std::string::npos);
  EXPECT_NE(refusal(kHead + "node a 1\nwaiting a\n")
                .find("both a participant and waiting"),
            std::string::npos);
  EXPECT_NE(refusal(kHead + "waiting a\nwaiting a\n").find("repeated"),
            std::string::npos);
  EXPECT_NE(refusal(kHead + "node a\n").find("an id and an address"),
            std::string::npos);
  EXPECT_NE(refusal(kHead + "note\x01\n").find("line 8"), std::string::npos);
  EXPECT_NE(refusal(kHead + "node a 1\x7f\n").find("line 8"),
            std::string::npos);
  EXPECT_NE(refusal(kHead + "\n").find("line 8 has no value"),
            std::string::npos);
  // CR LF line ends are not the format.
  std::string crlf = kHead;
  crlf.replace(crlf.find("\nrun"), 1, "\r\n");
  (void)refusal(crlf);
}

TEST(RoundRecord, EncodeRefusesWhatTheDecoderWouldAndCleansTheNote) {
  e::RoundRecord r = sample();
  r.note = std::string(2 * e::kMaxRecordField, 'n') + "\n";
  r.note[3] = '\t';
  e::RoundRecord back;
  ASSERT_TRUE(e::decodeRoundRecord(e::encodeRoundRecord(r), &back).ok());
  EXPECT_EQ(back.note.size(), e::kMaxRecordField);
  EXPECT_EQ(back.note[3], '?');

  r = sample();
  r.waiting = {std::string(e::kMaxRecordField + 1, 'w')};
  EXPECT_THROW((void)e::encodeRoundRecord(r), trellis::InvalidArgumentError);
  r = sample();
  r.runId = "";
  EXPECT_THROW((void)e::encodeRoundRecord(r), trellis::InvalidArgumentError);
}

}  // namespace
