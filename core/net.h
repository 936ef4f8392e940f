#pragma once

// Which local address a process advertises to its peers (DESIGN.md, "one
// way to choose the network interface"). Store, RPC and collectives all ask
// here, so one flag or variable moves every layer to the same interface.
//
// Order of precedence, first match wins:
//   1. `explicitAddress` (an option or a --local-addr flag), if non-empty;
//   2. TRELLIS_LOCAL_ADDR, an IPv4 or IPv6 literal;
//   3. TRELLIS_IFNAME, the name of an interface: its first IPv4 address, else
//      its first IPv6 address;
//   4. the address the kernel would use to reach `peerHint` (a host name or
//      address, e.g. MASTER_ADDR), found with a connected UDP socket that
//      sends nothing;
//   5. 127.0.0.1.
// A malformed value, an unknown interface or one without an address is an
// InvalidArgumentError naming the variable and the value: a wrong interface
// is never silently replaced by another one.

#include <string>

namespace trellis::net {

std::string chooseLocalAddress(const std::string& explicitAddress,
                               const std::string& peerHint);

// True for an IPv4 or IPv6 literal (no brackets).
bool isIpLiteral(const std::string& s);
// "[::1]" for IPv6 literals, the input otherwise (for host:port strings).
std::string bracketIfIpv6(const std::string& host);

}  // namespace trellis::net
