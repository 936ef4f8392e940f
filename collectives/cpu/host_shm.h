#pragma once
// The ranks of a group that share a host, and the shared-memory segment
// they reduce in (not installed; no libtorch). docs/collectives.md,
// "Algorithms", says when the cpu backend uses it.
//
// Contract
//  - A host is a boot of a machine seen through one IPC, PID and network
//    namespace: ranks in different network namespaces count as different
//    hosts (they reach each other only through the network). The test aid
//    TRELLIS_COLLECTIVES_RANKS_PER_HOST=K makes rank r count as being on
//    host r / K instead, so the cross-host and hierarchical paths run on one
//    machine; any other value than an integer in [1, 2^20] is an
//    InvalidArgumentError naming the variable.
//  - HostLayout::exchange publishes this rank's host in the group's store
//    and reads everyone's. Every rank of the group must call it, after the
//    mesh formed (a peer that dies meanwhile fails the wait with the mesh's
//    error, not the timeout).
//  - HostShm::create sets up one segment per host (the host's lowest rank
//    creates a memfd, the others open it through /proc/<pid>/fd and check
//    a random nonce), mapped and touched once, reused by every op. The
//    group agrees on the outcome: if any rank could not set up its
//    segment, no rank uses shared memory (a warning names the rank and the
//    reason) and every allreduce runs over the mesh. Null where no rank
//    shares a host with another, or after such a failure.
//  - The ops run on the group's worker thread, one at a time, and every
//    rank of the host must run the same sequence of them. Each carries
//    the op's fingerprint: ranks of one host that run different ops fail
//    with a desync error naming both. A wait ends when the peers of the
//    host got there, the mesh failed (a dead peer, an abort: its error is
//    returned), or the deadline passed (then the mesh is aborted with a
//    TimeoutError naming the ranks this rank waited for).
//  - Results are bit-identical on every rank of a host: each part of the
//    result is reduced by one rank and copied by the others.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <trellis/collectives/cpu/mesh.h>
#include <trellis/core/deadline.h>

namespace trellis::store {
class Store;
}

namespace trellis::collectives::detail {

struct HostLayout {
  // Host index of every rank; hosts are numbered in the order of their
  // lowest rank.
  std::vector<int> hostOf;
  // The ranks of every host, ascending.
  std::vector<std::vector<int>> ranks;

  // Publishes this rank's host key (hostKey()) and waits for every rank's.
  static HostLayout exchange(store::Store& store, Mesh& mesh,
                             const std::string& key, Duration timeout);
  // From every rank's host key.
  static HostLayout fromKeys(const std::vector<std::string>& keys);
  // This process's key for `rank` (see the contract above).
  static std::string hostKey(int rank);

  size_t hostCount() const { return ranks.size(); }
  // The lowest rank of every host, ascending.
  std::vector<int> leaders() const;
  // True when some host has more than one rank.
  bool anyShared() const;
};

// Elements of one dtype spread over several buffers (allreduceCoalesced's
// tensors), reduced as if they were one buffer, without packing them.
struct Pieces {
  struct Piece {
    uint8_t* data;
    size_t count;  // elements
  };
  std::vector<Piece> pieces;
  size_t elementSize = 1;

  size_t count() const;
  // Elements [offset, offset + count) copied to contiguous memory at `to`,
  // or from contiguous memory at `from` into the pieces.
  void copyOut(size_t offset, size_t count, uint8_t* to) const;
  void copyIn(size_t offset, size_t count, const uint8_t* from) const;
  // f(bytes, count) for the parts of elements [offset, offset + count), in
  // order; `bytes` points into the piece that holds them.
  template <typename F>
  void forEach(size_t offset, size_t count, F&& f) const {
    for (const Piece& p : pieces) {
      if (count == 0) {
        return;
      }
      if (offset >= p.count) {
        offset -= p.count;
        continue;
      }
      const size_t n = std::min(count, p.count - offset);
      f(p.data + offset * elementSize, n);
      offset = 0;
      count -= n;
    }
  }
};

class HostShm {
 public:
  // Bytes per rank per block of an op; a segment holds two blocks per rank.
  static constexpr size_t kBlockBytes = 512 * 1024;
  // At most this many bytes, every rank reduces the whole block itself
  // (one wait instead of two).
  static constexpr size_t kSmallBytes = 16 * 1024;

  // `*everyHost`: whether the group agreed to use shared memory (also
  // true on a rank alone on its host, which gets null).
  static std::unique_ptr<HostShm> create(store::Store& store, Mesh& mesh,
                                         const HostLayout& layout,
                                         Duration timeout, bool* everyHost);
  ~HostShm();
  HostShm(const HostShm&) = delete;
  HostShm& operator=(const HostShm&) = delete;

  // Ranks on this host, and this rank's index among them (0: the leader).
  int localSize() const;
  int localIndex() const;

  // Records that this rank started `fp` (every op, shm or not), so that a
  // peer of the host that finds a desync can say what it ran instead.
  void noteStarted(const Fingerprint& fp);

  // Every rank of the host ends with the op over all their `data`, each
  // element divided by `divisor` (> 0; 1: not divided). kAvg's division
  // is done here by the rank that reduces each part, while the part is in
  // cache, instead of in a second pass over the whole buffer.
  Error allreduce(Mesh& mesh, const Fingerprint& fp, const Deadline& deadline,
                  uint8_t* data, size_t count, int64_t divisor = 1);
  // The same over `pieces` in place, as one buffer of pieces.count()
  // elements (the same blocks, so the same bits as the packed buffer).
  Error allreduce(Mesh& mesh, const Fingerprint& fp, const Deadline& deadline,
                  const Pieces& pieces, int64_t divisor = 1);
  // The leader ends with the op over all their `data`; the others' `data`
  // is left partly reduced.
  Error reduceToLeader(Mesh& mesh, const Fingerprint& fp,
                       const Deadline& deadline, uint8_t* data, size_t count);
  // Every rank of the host ends with the leader's `data`.
  Error broadcastFromLeader(Mesh& mesh, const Fingerprint& fp,
                            const Deadline& deadline, uint8_t* data,
                            size_t bytes);

  class Impl;

 private:
  explicit HostShm(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace trellis::collectives::detail
