#pragma once

// The libuv TCP transport: IPv4 and IPv6, TCP_NODELAY, keep-alive.
// Addresses: "uv://127.0.0.1:port", "uv://[::1]:port"; port 0 picks one.

#include <memory>

namespace trellis::transport {
class Transport;
}

namespace trellis::transport::uv {

std::shared_ptr<Transport> create();

}  // namespace trellis::transport::uv
