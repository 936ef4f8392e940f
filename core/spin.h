#pragma once

// The process-wide budget for polling before sleeping.
//
// Waking a thread that sleeps on a futex or eventfd costs about 20 µs on
// these machines; handing work to a thread that is still polling costs
// under 1 µs (DESIGN.md, "Facts about these machines"). Where a hand-off is
// expected within microseconds, Trellis polls for a short budget before it
// sleeps, and never polls while idle. The budget is `TRELLIS_SPIN_US`
// (microseconds, default 50, at most 100000; 0 turns such polling off),
// read once per process. An invalid value is reported on stderr and the
// default is used. Users: the transport loop's expected-work polling, and
// the shm transport's ring polling (twice the budget unless its options set
// one; transport/shm/factory.h).

#include <trellis/core/deadline.h>

namespace trellis {

// The process-wide spin budget (TRELLIS_SPIN_US). Thread-safe.
Duration spinBudget();

}  // namespace trellis
