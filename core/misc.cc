// Small definitions of core that have no file of their own.
#include <cstdio>
#include <cstdlib>

#include <trellis/core/check.h>
#include <trellis/core/future.h>
#include <trellis/core/ids.h>
#include <trellis/core/logging.h>
#include <trellis/core/spin.h>

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

Duration spinBudget() {
  static const Duration budget = [] {
    constexpr int64_t kDefaultUs = 50;
    constexpr int64_t kMaxUs = 100000;
    const char* env = std::getenv("TRELLIS_SPIN_US");
    if (env == nullptr || *env == '\0') {
      return Duration(std::chrono::microseconds(kDefaultUs));
    }
    char* end = nullptr;
    const long long us = std::strtoll(env, &end, 10);
    if (*end != '\0' || us < 0 || us > kMaxUs) {
      std::fprintf(stderr,
                   "trellis: TRELLIS_SPIN_US='%s' is not a number of "
                   "microseconds in [0, %lld]; using %lld\n",
                   env, static_cast<long long>(kMaxUs),
                   static_cast<long long>(kDefaultUs));
      return Duration(std::chrono::microseconds(kDefaultUs));
    }
    return Duration(std::chrono::microseconds(us));
  }();
  return budget;
}

IdAllocator& rootIds() {
  static IdAllocator ids("");
  return ids;
}

}  // namespace trellis
