// Small definitions of core that have no file of their own.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <sys/resource.h>

#include <trellis/core/check.h>
#include <trellis/core/deadline.h>
#include <trellis/core/future.h>
#include <trellis/core/ids.h>
#include <trellis/core/logging.h>
#include <trellis/core/spin.h>
#include <trellis/core/thread_usage.h>

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

ThreadUsage ThreadUsage::now() {
  ThreadUsage u;
  timespec t{};
  if (::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t) == 0) {
    u.cpu =
        std::chrono::seconds(t.tv_sec) + std::chrono::nanoseconds(t.tv_nsec);
  }
  rusage r{};
  if (::getrusage(RUSAGE_THREAD, &r) == 0) {
    u.waits = r.ru_nvcsw;
  }
  return u;
}

Duration microsFromEnv(const char* name, Duration fallback, Duration max) {
  using std::chrono::duration_cast;
  using std::chrono::microseconds;
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') {
    return fallback;
  }
  const long long maxUs = duration_cast<microseconds>(max).count();
  char* end = nullptr;
  const long long us = std::strtoll(env, &end, 10);
  if (*end != '\0' || us < 0 || us > maxUs) {
    std::fprintf(
        stderr,
        "trellis: %s='%s' is not a number of microseconds in "
        "[0, %lld]; using %lld\n",
        name, env, maxUs,
        static_cast<long long>(duration_cast<microseconds>(fallback).count()));
    return fallback;
  }
  return Duration(microseconds(us));
}

Duration spinBudget() {
  static const Duration budget =
      microsFromEnv("TRELLIS_SPIN_US", std::chrono::microseconds(50),
                    std::chrono::microseconds(100000));
  return budget;
}

IdAllocator& rootIds() {
  static IdAllocator ids("");
  return ids;
}

}  // namespace trellis
