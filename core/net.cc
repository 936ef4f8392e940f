#include <arpa/inet.h>
#include <cstdlib>
#include <cstring>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <trellis/core/error.h>
#include <trellis/core/net.h>

namespace trellis::net {
namespace {

std::string envOr(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

std::string addressOfInterface(const std::string& ifname) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) {
    throwError(Error::fromErrno(errno, "getifaddrs"));
  }
  std::string v4;
  std::string v6;
  bool found = false;
  for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_name == nullptr || ifname != it->ifa_name) {
      continue;
    }
    found = true;
    if (it->ifa_addr == nullptr) {
      continue;
    }
    char buf[INET6_ADDRSTRLEN] = {};
    if (it->ifa_addr->sa_family == AF_INET && v4.empty()) {
      const auto* sin = reinterpret_cast<const sockaddr_in*>(it->ifa_addr);
      ::inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf));
      v4 = buf;
    } else if (it->ifa_addr->sa_family == AF_INET6 && v6.empty()) {
      const auto* sin6 = reinterpret_cast<const sockaddr_in6*>(it->ifa_addr);
      if (IN6_IS_ADDR_LINKLOCAL(&sin6->sin6_addr)) {
        continue;  // needs a scope id; peers cannot use it as is
      }
      ::inet_ntop(AF_INET6, &sin6->sin6_addr, buf, sizeof(buf));
      v6 = buf;
    }
  }
  ::freeifaddrs(list);
  if (!found) {
    throwError(Error::invalidArgument("TRELLIS_IFNAME='" + ifname +
                                      "': no such network interface"));
  }
  if (v4.empty() && v6.empty()) {
    throwError(Error::invalidArgument(
        "TRELLIS_IFNAME='" + ifname +
        "': the interface has no IPv4 or non-link-local IPv6 address"));
  }
  return v4.empty() ? v6 : v4;
}

// The source address the routing table picks for `host`; empty if none.
std::string routeTo(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || res == nullptr) {
    return {};
  }
  std::string out;
  const int fd = ::socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    if (::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
        char buf[INET6_ADDRSTRLEN] = {};
        if (ss.ss_family == AF_INET) {
          ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr,
                      buf, sizeof(buf));
        } else {
          ::inet_ntop(AF_INET6,
                      &reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr, buf,
                      sizeof(buf));
        }
        out = buf;
      }
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return out;
}

}  // namespace

bool isIpLiteral(const std::string& s) {
  in6_addr a6{};
  in_addr a4{};
  return ::inet_pton(AF_INET, s.c_str(), &a4) == 1 ||
         ::inet_pton(AF_INET6, s.c_str(), &a6) == 1;
}

std::string bracketIfIpv6(const std::string& host) {
  in6_addr a6{};
  if (::inet_pton(AF_INET6, host.c_str(), &a6) == 1) {
    return "[" + host + "]";
  }
  return host;
}

std::string chooseLocalAddress(const std::string& explicitAddress,
                               const std::string& peerHint) {
  if (!explicitAddress.empty()) {
    if (!isIpLiteral(explicitAddress)) {
      throwError(Error::invalidArgument("local address '" + explicitAddress +
                                        "' is not an IPv4 or IPv6 literal"));
    }
    return explicitAddress;
  }
  const std::string fromEnv = envOr("TRELLIS_LOCAL_ADDR");
  if (!fromEnv.empty()) {
    if (!isIpLiteral(fromEnv)) {
      throwError(Error::invalidArgument("TRELLIS_LOCAL_ADDR='" + fromEnv +
                                        "' is not an IPv4 or IPv6 literal"));
    }
    return fromEnv;
  }
  const std::string ifname = envOr("TRELLIS_IFNAME");
  if (!ifname.empty()) {
    return addressOfInterface(ifname);
  }
  if (!peerHint.empty()) {
    std::string routed = routeTo(peerHint);
    if (!routed.empty()) {
      return routed;
    }
  }
  return "127.0.0.1";
}

}  // namespace trellis::net
