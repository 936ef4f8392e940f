#pragma once

// The cuda_ipc channel: CUDA tensors between two processes on one host
// travel by CUDA IPC (docs/transport.md, "cuda_ipc channel"). Compiled only
// where CUDA was found at configure time (TRELLIS_ENABLE_CUDA); the pipe
// negotiates it for cuda tensors, next to a cpu channel.
//
// The writer puts a record in the frame instead of the bytes: an IPC handle
// of the tensor's allocation, the tensor's offset and length in it, and an
// IPC event recorded on the writer's legacy default stream (stream 0) when
// the write is issued. The reader opens the handle (once per allocation; it
// keeps it open until the channel is destroyed), makes its own stream wait
// for the event, so work the writer queued on stream 0 before the write is
// finished first, copies device to device into its allocation and answers
// with a completion frame; the writer's callback fires only then. Work the
// writer queued on other streams (non-blocking streams, per-thread default
// streams) must be finished, or ordered before stream 0, by the writer.
//
// Only memory from cudaMalloc (or an allocator built on it, such as
// PyTorch's caching allocator) can be exported; memory from cudaMallocAsync
// pools, cuMemCreate or the host fails that write with INVALID_ARGUMENT.
//
// viable() probes softly (cudaGetDeviceCount): no driver or no device means
// not viable, with the reason; never a crash.
//
// Context::create() registers it with priority 200 in builds that define
// TRELLIS_HAVE_CUDA.

#include <chrono>
#include <cstddef>
#include <memory>

namespace trellis::transport {
class Channel;
}

namespace trellis::transport::cuda_ipc {

struct Options {
  // How long the reader waits for one copy (including the wait for the
  // writer's event) before failing that read with DEADLINE_EXCEEDED. A copy
  // that times out may still land later; the channel then refuses further
  // reads (its stream is stuck behind it).
  std::chrono::milliseconds copyTimeout{60000};
  // Opened memory handles kept per channel; the least recently used one
  // with no copy in flight is closed beyond this. Each open handle keeps
  // the peer's allocation alive on the GPU.
  size_t maxOpenHandles = 256;
};

std::shared_ptr<Channel> create(Options options = {});

}  // namespace trellis::transport::cuda_ipc
