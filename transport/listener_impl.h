#pragma once

// Internal: the object behind Listener (listener.cc; its same-host upgrade
// address in upgrade.cc). Not installed.

#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <trellis/transport/context_impl.h>
#include <trellis/transport/lifecycle.h>
#include <trellis/transport/listener.h>
#include <trellis/transport/transport.h>

namespace trellis::transport {

class UpgradeBinder;

class ListenerImpl final : public std::enable_shared_from_this<ListenerImpl> {
 public:
  ListenerImpl(std::shared_ptr<ContextImpl> ctx, std::string id);
  // Loop thread.
  Error listenFromLoop(const std::vector<std::string>& addresses);
  void accept(Listener::AcceptCallback cb);
  void close();
  // The first error fails the listener for good (Lifecycle).
  void failFromLoop(const Error& error);
  const std::map<std::string, std::string>& addresses() const {
    return addresses_;
  }
  const std::string& id() const { return id_; }

 private:
  void onConnection(const std::string& transport, const Error& error,
                    std::shared_ptr<Connection> conn);
  // upgrade.cc: the automatic shm:// address and its bind connections.
  void listenForUpgrades();
  void onUpgradeConnection(const Error& error,
                           std::shared_ptr<Connection> conn);
  void closeUpgradesFromLoop();
  void serveFromLoop();
  void teardownFromLoop(const Error& error);

  std::shared_ptr<ContextImpl> ctx_;
  const std::string id_;
  std::map<std::string, std::string> addresses_;  // written before returned
  // Loop thread only.
  Lifecycle life_;
  std::vector<std::unique_ptr<ConnectionListener>> listeners_;
  PendingCallbacks<std::shared_ptr<Pipe>> accepts_;
  std::deque<std::shared_ptr<PipeImpl>> ready_;
  // The automatic shm:// listener for same-host upgrades ("" when none).
  std::unique_ptr<ConnectionListener> upgradeListener_;
  std::string upgradeAddress_;
  std::set<std::shared_ptr<UpgradeBinder>> binders_;

  friend class UpgradeBinder;
};

}  // namespace trellis::transport
