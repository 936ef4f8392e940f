#pragma once

// Collectives, in one include (docs/collectives.md): ProcessGroup and its
// ops, Work, the reduce ops and options, and WorkerEnv for the launcher's
// variables. Link trellis::collectives.
//
//   #include <trellis/collectives.h>
//   auto pg = trellis::collectives::ProcessGroup::fromEnvironment();
//   pg->allreduce(t).wait();

#include <trellis/collectives/process_group.h>
#include <trellis/collectives/types.h>
#include <trellis/collectives/work.h>
#include <trellis/core/worker_env.h>
