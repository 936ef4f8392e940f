#pragma once
// The cpu backend (not installed; no libtorch): a Mesh to every rank, one
// worker thread that runs the group's collectives in order with the
// algorithms of algorithms.h, and reusable scratch memory.
#include <memory>

#include <trellis/collectives/backend.h>
#include <trellis/collectives/cpu/mesh.h>

namespace trellis::collectives::detail {

// Connects to every rank (collective; throws like Mesh::connect).
std::unique_ptr<Backend> createCpuBackend(store::Store& store, int rank,
                                          int size, MeshOptions options);

}  // namespace trellis::collectives::detail
