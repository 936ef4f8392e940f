#pragma once

// Internal: what one shm connection shares with its peer, and how the two
// set it up over their UNIX socket (docs/transport.md, "shm transport").
// The connector makes a memfd sealed against resizing and an eventfd and
// sends both with its setup message; the acceptor checks what it got, maps
// it and answers with its own eventfd. Everything received comes from an
// untrusted process. Not installed.

#include <cstddef>
#include <cstdint>
#include <string>
#include <sys/socket.h>
#include <sys/un.h>
#include <vector>

#include <trellis/core/error.h>
#include <trellis/transport/shm/ring.h>

namespace trellis::transport::shm {

// The most descriptors one setup message may carry.
constexpr size_t kMaxFds = 4;

void closeFd(int& fd);
// Linux abstract namespace: no file, gone with the socket.
socklen_t abstractAddress(const std::string& name, sockaddr_un* sa);
bool isEventFd(int fd);

// The mapping and the two eventfds of one connection. Owns them: unmaps
// and closes on reset() and destruction. Move-only.
class Segment final {
 public:
  Segment() = default;
  ~Segment() { reset(); }
  Segment(Segment&& other) noexcept { *this = std::move(other); }
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  void reset();

  bool mapped() const { return map_ != nullptr; }
  // Wake-ups: this side's (read when the peer rings) and the peer's.
  int myEventFd() const { return myEfd_; }
  int peerEventFd() const { return peerEfd_; }
  // This side's ends of the two rings; the connector writes ring 0.
  RingWriter writer(bool connector) const;
  RingReader reader(bool connector) const;

 private:
  friend Error createSegment(size_t, Segment*, int*);
  friend Error acceptSegment(const uint8_t (&)[kSetupBytes], std::vector<int>*,
                             const std::string&, Segment*);
  friend Error completeSegment(const uint8_t (&)[kReplyBytes],
                               std::vector<int>*, const std::string&, Segment*);
  Error map(int memfd, size_t ringBytes, const std::string& who);

  char* map_ = nullptr;
  size_t mapBytes_ = 0;
  size_t ringBytes_ = 0;
  int myEfd_ = -1;
  int peerEfd_ = -1;
};

// Connector: `ringBytes` per direction in a fresh sealed memfd, mapped, its
// header written, and this side's eventfd. `*memfd` is the memfd, for the
// setup message; the caller closes it once sent (the mapping keeps it).
Error createSegment(size_t ringBytes, Segment* out, int* memfd);
// Acceptor: checks the setup message and its descriptors (`fds`: memfd,
// eventfd), maps the segment, checks its header and makes this side's
// eventfd. The peer's eventfd leaves `fds`; the caller closes the rest.
Error acceptSegment(const uint8_t (&setup)[kSetupBytes], std::vector<int>* fds,
                    const std::string& who, Segment* out);
// Connector: checks the acceptor's reply and takes its eventfd from `fds`.
Error completeSegment(const uint8_t (&reply)[kReplyBytes],
                      std::vector<int>* fds, const std::string& who,
                      Segment* seg);

// One setup message with descriptors (SCM_RIGHTS), without blocking.
Error sendWithFds(int sock, const uint8_t* data, size_t len, const int* fds,
                  size_t nfds);
// Reads what is there of a setup message into buf[*got, want), collecting
// the descriptors that come with it. False at EOF or on an error (then
// *error says which), true otherwise, *got < want meaning more to come.
[[nodiscard]] bool receiveWithFds(int sock, uint8_t* buf, size_t want,
                                  size_t* got, std::vector<int>* fds,
                                  const std::string& peer, Error* error);

}  // namespace trellis::transport::shm
