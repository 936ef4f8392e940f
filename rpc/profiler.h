#pragma once

// Profiling of RPCs (docs/rpc.md, "Profiling").
//
//   {
//     trellis::rpc::Profiler prof;
//     rpc::rpcSync<lookup>("ps", ids);
//     prof.exportChromeTrace("trace.json");   // open in ui.perfetto.dev
//   }
//
// While at least one Profiler is alive in a process, every call this
// process makes records a caller-side event ("rpc_sync#fn(w0 -> ps)"
// style: "rpc#<function> <caller> -> <callee>", from send to reply) and asks
// the callee for its side: the callee times the function's execution and
// returns the event in the reply, named after the function and tagged with
// the callee's worker name, so one trace shows both ends. Timestamps are
// the steady clock in microseconds: on one host all processes share it; across
// hosts the remote events keep their own clock's offset (not corrected).
//
// A call made by a function that is itself being profiled on the callee
// (a nested call) is profiled too, whether or not a Profiler is alive in
// the callee's process: its events ride the outer reply, so the trace
// shows the nested call inside the outer function's event, on its thread.
//
// Thread ids in events and traces are small per-process integers
// (profilerThreadId()), not hashes: JSON viewers read numbers as doubles
// and round anything above 2^53.
//
// Thread safety: all methods are thread-safe. Profilers may nest; each
// sees the events recorded during its own lifetime.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <trellis/core/mutex.h>

namespace trellis::rpc {

struct ProfileEvent {
  std::string name;
  std::string worker;  // where it ran
  int64_t startUs = 0;
  int64_t durationUs = 0;
  uint64_t thread = 0;  // profilerThreadId() of the thread, in `worker`
};

class Profiler {
 public:
  Profiler();
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Events recorded since this profiler started, in completion order.
  std::vector<ProfileEvent> events() const;
  // Chrome trace JSON ({"traceEvents": [...]}; one process row per worker).
  std::string chromeTrace() const;
  // Writes chromeTrace() to `path`; throws the errno-mapped error on failure.
  void exportChromeTrace(const std::string& path) const;

  // Used by the agent.
  static bool active();
  static void record(ProfileEvent event);

 private:
  size_t start_;
};

// Microseconds on the steady clock (the profiler's time base).
int64_t profilerNowUs();

// The calling thread's id in traces: 1, 2, 3... in the order threads first
// ask, stable for the thread's life, never reused in the process, and so
// far below 2^53.
uint64_t profilerThreadId();

// Used by the agent. The events of the calls a profiled request's function
// makes, collected to ride that request's reply. `thread` is the
// profilerThreadId() of the thread the function runs on.
struct NestedEvents {
  uint64_t thread = 0;
  Mutex mu;
  std::vector<ProfileEvent> events TRELLIS_GUARDED_BY(mu);

  void add(ProfileEvent event);
  std::vector<ProfileEvent> take();
};

// Used by the agent. While alive, calls made on this thread are profiled
// and their events go to `sink` (instead of this process's Profilers).
// Scopes nest; the destructor restores the previous one. Not movable.
class NestedProfileScope {
 public:
  explicit NestedProfileScope(std::shared_ptr<NestedEvents> sink);
  ~NestedProfileScope();
  NestedProfileScope(const NestedProfileScope&) = delete;
  NestedProfileScope& operator=(const NestedProfileScope&) = delete;

  // The calling thread's innermost sink; null outside any scope.
  static const std::shared_ptr<NestedEvents>& current();

 private:
  std::shared_ptr<NestedEvents> previous_;
};

}  // namespace trellis::rpc
