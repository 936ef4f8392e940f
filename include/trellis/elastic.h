#pragma once

// What a worker under elastic-run uses of elastic/ (docs/elastic.md):
// error files (an uncaught exception shown in the launcher's summary) and
// atomic checkpoints that a restarted group resumes from. Link
// trellis::elastic and trellis::elastic_checkpoint.

#include <trellis/core/worker_env.h>
#include <trellis/elastic/checkpoint.h>
#include <trellis/elastic/errors.h>
