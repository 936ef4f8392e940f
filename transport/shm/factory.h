#pragma once

// The shared-memory transport: same host only (docs/transport.md, "shm
// transport"). Each connection is two single-producer single-consumer byte
// rings in one memfd, one per direction, with an eventfd per side for
// wake-ups; they are set up over a UNIX-domain socket (Linux abstract
// namespace, nothing on disk) that passes the descriptors with SCM_RIGHTS
// and then stays open only so that either side sees the other go (EOF).
//
// Addresses: "shm://" (a fresh name is picked) or "shm://NAME" with NAME of
// 1-100 characters from [A-Za-z0-9._-]; address() reports the real name.
// Both ends must share the network namespace (the socket) of one host.
//
// After activity a connection polls its rings for `spin` before it sleeps
// on its eventfd: a wake-up through the kernel costs tens of microseconds,
// a poll well under one. An idle connection costs no CPU. Unless set, the
// polling follows the process's budget (TRELLIS_SPIN_US, core/spin.h), so
// TRELLIS_SPIN_US=0 turns it off with every other poll in Trellis.
//
// viable() probes memfd_create, sealing, mmap and eventfd once and reports
// why shm cannot work here instead of failing later.

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>

namespace trellis::transport {
class Transport;
}

namespace trellis::transport::shm {

struct Options {
  // Bytes per direction; a power of two in [4 KiB, 1 GiB]. The acceptor
  // takes the connector's choice if it is within those bounds.
  size_t ringBytes = size_t{4} << 20;
  // How long a connection keeps polling after its last activity; 0 sleeps
  // at once (every message then costs a kernel wake-up). Unset: twice
  // spinBudget(), i.e. 100 µs by default and 0 with TRELLIS_SPIN_US=0.
  // Twice, because a ring waits out a round trip through the peer process
  // (its loop, often its worker), where the loop's budget covers a hand-off
  // between two threads of this process.
  std::optional<std::chrono::microseconds> spin;
  // Bound on the descriptor exchange of one connection, on either side.
  std::chrono::milliseconds setupTimeout{10000};
};

std::shared_ptr<Transport> create(Options options = {});

// How long connections made with `options` poll: `options.spin` if set,
// else 2 × spinBudget(). Thread-safe.
std::chrono::microseconds pollingTime(const Options& options);

}  // namespace trellis::transport::shm
