#pragma once

// The one-way pipe throughput loop that transport_bench and
// collectives_bench share (the latter as its baseline for the forced
// cross-host ring).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include <trellis/core/error.h>
#include <trellis/core/future.h>
#include <trellis/transport/message.h>
#include <trellis/transport/pipe.h>

namespace trellis::bench {

// Reads `count` messages from `reader`, each into the `size` bytes at `dst`
// (as a payload, or as one CPU tensor when `asTensor`), while `send(i)`
// writes message i on the other end; returns GB/s from the first send to
// the last read. A failed read ends the program through Future::wait.
inline double oneWayThroughput(const std::shared_ptr<transport::Pipe>& reader,
                               uint8_t* dst, size_t size, size_t count,
                               bool asTensor,
                               const std::function<void(size_t)>& send) {
  Promise<void> done;
  size_t received = 0;
  std::function<void()> readNext = [&] {
    reader->readDescriptor([&](const Error& e, transport::Descriptor) {
      if (!e.ok()) {
        Promise<void>(done).setError(e);
        return;
      }
      transport::Allocation a;
      (asTensor ? a.tensors : a.payloads).push_back({dst, size});
      reader->read(std::move(a), [&](const Error& e) {
        if (!e.ok()) {
          Promise<void>(done).setError(e);
        } else if (++received == count) {
          Promise<void>(done).setValue();
        } else {
          readNext();
        }
      });
    });
  };
  readNext();
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < count; ++i) {
    send(i);
  }
  done.getFuture().wait(std::chrono::seconds(120));
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  return static_cast<double>(count * size) / secs / 1e9;
}

}  // namespace trellis::bench
