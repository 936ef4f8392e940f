#pragma once
// Hosts in network namespaces that a test creates: one namespace per host,
// each with a veth into a bridge in one more namespace and an address of
// its own (10.<octet>.<pid % 250>.<i + 1>/24), loopback up. Everything is
// removed, with what runs in it, when the object goes (also when the test
// fails). Needs root: ok() is false otherwise, and after any step that
// failed.
#include <cstdlib>
#include <string>
#include <unistd.h>

namespace trellis::testing {

class NetnsHosts {
 public:
  // `tag` keeps the names of concurrent tests apart; `octet` their subnets.
  NetnsHosts(int n, const std::string& tag, int octet)
      : prefix_(tag + std::to_string(::getpid()) + "x"),
        subnet_("10." + std::to_string(octet) + "." +
                std::to_string(::getpid() % 250) + ".") {
    ok_ = ::geteuid() == 0 && run("ip netns add " + ns("sw")) &&
          run("ip -n " + ns("sw") + " link add br0 type bridge") &&
          run("ip -n " + ns("sw") + " link set br0 up");
    for (int i = 0; ok_ && i < n; ++i) {
      const std::string h = host(i);
      ok_ = run("ip netns add " + h);
      made_ = i + 1;
      ok_ =
          ok_ &&
          run("ip link add v netns " + h + " type veth peer name p" +
              std::to_string(i) + " netns " + ns("sw")) &&
          run("ip -n " + h + " addr add " + address(i) + "/24 dev v") &&
          run("ip -n " + h + " link set v up") &&
          run("ip -n " + h + " link set lo up") &&
          run("ip -n " + ns("sw") + " link set p" + std::to_string(i) +
              " master br0") &&
          run("ip -n " + ns("sw") + " link set p" + std::to_string(i) + " up");
    }
  }
  ~NetnsHosts() {
    for (int i = 0; i < made_; ++i) {
      run("ip netns del " + host(i));
    }
    run("ip netns del " + ns("sw"));
  }
  NetnsHosts(const NetnsHosts&) = delete;
  NetnsHosts& operator=(const NetnsHosts&) = delete;

  bool ok() const { return ok_; }
  std::string ns(const std::string& name) const { return prefix_ + name; }
  // Host i's namespace ("ip netns exec <it> ...").
  std::string host(int i) const { return ns("h" + std::to_string(i)); }
  std::string address(int i) const { return subnet_ + std::to_string(i + 1); }
  // Cuts host i off the bridge (its side of the link goes down).
  bool partition(int i) const {
    return run("ip -n " + ns("sw") + " link set p" + std::to_string(i) +
               " down");
  }

 private:
  static bool run(const std::string& cmd) {
    return std::system((cmd + " 2>/dev/null").c_str()) == 0;
  }
  std::string prefix_;
  std::string subnet_;
  bool ok_ = false;
  int made_ = 0;
};

}  // namespace trellis::testing
