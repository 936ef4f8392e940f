#pragma once

// Clang thread-safety annotations (-Wthread-safety), as Trellis spells them.
//
// Annotate what a lock protects and which functions need it; clang then
// checks every access at compile time. Under compilers without the
// attribute (gcc) every macro expands to nothing, so the annotations cost
// nothing and change no code. The `tsa` preset builds with clang and
// -Werror=thread-safety (docs/threads.md, "Locks").
//
//   class Queue {
//    public:
//     void push(int v) TRELLIS_EXCLUDES(mu_);  // takes mu_ itself
//    private:
//     void pushLocked(int v) TRELLIS_REQUIRES(mu_);  // caller holds mu_
//     Mutex mu_;
//     std::deque<int> items_ TRELLIS_GUARDED_BY(mu_);
//   };
//
// The analysis follows lock/unlock calls within one function; it does not
// see through lambdas (a predicate passed to a wait runs under the lock,
// but clang cannot know it), which is why CondVar (core/mutex.h) has no
// predicate overloads: write the loop out.

#if defined(__clang__) && defined(__has_attribute)
#if __has_attribute(guarded_by)
#define TRELLIS_THREAD_ANNOTATION(x) __attribute__((x))
#endif
#endif
#ifndef TRELLIS_THREAD_ANNOTATION
#define TRELLIS_THREAD_ANNOTATION(x)
#endif

// A type that is a lock (a mutex); `x` names it in diagnostics.
#define TRELLIS_CAPABILITY(x) TRELLIS_THREAD_ANNOTATION(capability(x))
// An RAII type that holds a capability for its lifetime (MutexLock).
#define TRELLIS_SCOPED_CAPABILITY TRELLIS_THREAD_ANNOTATION(scoped_lockable)

// A member read or written only with `x` held.
#define TRELLIS_GUARDED_BY(x) TRELLIS_THREAD_ANNOTATION(guarded_by(x))
// A pointer member whose pointee is accessed only with `x` held.
#define TRELLIS_PT_GUARDED_BY(x) TRELLIS_THREAD_ANNOTATION(pt_guarded_by(x))

// Lock order: this lock is taken after / before the listed ones.
#define TRELLIS_ACQUIRED_AFTER(...) \
  TRELLIS_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define TRELLIS_ACQUIRED_BEFORE(...) \
  TRELLIS_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))

// The caller must hold the listed locks (exclusively / shared).
#define TRELLIS_REQUIRES(...) \
  TRELLIS_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define TRELLIS_REQUIRES_SHARED(...) \
  TRELLIS_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))
// The caller must not hold the listed locks (the function takes them).
#define TRELLIS_EXCLUDES(...) \
  TRELLIS_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))

// The function acquires / releases the listed locks (or `this` when none
// is listed, for a lock type's own lock()/unlock()).
#define TRELLIS_ACQUIRE(...) \
  TRELLIS_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define TRELLIS_RELEASE(...) \
  TRELLIS_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
// Acquires the lock when it returns `ok` (true for a tryLock()).
#define TRELLIS_TRY_ACQUIRE(...) \
  TRELLIS_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
// Tells the analysis the lock is held here (a run-time assertion's
// annotation; it checks nothing at run time by itself).
#define TRELLIS_ASSERT_CAPABILITY(x) \
  TRELLIS_THREAD_ANNOTATION(assert_capability(x))
// The function returns a reference to the lock `x`.
#define TRELLIS_RETURN_CAPABILITY(x) TRELLIS_THREAD_ANNOTATION(lock_returned(x))

// Turns the analysis off for one function. Each use says why next to it:
// the analysis is intra-procedural, and some correct code (a lock handed
// over between functions, state touched only before threads start) is
// beyond it.
#define TRELLIS_NO_THREAD_SAFETY_ANALYSIS \
  TRELLIS_THREAD_ANNOTATION(no_thread_safety_analysis)
