#pragma once

// Future<T> / Promise<T>: the completion type of every async operation.
//
// Contract
//  - A Future is a cheap, copyable handle to shared state; copies observe the
//    same result. A Promise completes it exactly once: with a value or with a
//    non-OK Error. Later attempts return false and change nothing.
//  - Every callback (addDoneCallback, then) runs exactly once, never while an
//    internal lock is held: on the thread that completes the promise, or on
//    the calling thread when the future is already complete.
//  - When the last copy of a Promise is destroyed before completing, its
//    future fails with CANCELLED ("promise destroyed before completion"), so
//    no waiter hangs on a dropped promise.
//  - Blocking calls throw the typed exception of the error (throwIfError);
//    wait(timeout) throws TimeoutError. Everything is thread-safe.
//  - A callback that throws does not disturb the completer: for then(), the
//    exception becomes the error of the returned future; for
//    addDoneCallback(), it is logged and dropped.

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <trellis/core/deadline.h>
#include <trellis/core/error.h>
#include <trellis/core/mutex.h>

namespace trellis {

template <typename T>
class Future;
template <typename T>
class Promise;

namespace detail {

struct Unit {};
template <typename T>
using Stored = std::conditional_t<std::is_void_v<T>, Unit, T>;

template <typename T>
struct ConstRef {
  using type = const T&;
};
template <>
struct ConstRef<void> {
  using type = void;
};

template <typename T>
struct IsFuture : std::false_type {};
template <typename T>
struct IsFuture<Future<T>> : std::true_type {};

// Logs an exception escaping a done-callback (future.cc).
void reportCallbackException(const Error& error);
// TimeoutError for a future still pending after `waited`.
[[noreturn]] void throwFutureTimeout(Duration waited);
[[noreturn]] void throwNotCompleted();

template <typename T>
class FutureState {
 public:
  using Callback = std::function<void()>;

  bool complete(std::optional<Stored<T>>&& value, Error&& error)
      TRELLIS_EXCLUDES(mu_) {
    Callback first;
    std::vector<Callback> more;
    {
      MutexLock lock(mu_);
      if (done_) {
        return false;
      }
      value_ = std::move(value);
      error_ = std::move(error);
      first.swap(first_);
      more.swap(more_);
      done_.store(true, std::memory_order_release);
    }
    cv_.notifyAll();
    if (first) {
      first();
    }
    for (auto& cb : more) {
      cb();
    }
    return true;
  }

  void addCallback(Callback cb) TRELLIS_EXCLUDES(mu_) {
    {
      MutexLock lock(mu_);
      if (!done_) {
        // Most futures get one callback: it needs no vector.
        if (!first_ && more_.empty()) {
          first_ = std::move(cb);
        } else {
          more_.push_back(std::move(cb));
        }
        return;
      }
    }
    cb();
  }

  // Promise copies alive (Promise keeps the count): the last one to go
  // breaks a promise that was never kept.
  void addPromise() { promises_.fetch_add(1, std::memory_order_relaxed); }
  void dropPromise() {
    if (promises_.fetch_sub(1, std::memory_order_acq_rel) == 1 && !done()) {
      complete(std::nullopt,
               Error::cancelled("promise destroyed before completion"));
    }
  }

  bool done() const { return done_.load(std::memory_order_acquire); }

  void wait() TRELLIS_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    while (!done_.load(std::memory_order_relaxed)) {
      cv_.wait(mu_);
    }
  }

  // False when `tp` passed first.
  [[nodiscard]] bool waitUntil(Clock::time_point tp) TRELLIS_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    while (!done_.load(std::memory_order_relaxed)) {
      if (!cv_.waitUntil(mu_, tp)) {
        return done_.load(std::memory_order_relaxed);
      }
    }
    return true;
  }

  // Valid only once done() is true: the fields are then immutable.
  const Error& error() const { return error_; }
  const Stored<T>& value() const { return *value_; }

 private:
  Mutex mu_;
  CondVar cv_;
  // Set under mu_, with release order, after value_ and error_: once
  // done() is true they are immutable and read without the lock, so they
  // are not GUARDED_BY (the analysis has no notion of publication).
  std::atomic<bool> done_{false};
  std::atomic<size_t> promises_{0};
  std::optional<Stored<T>> value_;
  Error error_;
  // In the order they were added: first_, then more_.
  Callback first_ TRELLIS_GUARDED_BY(mu_);
  std::vector<Callback> more_ TRELLIS_GUARDED_BY(mu_);
};

}  // namespace detail

template <typename T>
class [[nodiscard]] Future {
 public:
  using ValueType = T;
  using ConstRefType = typename detail::ConstRef<T>::type;

  // An empty handle; only valid() and assignment may be used on it.
  Future() = default;

  bool valid() const { return state_ != nullptr; }
  bool completed() const { return state_->done(); }
  bool hasError() const { return completed() && !state_->error().ok(); }
  bool hasValue() const { return completed() && state_->error().ok(); }
  // The error once completed with one; OK while pending or on success.
  Error error() const { return completed() ? state_->error() : Error(); }

  // Blocks until complete; throws the typed exception of an error.
  ConstRefType wait() const {
    state_->wait();
    return result();
  }

  // Blocks at most `timeout`; throws TimeoutError if still pending then.
  template <typename Rep, typename Period>
  ConstRefType wait(std::chrono::duration<Rep, Period> timeout) const {
    const auto d = std::chrono::duration_cast<Duration>(timeout);
    if (!state_->waitUntil(Deadline::after(d).timePoint())) {
      detail::throwFutureTimeout(d);
    }
    return result();
  }

  ConstRefType wait(Deadline deadline) const {
    if (deadline.isNever()) {
      return wait();
    }
    const auto d = deadline.remaining();
    if (!state_->waitUntil(deadline.timePoint())) {
      detail::throwFutureTimeout(d);
    }
    return result();
  }

  // Non-throwing wait: true once complete (with a value or an error).
  template <typename Rep, typename Period>
  [[nodiscard]] bool waitFor(std::chrono::duration<Rep, Period> timeout) const {
    return state_->waitUntil(
        Deadline::after(std::chrono::duration_cast<Duration>(timeout))
            .timePoint());
  }

  // The value of a completed future; throws its error, or
  // FailedPreconditionError when it is still pending.
  ConstRefType value() const {
    if (!completed()) {
      detail::throwNotCompleted();
    }
    return result();
  }

  // Runs `cb(*this)` once complete (see the contract above). `cb` is any
  // callable taking `const Future<T>&`; it is stored as it is, not wrapped
  // in a std::function of its own.
  template <typename F>
  requires(std::is_invocable_v<F&, const Future<T>&>) void addDoneCallback(
      F&& cb) const {
    state_->addCallback([self = *this, cb = std::forward<F>(cb)]() mutable {
      try {
        cb(self);
      } catch (...) {
        detail::reportCallbackException(errorFromCurrentException());
      }
    });
  }

  // Chains `fn`. `fn` returns U or Future<U>; the result is Future<U>. It
  // takes either
  //  - `const T&` (nothing for void): runs on success only; an error of
  //    this future skips `fn` and fails the result with the same error;
  //  - `const Future<T>&`, as torch's Future.then: runs on completion,
  //    success or error (value() rethrows the error).
  // An exception thrown by `fn` fails the result with that exception's
  // Error.
  template <typename F>
  auto then(F&& fn) const;

 private:
  template <typename F>
  auto thenValue(F&& fn) const;

  friend class Promise<T>;
  template <typename U>
  friend class Future;

  explicit Future(std::shared_ptr<detail::FutureState<T>> s)
      : state_(std::move(s)) {}

  ConstRefType result() const {
    throwIfError(state_->error());
    if constexpr (!std::is_void_v<T>) {
      return state_->value();
    }
  }

  std::shared_ptr<detail::FutureState<T>> state_;
};

template <typename T>
class Promise {
 public:
  Promise() : state_(std::make_shared<detail::FutureState<T>>()) {
    state_->addPromise();
  }
  Promise(const Promise& other) : state_(other.state_) {
    if (state_ != nullptr) {
      state_->addPromise();
    }
  }
  Promise(Promise&& other) noexcept : state_(std::move(other.state_)) {}
  Promise& operator=(const Promise& other) {
    if (this != &other) {
      Promise copy(other);
      std::swap(state_, copy.state_);
    }
    return *this;
  }
  Promise& operator=(Promise&& other) noexcept {
    if (this != &other) {
      release();
      state_ = std::move(other.state_);
    }
    return *this;
  }
  ~Promise() { release(); }

  Future<T> getFuture() const { return Future<T>(state_); }
  bool completed() const { return state_->done(); }

  // Each returns false (and changes nothing) if already completed.
  template <typename U = T>
  requires(!std::is_void_v<U>) bool setValue(U value) {
    return state_->complete(std::optional<detail::Stored<T>>(std::move(value)),
                            Error());
  }
  template <typename U = T>
  requires std::is_void_v<U>
  bool setValue() { return state_->complete(detail::Unit{}, Error()); }
  // An OK `error` is a caller bug; it is turned into INTERNAL so that the
  // future still fails rather than completing without a value.
  bool setError(Error error) {
    if (error.ok()) {
      error = Error::internal("Promise::setError called with an OK error");
    }
    return state_->complete(std::nullopt, std::move(error));
  }

 private:
  // The last copy of a promise breaks it (the contract above). One
  // allocation per promise: the copies are counted in the state.
  void release() {
    if (state_ != nullptr) {
      state_->dropPromise();
      state_.reset();
    }
  }

  std::shared_ptr<detail::FutureState<T>> state_;
};

// Helpers to make completed futures.
template <typename T>
Future<T> makeReadyFuture(T value) {
  Promise<T> p;
  p.setValue(std::move(value));
  return p.getFuture();
}
inline Future<void> makeReadyFuture() {
  Promise<void> p;
  p.setValue();
  return p.getFuture();
}
template <typename T>
Future<T> makeErrorFuture(Error error) {
  Promise<T> p;
  p.setError(std::move(error));
  return p.getFuture();
}

namespace detail {

// Completes `promise` with the outcome of invoking `fn(args...)`, where fn may
// return a plain value, void, or a Future (which is then forwarded).
template <typename U, typename F, typename... Args>
void fulfil(Promise<U>& promise, F& fn, Args&&... args) {
  using R = std::invoke_result_t<F&, Args...>;
  try {
    if constexpr (IsFuture<R>::value) {
      R inner = fn(std::forward<Args>(args)...);
      inner.addDoneCallback([promise](const R& f) mutable {
        if (f.hasError()) {
          promise.setError(f.error());
        } else if constexpr (std::is_void_v<U>) {
          promise.setValue();
        } else {
          promise.setValue(f.value());
        }
      });
    } else if constexpr (std::is_void_v<R>) {
      fn(std::forward<Args>(args)...);
      promise.setValue();
    } else {
      promise.setValue(fn(std::forward<Args>(args)...));
    }
  } catch (...) {
    promise.setError(errorFromCurrentException());
  }
}

template <typename R>
struct Unwrap {
  using type = R;
};
template <typename R>
struct Unwrap<Future<R>> {
  using type = R;
};

}  // namespace detail

template <typename T>
template <typename F>
auto Future<T>::then(F&& fn) const {
  constexpr bool kTakesValue =
      std::is_void_v<T> ? std::is_invocable_v<F&>
                        : std::is_invocable_v<F&, const detail::Stored<T>&>;
  constexpr bool kTakesFuture = std::is_invocable_v<F&, const Future<T>&>;
  static_assert(kTakesValue || kTakesFuture,
                "then() takes a callback of the value (const T&; no "
                "parameter for Future<void>) or of the future itself "
                "(const Future<T>&, as torch's Future.then)");
  if constexpr (!kTakesValue) {
    using U = typename detail::Unwrap<
        std::invoke_result_t<F&, const Future<T>&>>::type;
    Promise<U> promise;
    Future<U> out = promise.getFuture();
    state_->addCallback(
        [self = *this, promise, fn = std::forward<F>(fn)]() mutable {
          detail::fulfil(promise, fn, self);
        });
    return out;
  } else {
    return thenValue(std::forward<F>(fn));
  }
}

template <typename T>
template <typename F>
auto Future<T>::thenValue(F&& fn) const {
  using R =
      std::conditional_t<std::is_void_v<T>, std::invoke_result<F&>,
                         std::invoke_result<F&, const detail::Stored<T>&>>;
  using U = typename detail::Unwrap<typename R::type>::type;
  Promise<U> promise;
  Future<U> out = promise.getFuture();
  auto state = state_;
  state_->addCallback([state, promise, fn = std::forward<F>(fn)]() mutable {
    if (!state->error().ok()) {
      promise.setError(state->error());
      return;
    }
    if constexpr (std::is_void_v<T>) {
      detail::fulfil(promise, fn);
    } else {
      detail::fulfil(promise, fn, state->value());
    }
  });
  return out;
}

// Completes when every input has completed (with a value or an error); never
// fails itself. The inputs are returned in order for inspection.
template <typename T>
Future<std::vector<Future<T>>> collectAll(std::vector<Future<T>> futures) {
  Promise<std::vector<Future<T>>> promise;
  auto out = promise.getFuture();
  if (futures.empty()) {
    promise.setValue({});
    return out;
  }
  auto remaining = std::make_shared<std::atomic<size_t>>(futures.size());
  auto shared = std::make_shared<std::vector<Future<T>>>(std::move(futures));
  for (auto& f : *shared) {
    f.addDoneCallback([remaining, shared, promise](const Future<T>&) mutable {
      if (remaining->fetch_sub(1) == 1) {
        promise.setValue(std::move(*shared));
      }
    });
  }
  return out;
}

// Completes with the first error among `futures`, or successfully once all
// have succeeded.
template <typename T>
Future<void> whenAllSucceed(const std::vector<Future<T>>& futures) {
  Promise<void> promise;
  auto out = promise.getFuture();
  if (futures.empty()) {
    promise.setValue();
    return out;
  }
  auto remaining = std::make_shared<std::atomic<size_t>>(futures.size());
  for (const auto& f : futures) {
    f.addDoneCallback([remaining, promise](const Future<T>& done) mutable {
      if (done.hasError()) {
        promise.setError(done.error());
      } else if (remaining->fetch_sub(1) == 1) {
        promise.setValue();
      }
    });
  }
  return out;
}

// Waits for all futures; returns their values in order (nothing for void).
// Throws the first error to arrive as soon as it arrives, without waiting for
// the others, and TimeoutError if `deadline` passes first.
template <typename T>
auto waitAll(const std::vector<Future<T>>& futures,
             Deadline deadline = Deadline::never()) {
  whenAllSucceed(futures).wait(deadline);
  if constexpr (!std::is_void_v<T>) {
    std::vector<T> values;
    values.reserve(futures.size());
    for (const auto& f : futures) {
      values.push_back(f.value());
    }
    return values;
  }
}

}  // namespace trellis
