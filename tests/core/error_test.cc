#include <cerrno>
#include <stdexcept>

#include <gtest/gtest.h>

#include <trellis/core/error.h>

namespace trellis {
namespace {

TEST(ErrorTest, DefaultIsOk) {
  Error e;
  EXPECT_TRUE(e.ok());
  EXPECT_EQ(e.code(), Code::kOk);
  EXPECT_EQ(e.message(), "");
  EXPECT_EQ(e.what(), "OK");
  EXPECT_NO_THROW(throwIfError(e));
}

TEST(ErrorTest, OkCodeWithMessageIsStillOk) {
  Error e(Code::kOk, "ignored");
  EXPECT_TRUE(e.ok());
}

TEST(ErrorTest, WhatNamesCodeMessageAndPlace) {
  Error e = Error::timeout("store get(k) timed out after 30s");
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.code(), Code::kDeadlineExceeded);
  EXPECT_NE(
      e.what().find("DEADLINE_EXCEEDED: store get(k) timed out after 30s"),
      std::string::npos);
  EXPECT_NE(e.where().find("error_test.cc:"), std::string::npos) << e.where();
}

TEST(ErrorTest, WithContextKeepsCodeAndPrefixesMessage) {
  Error e = Error::connection("peer closed").withContext("pipe7");
  EXPECT_EQ(e.code(), Code::kUnavailable);
  EXPECT_EQ(e.message(), "pipe7: peer closed");
  EXPECT_TRUE(Error().withContext("x").ok());
}

template <typename Ex>
void expectThrows(const Error& e) {
  try {
    throwIfError(e);
    FAIL() << "nothing thrown for " << e.what();
  } catch (const Ex& ex) {
    EXPECT_EQ(ex.error(), e);
    EXPECT_EQ(std::string(ex.what()), e.what());
  } catch (const std::exception& ex) {
    FAIL() << "wrong exception type for " << e.what() << ": " << ex.what();
  }
}

TEST(ErrorTest, EachCodeMapsToOneExceptionType) {
  expectThrows<TimeoutError>(Error::timeout("t"));
  expectThrows<ConnectionError>(Error::connection("c"));
  expectThrows<ProtocolError>(Error::protocol("p"));
  expectThrows<AuthError>(Error::auth("a"));
  expectThrows<AuthError>(Error(Code::kPermissionDenied, "a"));
  expectThrows<InvalidArgumentError>(Error::invalidArgument("i"));
  expectThrows<InvalidArgumentError>(Error(Code::kOutOfRange, "i"));
  expectThrows<NotFoundError>(Error::notFound("n"));
  expectThrows<AlreadyExistsError>(Error(Code::kAlreadyExists, "x"));
  expectThrows<CancelledError>(Error::cancelled("c"));
  expectThrows<ResourceExhaustedError>(Error(Code::kResourceExhausted, "r"));
  expectThrows<FailedPreconditionError>(Error(Code::kFailedPrecondition, "f"));
  expectThrows<FailedPreconditionError>(Error(Code::kAborted, "f"));
  expectThrows<UnimplementedError>(Error(Code::kUnimplemented, "u"));
  expectThrows<InternalError>(Error::internal("i"));
  expectThrows<InternalError>(Error(Code::kUnknown, "u"));
}

TEST(ErrorTest, RemoteErrorCarriesOrigin) {
  Error e = Error::remote({"ps", "lookup", "std::out_of_range"},
                          "row 7 out of range");
  try {
    throwIfError(e);
    FAIL();
  } catch (const RemoteError& ex) {
    EXPECT_EQ(ex.origin().worker, "ps");
    EXPECT_EQ(ex.origin().function, "lookup");
    const std::string what = ex.what();
    EXPECT_NE(what.find("on worker 'ps' in lookup (std::out_of_range): row 7"),
              std::string::npos)
        << what;
  }
}

TEST(ErrorTest, ErrnoMapping) {
  EXPECT_EQ(Error::fromErrno(ECONNRESET, "read").code(), Code::kUnavailable);
  EXPECT_EQ(Error::fromErrno(EPIPE, "write").code(), Code::kUnavailable);
  EXPECT_EQ(Error::fromErrno(ETIMEDOUT, "connect").code(),
            Code::kDeadlineExceeded);
  EXPECT_EQ(Error::fromErrno(ENOMEM, "mmap").code(), Code::kResourceExhausted);
  EXPECT_EQ(Error::fromErrno(EADDRINUSE, "bind").code(), Code::kAlreadyExists);
  EXPECT_EQ(Error::fromErrno(ENOENT, "open").code(), Code::kNotFound);
  const Error e = Error::fromErrno(ECONNREFUSED, "connect 127.0.0.1:1");
  EXPECT_NE(e.message().find("connect 127.0.0.1:1: Connection refused"),
            std::string::npos)
      << e.message();
}

TEST(ErrorTest, FromCurrentException) {
  try {
    throw std::out_of_range("idx 9");
  } catch (...) {
    Error e = errorFromCurrentException();
    EXPECT_EQ(e.code(), Code::kUnknown);
    EXPECT_EQ(e.message(), "std::out_of_range: idx 9");
  }
  try {
    throw TimeoutError(Error::timeout("late"));
  } catch (...) {
    EXPECT_EQ(errorFromCurrentException().code(), Code::kDeadlineExceeded);
  }
  try {
    throw 42;
  } catch (...) {
    EXPECT_EQ(errorFromCurrentException().code(), Code::kUnknown);
  }
}

TEST(ErrorTest, CodeNames) {
  EXPECT_EQ(codeName(Code::kUnauthenticated), "UNAUTHENTICATED");
  EXPECT_EQ(codeName(Code::kDataLoss), "DATA_LOSS");
  EXPECT_EQ(static_cast<int>(Code::kUnauthenticated), 16);  // gRPC's number
}

}  // namespace
}  // namespace trellis
