// Small definitions of core that have no file of their own.
#include <cstdio>
#include <cstdlib>

#include <trellis/core/check.h>
#include <trellis/core/future.h>
#include <trellis/core/ids.h>
#include <trellis/core/logging.h>

namespace trellis {

namespace detail {

void checkFailed(const char* cond, std::string_view message, const char* file,
                 int line) {
  std::fprintf(stderr, "trellis: check failed at %s:%d: %s: %.*s\n", file, line,
               cond, static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
  std::abort();
}

void reportCallbackException(const Error& error) {
  TRELLIS_LOG_ERROR("future done-callback threw; dropped: {}", error.what());
}

void throwFutureTimeout(Duration waited) {
  throw TimeoutError(
      Error::timeout("future not completed within " + formatDuration(waited)));
}

void throwNotCompleted() {
  throw FailedPreconditionError(Error(
      Code::kFailedPrecondition, "Future::value() called before completion"));
}

}  // namespace detail

IdAllocator& rootIds() {
  static IdAllocator ids("");
  return ids;
}

}  // namespace trellis
