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
// Thread safety: all methods are thread-safe. Profilers may nest; each
// sees the events recorded during its own lifetime.

#include <cstdint>
#include <string>
#include <vector>

namespace trellis::rpc {

struct ProfileEvent {
  std::string name;
  std::string worker;  // where it ran
  int64_t startUs = 0;
  int64_t durationUs = 0;
  uint64_t thread = 0;
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

}  // namespace trellis::rpc
