#include <cstdio>

#include <trellis/core/deadline.h>
#include <trellis/core/error.h>

namespace trellis {

Deadline Deadline::after(Duration d) {
  const auto now = Clock::now();
  if (d >= Clock::time_point::max() - now) {
    return never();
  }
  return Deadline(now + d);
}

Deadline Deadline::fromTimeout(Duration timeout) {
  if (timeout < Duration::zero()) {
    throw InvalidArgumentError(
        Error::invalidArgument("timeout must be >= 0 (0 means none), got " +
                               std::to_string(timeout.count()) + "ns"));
  }
  return timeout == Duration::zero() ? never() : after(timeout);
}

Duration timeoutOr(const std::optional<Duration>& timeout, Duration fallback,
                   std::string_view what) {
  if (!timeout.has_value()) {
    return fallback;
  }
  if (*timeout < Duration::zero()) {
    throw InvalidArgumentError(Error::invalidArgument(
        std::string(what) + " must be >= 0 (0 means none; leave it unset " +
        "for the default), got -" + formatDuration(-*timeout)));
  }
  return *timeout;
}

Duration Deadline::remaining() const {
  if (isNever()) {
    return Duration::max();
  }
  const auto left = tp_ - Clock::now();
  return left > Duration::zero() ? std::chrono::duration_cast<Duration>(left)
                                 : Duration::zero();
}

std::string formatDuration(Duration d) {
  using namespace std::chrono;
  if (d == Duration::zero()) {
    return "none";
  }
  if (d == Duration::max()) {
    return "forever";
  }
  char buf[64];
  const double ns = static_cast<double>(d.count());
  if (d < microseconds(1)) {
    std::snprintf(buf, sizeof(buf), "%lldns",
                  static_cast<long long>(d.count()));
  } else if (d < milliseconds(1)) {
    std::snprintf(buf, sizeof(buf), "%.3gus", ns / 1e3);
  } else if (d < seconds(1)) {
    std::snprintf(buf, sizeof(buf), "%.3gms", ns / 1e6);
  } else if (d < minutes(1)) {
    std::snprintf(buf, sizeof(buf), "%.3gs", ns / 1e9);
  } else {
    const auto m = duration_cast<minutes>(d);
    const auto s = duration_cast<seconds>(d - m);
    std::snprintf(buf, sizeof(buf), "%lldm%llds",
                  static_cast<long long>(m.count()),
                  static_cast<long long>(s.count()));
  }
  return buf;
}

}  // namespace trellis
