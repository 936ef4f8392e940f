#pragma once
// Mesh: one transport pipe to every other rank of a group, with the
// message matching the cpu backend's algorithms need (not installed; no
// libtorch).
//
// Contract
//  - connect() listens, publishes its address in the store, connects to
//    every higher rank and accepts every lower one; each pipe starts with a
//    hello both ways (rank, world size, group id), checked against this
//    rank's view. It returns once every peer said hello, or throws: a
//    TimeoutError naming the ranks that never did, an InvalidArgumentError
//    when a peer disagrees on the world size or the group.
//  - Collective receives from one peer are matched in the order they were
//    posted; the message's fingerprint and step must equal the posted ones
//    (a mismatch is a desync: the mesh fails with both sides named).
//    Messages that arrive before their receive is posted are staged and
//    copied when it is, so a rank may run ahead by any number of steps.
//  - Tagged (p2p) messages match the oldest posted receive with the same
//    source (or any source) and tag, else they are staged.
//  - Every callback fires exactly once, on the transport's loop thread,
//    never under the mesh's lock; buffers are borrowed until then.
//  - Errors are sticky for the whole mesh: a dead or closed peer, a
//    malformed message, a desync, a peer's abort or abort() fail every
//    pending and later operation with the first error. abort() also tells
//    every peer why, so they fail naming this rank and the reason instead
//    of a bare "connection closed". A rank failed by a peer's abort relays
//    it (naming the rank that gave up) to its other peers, so a rank that
//    waits on it does not see it leave first and blame it.
//  - Thread safety: every method may be called from any thread.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <trellis/collectives/cpu/message.h>
#include <trellis/core/auth.h>
#include <trellis/core/deadline.h>
#include <trellis/core/error.h>

namespace trellis::store {
class Store;
}

namespace trellis::collectives::detail {

struct MeshOptions {
  // Identifies the group; every rank's must be equal.
  std::string groupId;
  // Prefix of log and error lines ("group 'default'").
  std::string description;
  std::optional<auth::JobToken> token;
  // Empty: net::chooseLocalAddress's rules.
  std::string localAddress;
  // The group's op timeout.
  Duration timeout = std::chrono::minutes(10);
  // Bound on forming the mesh (connections, hellos) and, in the cpu
  // backend, the hosts' shared-memory setup.
  Duration initTimeout = std::chrono::minutes(10);
};

// Waits until every one of `keys` exists in `store`, in short slices:
// before each, `check` may end the wait with an error (thrown), such as a
// peer's failure that makes waiting pointless; at `deadline` it throws what
// `timedOut` returns.
void waitForKeys(store::Store& store, const std::vector<std::string>& keys,
                 const Deadline& deadline, const std::function<Error()>& check,
                 const std::function<Error()>& timedOut);

// Waits until every mesh destroyed on its transport's loop thread (its
// teardown then runs on a thread of its own) has finished tearing down;
// false when some had not within `timeout`.
bool awaitDetachedMeshTeardowns(Duration timeout);

class Mesh {
 public:
  using Callback = std::function<void(const Error&)>;
  using SourceCallback = std::function<void(const Error&, int source)>;

  static std::unique_ptr<Mesh> connect(store::Store& store, int rank,
                                       int worldSize, MeshOptions options);
  // Aborts (CANCELLED, "group destroyed"), waits for every callback, closes.
  ~Mesh();
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  int rank() const;
  int size() const;
  const std::string& description() const;

  void sendCollective(int peer, const Fingerprint& fp, uint32_t step,
                      const void* data, size_t bytes, Callback cb);
  void recvCollective(int peer, const Fingerprint& fp, uint32_t step,
                      void* data, size_t bytes, Callback cb);
  void sendTagged(int peer, int64_t tag, DType dtype, const void* data,
                  size_t bytes, Callback cb);
  // peer < 0: from any rank.
  void recvTagged(int peer, int64_t tag, DType dtype, void* data, size_t bytes,
                  SourceCallback cb);

  // Fails the mesh with `reason` (first error wins) and tells every peer.
  void abort(Error reason);
  // Remembers that this rank started `fp`, so a desync error can name what
  // it ran at a peer's sequence number.
  void noteStarted(const Fingerprint& fp);
  // The sticky error; ok while the mesh is healthy.
  Error error() const;
  // Why the pipe to `peer` ended (its process exited, it destroyed its
  // group); ok while it is open. The mesh fails only once a receive from
  // that peer can no longer be met; an algorithm that waits for the peer
  // outside the mesh (host_shm.h) asks here.
  Error linkError(int peer) const;

  class Impl;

 private:
  explicit Mesh(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace trellis::collectives::detail
