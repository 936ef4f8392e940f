#pragma once

// Trellis error model (docs/errors.md).
//
// Async paths pass an `Error` value: the first argument of every callback,
// carried by every failed Future. A default-constructed Error means success.
// Synchronous user-facing calls throw a typed exception derived from
// `trellis::Exception`; each status code maps to exactly one exception type
// (see `throwIfError`).
//
// Thread safety: Error is an immutable value type; copies are independent.

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace trellis {

// gRPC's canonical status codes, same numbers, so that RPC and elastic layers
// can map them one-to-one.
enum class Code : uint8_t {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

// Where an Error was created. std::source_location would do, but clang 14
// (the fuzzing compiler on Debian 12) lacks it; these builtins work in both.
struct SourceLocation {
  static constexpr SourceLocation current(const char* file = __builtin_FILE(),
                                          uint32_t line = __builtin_LINE()) {
    return SourceLocation{file, line};
  }
  const char* file = "";
  uint32_t line = 0;
};

// "DEADLINE_EXCEEDED" etc.; "CODE(<n>)" for a number outside the enum.
std::string_view codeName(Code code);

// What a failure raised by a remote worker carries besides its message.
struct RemoteOrigin {
  std::string worker;         // name of the worker that raised it
  std::string function;       // the function or method it was running
  std::string exceptionType;  // e.g. "std::out_of_range"
};

// [[nodiscard]], as absl::Status: every function returning an Error
// (OK or not) warns when the caller drops it. Where dropping is meant,
// say so: `(void)f();  // why`.
class [[nodiscard]] Error {
 public:
  Error() = default;  // success
  Error(Code code, std::string message,
        SourceLocation where = SourceLocation::current());

  // Named constructors, one per exception type.
  static Error timeout(std::string message,
                       SourceLocation w = SourceLocation::current());
  static Error connection(std::string message,
                          SourceLocation w = SourceLocation::current());
  static Error protocol(std::string message,
                        SourceLocation w = SourceLocation::current());
  static Error auth(std::string message,
                    SourceLocation w = SourceLocation::current());
  static Error invalidArgument(std::string message,
                               SourceLocation w = SourceLocation::current());
  static Error cancelled(std::string message,
                         SourceLocation w = SourceLocation::current());
  static Error notFound(std::string message,
                        SourceLocation w = SourceLocation::current());
  static Error internal(std::string message,
                        SourceLocation w = SourceLocation::current());
  // A failure another worker raised; `code` is the one it was raised with
  // (kUnknown for an exception that is not a trellis::Exception).
  static Error remote(RemoteOrigin origin, std::string message,
                      Code code = Code::kUnknown);

  // errno mapped in one place: ECONNRESET/EPIPE/... -> kUnavailable,
  // ETIMEDOUT -> kDeadlineExceeded, ENOMEM -> kResourceExhausted, ...
  static Error fromErrno(int err, std::string_view what,
                         SourceLocation w = SourceLocation::current());

  bool ok() const { return state_ == nullptr; }
  Code code() const { return state_ ? state_->code : Code::kOk; }
  // The message alone; empty on success.
  const std::string& message() const;
  // "file.cc:42" where the error was first created; empty on success and
  // for errors from another worker. Not part of what(): for debug logs.
  std::string where() const;
  const RemoteOrigin* remoteOrigin() const {
    return state_ && state_->origin ? &*state_->origin : nullptr;
  }

  // "DEADLINE_EXCEEDED: store get(key) timed out after 30s": the code, the
  // remote origin if any, the message; no source place, no backtrace.
  std::string what() const;

  // A copy whose message is "<context>: <message>"; code and origin kept.
  Error withContext(std::string_view context) const;

  friend bool operator==(const Error& a, const Error& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct State {
    Code code;
    std::string message;
    const char* file;
    uint32_t line;
    std::optional<RemoteOrigin> origin;
  };
  std::shared_ptr<const State> state_;
};

// ---------------------------------------------------------------------------
// Exceptions for synchronous calls. Each carries the Error it came from.

class Exception : public std::runtime_error {
 public:
  explicit Exception(Error error);
  const Error& error() const noexcept { return error_; }
  Code code() const noexcept { return error_.code(); }

 private:
  Error error_;
};

#define TRELLIS_DECLARE_EXCEPTION(Name)                 \
  class Name : public Exception {                       \
   public:                                              \
    explicit Name(Error e) : Exception(std::move(e)) {} \
  }

TRELLIS_DECLARE_EXCEPTION(TimeoutError);     // kDeadlineExceeded
TRELLIS_DECLARE_EXCEPTION(ConnectionError);  // kUnavailable
TRELLIS_DECLARE_EXCEPTION(ProtocolError);    // kDataLoss
TRELLIS_DECLARE_EXCEPTION(AuthError);  // kUnauthenticated, kPermissionDenied
TRELLIS_DECLARE_EXCEPTION(
    InvalidArgumentError);                      // kInvalidArgument, kOutOfRange
TRELLIS_DECLARE_EXCEPTION(NotFoundError);       // kNotFound
TRELLIS_DECLARE_EXCEPTION(AlreadyExistsError);  // kAlreadyExists
TRELLIS_DECLARE_EXCEPTION(CancelledError);      // kCancelled
TRELLIS_DECLARE_EXCEPTION(ResourceExhaustedError);  // kResourceExhausted
TRELLIS_DECLARE_EXCEPTION(
    FailedPreconditionError);                   // kFailedPrecondition, kAborted
TRELLIS_DECLARE_EXCEPTION(UnimplementedError);  // kUnimplemented
TRELLIS_DECLARE_EXCEPTION(InternalError);       // kInternal, kUnknown

#undef TRELLIS_DECLARE_EXCEPTION

// Raised by a remote worker (an Error with a RemoteOrigin), whatever its code.
class RemoteError : public Exception {
 public:
  explicit RemoteError(Error e) : Exception(std::move(e)) {}
  const RemoteOrigin& origin() const { return *error().remoteOrigin(); }
};

// Throws the exception type that matches `error`; returns if it is ok.
void throwIfError(const Error& error);
[[noreturn]] void throwError(const Error& error);

// Converts the exception in flight (inside a catch block) into an Error:
// a trellis::Exception keeps its Error, anything else becomes kUnknown with
// its what() and, where known, its type name.
Error errorFromCurrentException();

}  // namespace trellis
