#pragma once
// What a ProcessGroup backend implements (not installed; no libtorch). The
// front end (process_group.cc) checks arguments, numbers the ops and turns
// tensors into the raw views of an OpSpec; a backend moves the bytes.
#include <functional>
#include <string>
#include <vector>

#include <trellis/collectives/cpu/message.h>
#include <trellis/collectives/process_group.h>
#include <trellis/core/error.h>

namespace trellis::collectives {

namespace detail {

// One op as views of its tensors' memory, checked by the front end.
struct OpSpec {
  Fingerprint fp;
  // In place (allreduce, broadcast, reduce): `count` elements at `data`.
  void* data = nullptr;
  size_t count = 0;
  // Per-rank blocks (allgather, gather, scatter, reduceScatter) of `bytes`
  // each, or the tensors of allreduceCoalesced (counts[i] elements each).
  std::vector<void*> outputs;
  std::vector<const void*> inputs;
  size_t bytes = 0;
  std::vector<size_t> counts;
  // alltoall: block r of the input / output, in bytes.
  std::vector<size_t> inOffsets, inLengths, outOffsets, outLengths;
};

}  // namespace detail

class ProcessGroup::Backend {
 public:
  using Done = std::function<void(const Error&)>;
  using SourceDone = std::function<void(const Error&, int source)>;
  virtual ~Backend() = default;
  // Runs `op` after every op enqueued before it; `done` fires exactly once,
  // after the backend stopped touching the op's memory.
  virtual void enqueue(detail::OpSpec op, Done done) = 0;
  // Point to point, outside the collectives' order.
  virtual void send(int peer, int64_t tag, detail::DType dtype,
                    const void* data, size_t bytes, Done done) = 0;
  // peer < 0: any source.
  virtual void recv(int peer, int64_t tag, detail::DType dtype, void* data,
                    size_t bytes, SourceDone done) = 0;
};

}  // namespace trellis::collectives
