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
#include <trellis/transport/listener.h>
#include <trellis/transport/message.h>
#include <trellis/transport/pipe.h>

namespace trellis::bench {

// Reads `count` messages from `reader`, each into `size` bytes that
// `take()` returns when its descriptor arrives (`give(p)` gets them back
// once read), as a payload or as one CPU tensor when `asTensor`, while
// `send(i)` writes message i on the other end; returns GB/s from the first
// send to the last read. A failed read ends the program through
// Future::wait.
inline double oneWayThroughput(const std::shared_ptr<transport::Pipe>& reader,
                               size_t size, size_t count, bool asTensor,
                               const std::function<void(size_t)>& send,
                               const std::function<uint8_t*()>& take,
                               const std::function<void(uint8_t*)>& give) {
  Promise<void> done;
  size_t received = 0;
  std::function<void()> readNext = [&] {
    reader->readDescriptor([&](const Error& e, transport::Descriptor) {
      if (!e.ok()) {
        Promise<void>(done).setError(e);
        return;
      }
      uint8_t* into = take();
      transport::Allocation a;
      (asTensor ? a.tensors : a.payloads).push_back({into, size});
      reader->read(std::move(a), [&, into](const Error& e) {
        give(into);
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

// The next pipe `listener` accepts, waiting at most `limit`; throws the
// acceptance's error.
inline std::shared_ptr<transport::Pipe> acceptOne(
    transport::Listener& listener, std::chrono::milliseconds limit) {
  Promise<std::shared_ptr<transport::Pipe>> accepted;
  listener.accept([accepted](const Error& e,
                             std::shared_ptr<transport::Pipe> pipe) mutable {
    e.ok() ? accepted.setValue(pipe) : accepted.setError(e);
  });
  return accepted.getFuture().wait(limit);
}

// The same, every message into the `size` bytes at `dst`.
inline double oneWayThroughput(const std::shared_ptr<transport::Pipe>& reader,
                               uint8_t* dst, size_t size, size_t count,
                               bool asTensor,
                               const std::function<void(size_t)>& send) {
  return oneWayThroughput(
      reader, size, count, asTensor, send, [dst] { return dst; },
      [](uint8_t*) {});
}

}  // namespace trellis::bench
