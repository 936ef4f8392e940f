#include <trellis/transport/basic/factory.h>
#include <trellis/transport/channel.h>

namespace trellis::transport::basic {

namespace {

class BasicChannel final : public Channel {
 public:
  std::string name() const override { return "basic"; }
  Error viable() const override { return Error(); }
  bool sameHostOnly() const override { return false; }
  bool supportsDevice(const Device& d) const override {
    return d.type == DeviceType::kCpu;
  }
  bool inlineThroughConnection() const override { return true; }
};

}  // namespace

std::shared_ptr<Channel> create() { return std::make_shared<BasicChannel>(); }

}  // namespace trellis::transport::basic
