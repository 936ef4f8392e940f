#pragma once

// Checks for bugs, not for failures (docs/errors.md):
//  - TRELLIS_CHECK(cond, "message")
//    is always on; a failed check prints the condition, the message and the
//    place, then aborts. Use it for internal invariants whose violation
//    would corrupt state if execution went on.
//  - TRELLIS_DCHECK(cond, msg) is the same in debug builds and compiles to
//    nothing (the condition is not evaluated) under NDEBUG.
// Anything a peer, the network, the OS or a user's input can cause is an
// Error or an exception, never a check.

#include <string_view>

namespace trellis::detail {
[[noreturn]] void checkFailed(const char* cond, std::string_view message,
                              const char* file, int line);
}  // namespace trellis::detail

#define TRELLIS_CHECK(cond, msg)                                        \
  do {                                                                  \
    if (!(cond)) [[unlikely]] {                                         \
      ::trellis::detail::checkFailed(#cond, (msg), __FILE__, __LINE__); \
    }                                                                   \
  } while (false)

#ifdef NDEBUG
#define TRELLIS_DCHECK(cond, msg) \
  do {                            \
    if (false) {                  \
      (void)(cond);               \
    }                             \
  } while (false)
#else
#define TRELLIS_DCHECK(cond, msg) TRELLIS_CHECK(cond, msg)
#endif
