#pragma once

// The basic channel: tensor bytes travel through the pipe's connection,
// inline after the payloads (CPU tensors only). Works between any two
// hosts; Context::create() registers it with priority 100.

#include <memory>

namespace trellis::transport {
class Channel;
}

namespace trellis::transport::basic {

std::shared_ptr<Channel> create();

}  // namespace trellis::transport::basic
