#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

#include <trellis/transport/shm/segment.h>

namespace trellis::transport::shm {

void closeFd(int& fd) {
  if (fd >= 0) {
    ::close(fd);
    fd = -1;
  }
}

socklen_t abstractAddress(const std::string& name, sockaddr_un* sa) {
  std::memset(sa, 0, sizeof(*sa));
  sa->sun_family = AF_UNIX;
  // Leading NUL: Linux abstract namespace, no file, gone with the socket.
  std::memcpy(sa->sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 +
                                name.size());
}

bool isEventFd(int fd) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
  char target[64] = {0};
  const ssize_t n = ::readlink(path, target, sizeof(target) - 1);
  return n > 0 && std::string_view(target, static_cast<size_t>(n)) ==
                      "anon_inode:[eventfd]";
}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    reset();
    map_ = std::exchange(other.map_, nullptr);
    mapBytes_ = std::exchange(other.mapBytes_, 0);
    ringBytes_ = std::exchange(other.ringBytes_, 0);
    myEfd_ = std::exchange(other.myEfd_, -1);
    peerEfd_ = std::exchange(other.peerEfd_, -1);
  }
  return *this;
}

void Segment::reset() {
  if (map_ != nullptr) {
    ::munmap(map_, mapBytes_);
    map_ = nullptr;
  }
  mapBytes_ = ringBytes_ = 0;
  closeFd(myEfd_);
  closeFd(peerEfd_);
}

RingWriter Segment::writer(bool connector) const {
  const int ring = connector ? 0 : 1;
  return RingWriter(
      reinterpret_cast<RingControl*>(map_ + kRingControlOffset[ring]),
      map_ + ringDataOffset(ring, ringBytes_), ringBytes_);
}

RingReader Segment::reader(bool connector) const {
  const int ring = connector ? 1 : 0;
  return RingReader(
      reinterpret_cast<RingControl*>(map_ + kRingControlOffset[ring]),
      map_ + ringDataOffset(ring, ringBytes_), ringBytes_);
}

Error Segment::map(int memfd, size_t ringBytes, const std::string& who) {
  const size_t total = segmentBytes(ringBytes);
  void* p =
      ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  if (p == MAP_FAILED) {
    return Error::fromErrno(errno, who + "mmap");
  }
  map_ = static_cast<char*>(p);
  mapBytes_ = total;
  ringBytes_ = ringBytes;
  return Error();
}

Error createSegment(size_t ringBytes, Segment* out, int* memfd) {
  Segment seg;
  const size_t total = segmentBytes(ringBytes);
  *memfd = ::memfd_create("trellis-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (*memfd < 0) {
    return Error::fromErrno(errno, "shm: memfd_create");
  }
  if (::ftruncate(*memfd, static_cast<off_t>(total)) != 0) {
    return Error::fromErrno(errno, "shm: ftruncate");
  }
  // The acceptor refuses a segment that could shrink under its mapping
  // (which would turn its accesses into SIGBUS).
  if (::fcntl(*memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) !=
      0) {
    return Error::fromErrno(errno, "shm: seal memfd");
  }
  if (Error e = seg.map(*memfd, ringBytes, "shm: "); !e.ok()) {
    return e;
  }
  writeSegmentHeader(seg.map_, ringBytes);
  seg.myEfd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (seg.myEfd_ < 0) {
    return Error::fromErrno(errno, "shm: eventfd");
  }
  *out = std::move(seg);
  return Error();
}

Error acceptSegment(const uint8_t (&setup)[kSetupBytes], std::vector<int>* fds,
                    const std::string& who, Segment* out) {
  uint64_t ring = 0;
  if (Error e = decodeSetup(setup, who, &ring); !e.ok()) {
    return e;
  }
  if (fds->size() != 2) {
    return Error::protocol(who + ": expected 2 descriptors, got " +
                           std::to_string(fds->size()));
  }
  const int memfd = (*fds)[0];
  const size_t total = segmentBytes(static_cast<size_t>(ring));
  struct stat st;
  if (::fstat(memfd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return Error::protocol(who + ": the segment descriptor is not a file");
  }
  if (static_cast<uint64_t>(st.st_size) != total) {
    return Error::protocol(who + ": segment has " + std::to_string(st.st_size) +
                           " bytes, expected " + std::to_string(total));
  }
  const int seals = ::fcntl(memfd, F_GET_SEALS);
  if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) !=
                       (F_SEAL_SHRINK | F_SEAL_GROW)) {
    return Error::protocol(who +
                           ": segment is not a memfd sealed against "
                           "resizing");
  }
  if (!isEventFd((*fds)[1])) {
    return Error::protocol(who + ": the wake-up descriptor is not an eventfd");
  }
  Segment seg;
  if (Error e = seg.map(memfd, static_cast<size_t>(ring), who + ": ");
      !e.ok()) {
    return e;
  }
  if (Error e = checkSegmentHeader(seg.map_, ring, who); !e.ok()) {
    return e;
  }
  seg.myEfd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (seg.myEfd_ < 0) {
    return Error::fromErrno(errno, "shm: eventfd");
  }
  seg.peerEfd_ = (*fds)[1];
  fds->pop_back();
  *out = std::move(seg);
  return Error();
}

Error completeSegment(const uint8_t (&reply)[kReplyBytes],
                      std::vector<int>* fds, const std::string& who,
                      Segment* seg) {
  if (Error e = decodeReply(reply, who); !e.ok()) {
    return e;
  }
  if (fds->size() != 1 || !isEventFd((*fds)[0])) {
    return Error::protocol(who + ": reply does not carry one eventfd");
  }
  seg->peerEfd_ = (*fds)[0];
  fds->clear();
  return Error();
}

Error sendWithFds(int sock, const uint8_t* data, size_t len, const int* fds,
                  size_t nfds) {
  iovec iov{const_cast<uint8_t*>(data), len};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)] = {0};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
  std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n < 0) {
    return Error::fromErrno(errno, "shm setup: sendmsg");
  }
  if (static_cast<size_t>(n) != len) {
    // A fresh UNIX socket always has room for a few bytes.
    return Error::connection("shm setup: short sendmsg");
  }
  return Error();
}

bool receiveWithFds(int sock, uint8_t* buf, size_t want, size_t* got,
                    std::vector<int>* fds, const std::string& peer,
                    Error* error) {
  iovec iov{buf + *got, want - *got};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = ::recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) {
    if (errno == EAGAIN || errno == EINTR) {
      return true;
    }
    *error = Error::fromErrno(errno, "shm setup with " + peer);
    return false;
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
       c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds->push_back(fd);
      }
    }
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0) {
    *error = Error::protocol("shm setup with " + peer +
                             ": too many descriptors sent");
    return false;
  }
  if (n == 0) {
    *error = Error::connection("shm setup with " + peer +
                               ": peer closed the socket");
    return false;
  }
  *got += static_cast<size_t>(n);
  return true;
}

}  // namespace trellis::transport::shm
