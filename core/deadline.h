#pragma once

// Deadlines and durations. Every wait in Trellis takes a Deadline (or a
// timeout that becomes one at the top of the call) and passes it down, so one
// timeout governs a whole operation and is named in the error it produces.
//
// Convention (torch.distributed's): a timeout of zero means "no timeout".

#include <chrono>
#include <optional>
#include <string>
#include <string_view>

namespace trellis {

using Clock = std::chrono::steady_clock;
using Duration = std::chrono::nanoseconds;

class Deadline {
 public:
  // A deadline that never expires.
  static Deadline never() { return Deadline(Clock::time_point::max()); }
  // Expires `d` from now; `d <= 0` is already expired.
  static Deadline after(Duration d);
  // Like after(), except that a zero timeout means never (the user-facing
  // convention). A negative timeout is a caller error: InvalidArgumentError.
  static Deadline fromTimeout(Duration timeout);
  static Deadline at(Clock::time_point tp) { return Deadline(tp); }

  bool isNever() const { return tp_ == Clock::time_point::max(); }
  bool expired() const { return !isNever() && Clock::now() >= tp_; }
  // Time left, never negative; Duration::max() for never().
  Duration remaining() const;
  Clock::time_point timePoint() const { return tp_; }

  friend bool operator==(const Deadline&, const Deadline&) = default;
  friend Deadline earliest(Deadline a, Deadline b) {
    return a.tp_ <= b.tp_ ? a : b;
  }

 private:
  explicit Deadline(Clock::time_point tp) : tp_(tp) {}
  Clock::time_point tp_;
};

// The one timeout model of every user-facing API: an unset timeout means
// the layer's `fallback` (its option or default), zero means none, and a
// negative one is the caller's InvalidArgumentError naming `what`
// ("rpc timeout").
Duration timeoutOr(const std::optional<Duration>& timeout, Duration fallback,
                   std::string_view what);

// "250ms", "1.5s", "20us", "2m30s", "none" for zero.
std::string formatDuration(Duration d);

// A duration in microseconds from the environment variable `name`, in
// [0, max]; `fallback` when it is unset or empty. A value that is not such
// a number is reported on stderr (naming the variable and the range) and
// `fallback` is used. For knobs read once per process.
Duration microsFromEnv(const char* name, Duration fallback, Duration max);

}  // namespace trellis
