#pragma once

// What the calling thread has used so far: its CPU time and how often it
// went to sleep of its own accord. Two readings bound what the thread did
// between them (rpc/'s report of an inline function that held its loop).

#include <trellis/core/deadline.h>

namespace trellis {

struct ThreadUsage {
  // CPU time, the scheduler's exact figure (CLOCK_THREAD_CPUTIME_ID).
  // Not getrusage's: that one is brought up to date only at a tick or a
  // switch, so a reading taken after the thread polled for a few
  // milliseconds charges those milliseconds to whatever ran between it
  // and the reading before (up to a tick, 4 ms, on an empty stretch).
  Duration cpu{0};
  // Voluntary context switches: a lock, I/O or a sleep put it to sleep.
  // Being preempted is not counted.
  long waits = 0;

  static ThreadUsage now();
};

}  // namespace trellis
