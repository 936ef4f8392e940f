#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <trellis/core/text.h>
#include <trellis/elastic/errors.h>

namespace trellis::elastic {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class ErrorFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("trellis_elastic_errors_" + std::to_string(::getpid()));
    trellis::removeTree(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    trellis::removeTree(dir_);
    ::unsetenv(kErrorFileEnvVar);
  }
  std::string path(const std::string& name) const { return dir_ / name; }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path(name), std::ios::binary) << text;
  }
  fs::path dir_;
};

TEST_F(ErrorFiles, WriteReadRoundTrip) {
  ErrorRecord r;
  r.message = "std::runtime_error: boom \"quoted\"\n";
  r.callstack = "frame 1\nframe 2";
  r.timestamp = 1700000000;
  r.exceptionType = "std::runtime_error";
  r.rank = 3;
  r.errorCode = -9;
  const std::string p = path("a/b/error.json");  // folders are made
  ASSERT_TRUE(writeErrorFile(p, r).ok());
  ErrorRecord back;
  const Error e = readErrorFile(p, &back);
  ASSERT_TRUE(e.ok()) << e.what();
  EXPECT_EQ(back, r);
  EXPECT_FALSE(fs::exists(p + ".tmp." + std::to_string(::getpid())));
}

TEST_F(ErrorFiles, TorchrunsFormat) {
  // What torch.distributed.elastic's handler writes.
  const std::string torch =
      R"({"message": {"message": "ValueError: bad lr", "extraInfo": )"
      R"({"py_callstack": "Traceback ...", "timestamp": "1700000001"}}})";
  ErrorRecord r;
  ASSERT_TRUE(parseErrorFile(torch, &r).ok());
  EXPECT_EQ(r.message, "ValueError: bad lr");
  EXPECT_EQ(r.callstack, "Traceback ...");
  EXPECT_EQ(r.timestamp, 1700000001);
  EXPECT_FALSE(r.errorCode);
  EXPECT_FALSE(r.rank);
  // The plain-string message and an agent's errorCode.
  ASSERT_TRUE(parseErrorFile(R"({"message": "plain"})", &r).ok());
  EXPECT_EQ(r.message, "plain");
  ASSERT_TRUE(
      parseErrorFile(R"({"message": {"message": "m", "errorCode": 139}})", &r)
          .ok());
  EXPECT_EQ(r.errorCode, 139);
  // What we write has torchrun's keys and types.
  const std::string ours = encodeErrorFile(r);
  EXPECT_THAT(ours, HasSubstr(R"("extraInfo":{)"));
  EXPECT_THAT(ours, HasSubstr(R"("py_callstack":"")"));
  EXPECT_THAT(ours, HasSubstr(R"("timestamp":"0")"));
}

// A message or stack too big for the reader's bound is cut so the file
// still reads, its head kept; control bytes, escaped six to one in JSON,
// count as what they become.
TEST_F(ErrorFiles, AMessageTooBigForTheReaderIsCutAndStillReads) {
  for (char fill : {'x', '\x01'}) {
    ErrorRecord r;
    r.message = "std::runtime_error: bad batch " +
                std::string(3 * kMaxErrorFileBytes, fill);
    r.callstack = std::string(kMaxErrorFileBytes / 2, 's');
    r.exceptionType = std::string(5000, 'T');
    r.rank = 3;
    const std::string text = encodeErrorFile(r);
    EXPECT_LE(text.size(), kMaxErrorFileBytes);
    ErrorRecord back;
    const Error e = parseErrorFile(text, &back);
    ASSERT_TRUE(e.ok()) << e.what();
    EXPECT_EQ(back.message.rfind("std::runtime_error: bad batch ", 0), 0u);
    EXPECT_THAT(back.message, HasSubstr("[" + std::to_string(r.message.size()) +
                                        " bytes, the rest cut]"));
    EXPECT_EQ(back.exceptionType.size(), 1024u);
    EXPECT_EQ(back.rank, 3);
  }
  // Within the bound nothing is cut.
  ErrorRecord small;
  small.message = std::string(kMaxErrorFileBytes / 4, 'm');
  ErrorRecord back;
  ASSERT_TRUE(parseErrorFile(encodeErrorFile(small), &back).ok());
  EXPECT_EQ(back.message, small.message);
}

TEST_F(ErrorFiles, RecordCurrentExceptionUsesTheVariable) {
  const std::string p = path("rank0/error.json");
  ::setenv(kErrorFileEnvVar, p.c_str(), 1);
  ::setenv("RANK", "5", 1);
  const int64_t before = std::time(nullptr);
  try {
    throw std::out_of_range("index 7");
  } catch (...) {
    ASSERT_TRUE(recordCurrentException().ok());
  }
  ::unsetenv("RANK");
  ErrorRecord r;
  ASSERT_TRUE(readErrorFile(p, &r).ok());
  EXPECT_EQ(r.message, "std::out_of_range: index 7");
  EXPECT_EQ(r.exceptionType, "std::out_of_range");
  EXPECT_EQ(r.rank, 5);
  EXPECT_GE(r.timestamp, before);
  EXPECT_THAT(r.callstack, HasSubstr("C++ exception"));
}

TEST_F(ErrorFiles, RecordWithoutAPathDoesNothing) {
  ::unsetenv(kErrorFileEnvVar);
  try {
    throw 42;
  } catch (...) {
    EXPECT_TRUE(recordCurrentException().ok());
  }
}

TEST_F(ErrorFiles, RecordNonStdException) {
  const std::string p = path("e.json");
  try {
    throw 42;
  } catch (...) {
    ASSERT_TRUE(recordCurrentException(p).ok());
  }
  ErrorRecord r;
  ASSERT_TRUE(readErrorFile(p, &r).ok());
  EXPECT_EQ(r.exceptionType, "int");
}

TEST_F(ErrorFiles, RunAndRecordErrors) {
  const std::string p = path("run/error.json");
  ::setenv(kErrorFileEnvVar, p.c_str(), 1);
  EXPECT_EQ(runAndRecordErrors([] { return 7; }), 7);
  EXPECT_FALSE(fs::exists(p));
  EXPECT_EQ(runAndRecordErrors(
                []() -> int { throw std::invalid_argument("bad flag"); }),
            1);
  ErrorRecord r;
  ASSERT_TRUE(readErrorFile(p, &r).ok());
  EXPECT_EQ(r.message, "std::invalid_argument: bad flag");
}

TEST_F(ErrorFiles, InvalidUtf8IsReplacedNotThrown) {
  ErrorRecord r;
  r.message = std::string("bad \xff\xfe bytes");
  const std::string p = path("utf.json");
  ASSERT_TRUE(writeErrorFile(p, r).ok());
  ErrorRecord back;
  ASSERT_TRUE(readErrorFile(p, &back).ok());
  EXPECT_THAT(back.message, HasSubstr("bad "));
}

TEST_F(ErrorFiles, MalformedInputsGiveClearErrors) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "not JSON"},
      {"{", "not JSON"},
      {"[]", "not a JSON object"},
      {"{}", "no \"message\""},
      {R"({"message": 3})", "neither a string nor an object"},
      {R"({"message": {}})", "message.message"},
      {R"({"message": {"message": 1}})", "message.message"},
      {R"({"message": {"message": "m", "extraInfo": 1}})", "extraInfo"},
      {R"({"message": {"message": "m", "extraInfo": {"timestamp": "x"}}})",
       "timestamp"},
      {R"({"message": {"message": "m", "extraInfo": {"timestamp": 1e400}}})",
       "not JSON"},
      {R"({"message": {"message": "m", "extraInfo": {"py_callstack": []}}})",
       "py_callstack"},
      {R"({"message": {"message": "m", "errorCode": 99999999999}})",
       "errorCode"},
      {R"({"message": {"message": "m", "extraInfo": {"rank": "-x"}}})", "rank"},
      {std::string(100000, '['), "nested deeper"},
      {std::string(kMaxErrorFileBytes + 1, ' '), "larger than"},
  };
  for (const auto& [text, why] : cases) {
    SCOPED_TRACE(text.substr(0, 80));
    ErrorRecord r;
    const Error e = parseErrorFile(text, &r);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.code(), Code::kDataLoss);
    EXPECT_THAT(e.message(), HasSubstr("malformed error file"));
    EXPECT_THAT(e.message(), HasSubstr(why));
  }
}

TEST_F(ErrorFiles, ReadErrorsNameThePath) {
  ErrorRecord r;
  Error e = readErrorFile(path("missing.json"), &r);
  EXPECT_EQ(e.code(), Code::kNotFound);
  EXPECT_THAT(e.message(), HasSubstr("missing.json"));

  write("junk.json", "not json at all");
  e = readErrorFile(path("junk.json"), &r);
  EXPECT_EQ(e.code(), Code::kDataLoss);
  EXPECT_THAT(e.message(), HasSubstr("junk.json"));

  write("big.json", std::string(kMaxErrorFileBytes + 10, ' '));
  e = readErrorFile(path("big.json"), &r);
  EXPECT_THAT(e.message(), HasSubstr("larger than"));

  e = readErrorFile(dir_.string(), &r);  // a folder
  EXPECT_FALSE(e.ok());
  EXPECT_THAT(e.message(), HasSubstr(dir_.string()));

  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  e = readErrorFile(path("fifo"), &r);  // must not block
  EXPECT_THAT(e.message(), HasSubstr("not a regular file"));
}

TEST_F(ErrorFiles, WriteFailureIsAnErrorNotAThrow) {
  write("file", "x");
  ErrorRecord r;
  const Error e = writeErrorFile(path("file/below/error.json"), r);
  EXPECT_FALSE(e.ok());
}

}  // namespace
}  // namespace trellis::elastic
