#pragma once
// The cpu backend's algorithms over a Mesh (not installed; no libtorch).
// Each runs one collective on the calling thread (the group's worker) and
// returns once every send and receive it posted has called back, so the
// caller's buffers are free again whatever the outcome.
//
// Which algorithm runs (docs/collectives.md, "Algorithms"):
//  - allreduce: where ranks share hosts (host_shm.h), hierarchical: reduce
//    in each host's shared-memory segment, allreduce among one leader per
//    host over the mesh, broadcast in the segment (one host: the segment
//    alone). Among the leaders, or where no ranks share a host: recursive
//    doubling (with the non-power-of-two fold) up to kSmallAllreduceBytes,
//    ring reduce-scatter + allgather above. TRELLIS_COLLECTIVES_ALGO=ring|rd
//    forces a flat one over the mesh, =hier the hierarchical one where it
//    applies (tests cover each). allreduceCoalesced is the same over its
//    tensors as one buffer; with the whole group on one host, unpacked.
//  - broadcast, reduce: binomial trees rooted at the root.
//  - allgather: ring. gather, scatter: direct to/from the root.
//  - reduceScatter: ring. alltoall: pairwise exchange. barrier:
//    dissemination with empty messages.
// Every rank reduces in the same order, so all ranks end with bit-identical
// results (each pairwise reduction is commutative in IEEE arithmetic).
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <trellis/collectives/cpu/host_shm.h>
#include <trellis/collectives/cpu/mesh.h>
#include <trellis/collectives/dtype.h>
#include <trellis/core/deadline.h>

namespace trellis::collectives::detail {

constexpr size_t kSmallAllreduceBytes = 256 * 1024;

enum class AllreduceAlgo { kAuto, kRing, kRecursiveDoubling, kHierarchical };
// TRELLIS_COLLECTIVES_ALGO: unset/"auto", "ring", "rd" or "hier"; anything else
// is an InvalidArgumentError naming the variable and the value.
AllreduceAlgo allreduceAlgoFromEnvironment();

// Reusable memory for received chunks: grows, never shrinks, so the hot
// path touches no fresh pages once warm.
class Scratch {
 public:
  uint8_t* get(size_t bytes);

 private:
  std::vector<uint8_t> buf_;
};

struct AlgoContext {
  Mesh& mesh;
  Fingerprint fp;
  Deadline deadline;
  Scratch& scratch;
  AllreduceAlgo algo = AllreduceAlgo::kAuto;
  // Set when ranks share hosts and every host has its segment (allreduce
  // then runs hierarchically); shm: this rank's host's segment, null when
  // this rank is alone on its host.
  const HostLayout* hosts = nullptr;
  HostShm* shm = nullptr;
  // The mesh ranks an algorithm runs among, in order; empty: all of them.
  // The algorithms see team indices (size(), rank(), Exchange peers).
  std::vector<int> team;
  int teamIndex = -1;

  int size() const;
  int rank() const;
  int meshRank(int index) const;
  // `ranks` must contain this rank.
  void setTeam(std::vector<int> ranks);
};

Error allreduce(AlgoContext& c, void* data, size_t count);
// allreduceCoalesced's tensors (elements of c.fp.dtype each) as one
// buffer. With the whole group on this host they are reduced where they
// are, block by block through the segment; otherwise packed into `packed`
// (kept by the caller, grown as needed), reduced, and unpacked.
Error allreduce(AlgoContext& c, const Pieces& tensors,
                std::vector<uint8_t>& packed);
Error broadcast(AlgoContext& c, void* data, size_t bytes);
// Only the root's `data` changes.
Error reduce(AlgoContext& c, void* data, size_t count);
// outputs[r] receives rank r's `bytes`; `input` may be outputs[rank].
Error allgather(AlgoContext& c, const void* input, size_t bytes,
                std::span<void* const> outputs);
// outputs: the root's, one per rank; empty elsewhere.
Error gather(AlgoContext& c, const void* input, size_t bytes,
             std::span<void* const> outputs);
// inputs: the root's, one per rank; empty elsewhere.
Error scatter(AlgoContext& c, std::span<const void* const> inputs, void* output,
              size_t bytes);
// inputs: one block of `count` elements per rank; output gets block `rank`
// reduced over all ranks.
Error reduceScatter(AlgoContext& c, std::span<const void* const> inputs,
                    void* output, size_t count);
// Block r of `input` (inLengths[r] bytes at inOffsets[r]) goes to rank r;
// block r of `output` comes from rank r.
Error alltoall(AlgoContext& c, const uint8_t* input,
               std::span<const size_t> inOffsets,
               std::span<const size_t> inLengths, uint8_t* output,
               std::span<const size_t> outOffsets,
               std::span<const size_t> outLengths);
Error barrier(AlgoContext& c);

}  // namespace trellis::collectives::detail
