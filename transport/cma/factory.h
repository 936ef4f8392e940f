#pragma once

// The cma channel: CPU tensors of at least `thresholdBytes` between two
// processes on one host travel by cross-memory attach (docs/transport.md,
// "cma channel"). The writer puts a record {pid, address, length} in the
// frame instead of the bytes; the reader copies them with
// process_vm_readv(2) straight into its allocation, on threads of the
// channel, and answers with a completion frame; the
// writer's callback fires only then, so its buffer must stay valid until
// the callback (as for every write). Smaller tensors and all payloads travel
// inline through the pipe's connection, as with the basic channel.
//
// viable() checks once that this process may read a process's memory with
// process_vm_readv (a seccomp profile may forbid it) and Yama's
// ptrace_scope: at 1 it allows any process to read this one
// (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)), since the reader is a peer,
// not an ancestor; at 2 or 3 cma is not viable. A read that fails at run
// time (EPERM, EFAULT, a short read) fails that read and that write with an
// error naming the peer; the pipe goes on. A writer that is gone (its
// process ended or is ending, or it closed its end of the pipe and so may
// have freed the buffer) is UNAVAILABLE; a live one whose record names
// memory it does not have is DATA_LOSS (docs/transport.md, "cma channel").
//
// Context::create() registers it with priority 150, above basic (100).

#include <cstddef>
#include <memory>

namespace trellis::transport {
class Channel;
}

namespace trellis::transport::cma {

// thresholdBytes: no tensor goes by cma.
constexpr size_t kNever = ~size_t{0};

struct Options {
  // Tensors of at least this many bytes go by cma; 0 = every non-empty CPU
  // tensor. Default kNever: measured here, the shm ring moved tensors of
  // every size from 64 KiB to 64 MiB faster than cma into a reused buffer,
  // and cma was ahead by at most a third into fresh pages
  // (docs/transport.md, "cma or the ring?"). Context::create() takes the
  // built-in channel's value from TRELLIS_CMA_THRESHOLD (bytes) when set.
  size_t thresholdBytes = kNever;
  // The reader copies on threads of the channel, started on first use, not
  // on the context's loop; a tensor of at least `splitBytes` is split into
  // one page-aligned piece per thread, copied in parallel (0: never split).
  size_t copyThreads = 2;
  size_t splitBytes = size_t{4} << 20;
  // Copies of at most this many bytes run on the loop thread instead: for
  // them a hop to a copy thread and back costs more than the copy (256 KiB:
  // half the throughput, docs/benchmarks.md), and they hold up the loop for
  // at most some 100 us.
  size_t inlineCopyBytes = size_t{1} << 20;
};

std::shared_ptr<Channel> create(Options options = {});

}  // namespace trellis::transport::cma
