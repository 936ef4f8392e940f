#include <cerrno>
#include <cstring>
#include <cxxabi.h>
#include <typeinfo>

#include <trellis/core/error.h>

namespace trellis {

namespace {

const std::string kEmpty;

const char* baseName(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

}  // namespace

std::string_view codeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "OK";
    case Code::kCancelled:
      return "CANCELLED";
    case Code::kUnknown:
      return "UNKNOWN";
    case Code::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case Code::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case Code::kNotFound:
      return "NOT_FOUND";
    case Code::kAlreadyExists:
      return "ALREADY_EXISTS";
    case Code::kPermissionDenied:
      return "PERMISSION_DENIED";
    case Code::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case Code::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case Code::kAborted:
      return "ABORTED";
    case Code::kOutOfRange:
      return "OUT_OF_RANGE";
    case Code::kUnimplemented:
      return "UNIMPLEMENTED";
    case Code::kInternal:
      return "INTERNAL";
    case Code::kUnavailable:
      return "UNAVAILABLE";
    case Code::kDataLoss:
      return "DATA_LOSS";
    case Code::kUnauthenticated:
      return "UNAUTHENTICATED";
  }
  return "CODE(?)";
}

Error::Error(Code code, std::string message, SourceLocation where) {
  if (code == Code::kOk) {
    return;  // an OK code is success, whatever the message says
  }
  state_ = std::make_shared<const State>(State{code, std::move(message),
                                               baseName(where.file), where.line,
                                               std::nullopt});
}

#define TRELLIS_ERROR_FACTORY(fn, code)                    \
  Error Error::fn(std::string message, SourceLocation w) { \
    return Error(code, std::move(message), w);             \
  }
TRELLIS_ERROR_FACTORY(timeout, Code::kDeadlineExceeded)
TRELLIS_ERROR_FACTORY(connection, Code::kUnavailable)
TRELLIS_ERROR_FACTORY(protocol, Code::kDataLoss)
TRELLIS_ERROR_FACTORY(auth, Code::kUnauthenticated)
TRELLIS_ERROR_FACTORY(invalidArgument, Code::kInvalidArgument)
TRELLIS_ERROR_FACTORY(cancelled, Code::kCancelled)
TRELLIS_ERROR_FACTORY(notFound, Code::kNotFound)
TRELLIS_ERROR_FACTORY(internal, Code::kInternal)
#undef TRELLIS_ERROR_FACTORY

Error Error::remote(RemoteOrigin origin, std::string message, Code code) {
  Error e;
  e.state_ = std::make_shared<const State>(
      State{code == Code::kOk ? Code::kUnknown : code, std::move(message), "",
            0, std::move(origin)});
  return e;
}

Error Error::fromErrno(int err, std::string_view what, SourceLocation w) {
  Code code;
  switch (err) {
    case ECONNRESET:
    case ECONNREFUSED:
    case ECONNABORTED:
    case EPIPE:
    case ENOTCONN:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case ENETDOWN:
    case ESHUTDOWN:
      code = Code::kUnavailable;
      break;
    case ETIMEDOUT:
      code = Code::kDeadlineExceeded;
      break;
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
    case ENOBUFS:
      code = Code::kResourceExhausted;
      break;
    case EACCES:
    case EPERM:
      code = Code::kPermissionDenied;
      break;
    case ENOENT:
      code = Code::kNotFound;
      break;
    case EEXIST:
    case EADDRINUSE:
      code = Code::kAlreadyExists;
      break;
    case EINVAL:
    case EADDRNOTAVAIL:
    case ENAMETOOLONG:
      code = Code::kInvalidArgument;
      break;
    case ECANCELED:
      code = Code::kCancelled;
      break;
    case EAGAIN:
    case EBUSY:
    case EINTR:
      code = Code::kUnavailable;
      break;
    default:
      code = Code::kInternal;
  }
  char buf[128];
  const char* text = strerror_r(err, buf, sizeof(buf));
  return Error(code, std::string(what) + ": " + text, w);
}

const std::string& Error::message() const {
  return state_ ? state_->message : kEmpty;
}

std::string Error::where() const {
  if (!state_ || state_->line == 0) {
    return {};
  }
  return std::string(state_->file) + ":" + std::to_string(state_->line);
}

std::string Error::what() const {
  if (!state_) {
    return "OK";
  }
  std::string out(codeName(state_->code));
  out += ": ";
  if (state_->origin) {
    const RemoteOrigin& o = *state_->origin;
    out += "on worker '" + o.worker + "'";
    if (!o.function.empty()) {
      out += " in " + o.function;
    }
    if (!o.exceptionType.empty()) {
      out += " (" + o.exceptionType + ")";
    }
    out += ": ";
  }
  out += state_->message;
  return out;
}

Error Error::withContext(std::string_view context) const {
  if (!state_) {
    return *this;
  }
  Error e;
  State s = *state_;
  s.message = std::string(context) + ": " + s.message;
  e.state_ = std::make_shared<const State>(std::move(s));
  return e;
}

Exception::Exception(Error error)
    : std::runtime_error(error.what()), error_(std::move(error)) {}

void throwError(const Error& e) {
  if (e.remoteOrigin() != nullptr) {
    throw RemoteError(e);
  }
  switch (e.code()) {
    case Code::kOk:
      throw InternalError(
          Error::internal("throwError called with an OK error"));
    case Code::kDeadlineExceeded:
      throw TimeoutError(e);
    case Code::kUnavailable:
      throw ConnectionError(e);
    case Code::kDataLoss:
      throw ProtocolError(e);
    case Code::kUnauthenticated:
    case Code::kPermissionDenied:
      throw AuthError(e);
    case Code::kInvalidArgument:
    case Code::kOutOfRange:
      throw InvalidArgumentError(e);
    case Code::kNotFound:
      throw NotFoundError(e);
    case Code::kAlreadyExists:
      throw AlreadyExistsError(e);
    case Code::kCancelled:
      throw CancelledError(e);
    case Code::kResourceExhausted:
      throw ResourceExhaustedError(e);
    case Code::kFailedPrecondition:
    case Code::kAborted:
      throw FailedPreconditionError(e);
    case Code::kUnimplemented:
      throw UnimplementedError(e);
    case Code::kInternal:
    case Code::kUnknown:
      throw InternalError(e);
  }
  throw InternalError(e);
}

void throwIfError(const Error& e) {
  if (!e.ok()) {
    throwError(e);
  }
}

namespace {

std::string demangle(const char* name) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> out(
      abi::__cxa_demangle(name, nullptr, nullptr, &status), std::free);
  return status == 0 && out ? std::string(out.get()) : std::string(name);
}

}  // namespace

Error errorFromCurrentException() {
  try {
    throw;
  } catch (const Exception& e) {
    return e.error();
  } catch (const std::exception& e) {
    return Error(Code::kUnknown, demangle(typeid(e).name()) + ": " + e.what());
  } catch (...) {
    return Error(Code::kUnknown,
                 "unknown exception (not derived from std::exception)");
  }
}

}  // namespace trellis
