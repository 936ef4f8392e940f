#pragma once

// Internal: the lifecycle every loop-owned object of a context follows
// (pipes, listeners, connections). Not installed.
//
// Contract (docs/threads.md, "Callbacks"; docs/transport.md, "Errors")
//  - Sticky: the first error an object fails with stays its error. fail()
//    records it and runs the owner's teardown exactly once; later calls do
//    nothing.
//  - Exactly once: the teardown fails every operation pending at that
//    moment with the error (PendingCallbacks::failAll), and every operation
//    issued later fails with it at once (refuse()). No callback is dropped
//    and none fires twice.
//  - Threads: loop thread only (Loop::mayTouchState()). Callbacks are handed
//    to Loop::deliver(), so none runs inline from a public call.

#include <cstddef>
#include <deque>
#include <functional>
#include <utility>

#include <trellis/core/check.h>
#include <trellis/core/error.h>
#include <trellis/transport/loop.h>

namespace trellis::transport {

class Lifecycle final {
 public:
  explicit Lifecycle(Loop& loop) : loop_(loop) {}
  Lifecycle(const Lifecycle&) = delete;
  Lifecycle& operator=(const Lifecycle&) = delete;

  bool failed() const { return failed_; }
  // The sticky error; OK until failed().
  const Error& error() const { return error_; }

  // The first call records `error` and runs `teardown()`, which releases
  // the owner's resources and fails what is pending; it returns true. Later
  // calls return false and run nothing.
  template <typename Teardown>
  bool fail(const Error& error, Teardown&& teardown) {
    TRELLIS_DCHECK(loop_.mayTouchState(), "Lifecycle::fail off the loop");
    if (failed_) {
      return false;
    }
    failed_ = true;
    error_ = error;
    std::forward<Teardown>(teardown)();
    return true;
  }

  // For an operation issued on a failed object: hands `cb` the sticky error
  // (and `rest...` as its other arguments) and returns true. False, with
  // `cb` untouched, while the object has not failed.
  template <typename Callback, typename... Rest>
  bool refuse(Callback& cb, Rest... rest) {
    TRELLIS_DCHECK(loop_.mayTouchState(), "Lifecycle::refuse off the loop");
    if (!failed_) {
      return false;
    }
    loop_.deliver(
        [cb = std::move(cb), e = error_, ... rest = std::move(rest)]() mutable {
          cb(e, std::move(rest)...);
        });
    return true;
  }

 private:
  Loop& loop_;
  bool failed_ = false;
  Error error_;
};

// Callbacks of one kind waiting on an object, served in order. Each leaves
// the queue exactly once: pop() (the owner completes it) or failAll().
template <typename... Args>
class PendingCallbacks final {
 public:
  using Callback = std::function<void(const Error&, Args...)>;

  bool empty() const { return queue_.empty(); }
  size_t size() const { return queue_.size(); }
  void push(Callback cb) { queue_.push_back(std::move(cb)); }
  Callback pop() {
    Callback cb = std::move(queue_.front());
    queue_.pop_front();
    return cb;
  }

  // Hands every waiting callback `error` (and value-initialised other
  // arguments) through `loop`'s deliver(), in order. The queue is emptied
  // first, so a callback may queue again.
  void failAll(Loop& loop, const Error& error) {
    auto queue = std::move(queue_);
    queue_.clear();
    for (auto& cb : queue) {
      loop.deliver([cb = std::move(cb), error] { cb(error, Args()...); });
    }
  }

 private:
  std::deque<Callback> queue_;
};

}  // namespace trellis::transport
