#pragma once
// The nccl backend (not installed; no libtorch, and no CUDA or NCCL type in
// this header): the group's ops on NCCL communicators, one per CUDA device
// the group is used on (docs/collectives_nccl.md).
//
//  - A device's communicator is made on the first op on that device (p2p
//    included), collectively: every rank of the group must issue an op
//    there. Rank 0 publishes the ncclUniqueId in the group's store; the
//    others wait for it up to the group's timeout. Communicators are
//    numbered in the order a rank first uses its devices, so rank r on
//    cuda:r meets the others in one communicator.
//  - Each op runs on an internal stream of its device, after the work
//    enqueued on the caller's stream (OpSpec::stream) so far; the caller's
//    stream then waits for the op. Nothing blocks the host.
//  - `started` fires once the op is on the stream, from the issuing call;
//    `done` fires from poll() once the GPU finished it, or with the error
//    that failed it. A launch error is sticky: poll() returns it so the
//    watchdog aborts the group.
//  - abort(): ncclCommAbort on every communicator, every pending and later
//    op fails with the reason. Idempotent; any thread.
//  - Not supported: receive from any source (recv with peer < 0 fails).
//    Bitwise reductions are refused by the front end.
//
// Thread safety: every method may be called from any thread. Launches are
// serialised; poll() never waits for one (it skips the asynchronous-error
// check while a launch holds the communicators).
#include <memory>

#include <trellis/collectives/backend.h>
#include <trellis/collectives/cpu/mesh.h>

namespace trellis::store {
class Store;
}

namespace trellis::collectives::detail {

// Makes no communicator yet (see above); throws FailedPreconditionError
// when no CUDA device is visible. `store` is the group's store (prefixed),
// kept for the communicators made later.
std::unique_ptr<Backend> createNcclBackend(std::shared_ptr<store::Store> store,
                                           int rank, int size,
                                           MeshOptions options);

}  // namespace trellis::collectives::detail
