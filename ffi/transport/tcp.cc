#include "transport/tcp.h"
#include "transport/wire.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

namespace fthsdp::tcp {

void Fd::reset() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

bool parse_address(const std::string& address, Address* out, std::string* error) {
  std::string host;
  long port = 0;
  if (!wire::split_host_port(address, &host, &port, error)) return false;
  *out = Address{};
  const uint16_t nport = htons(static_cast<uint16_t>(port));
  sockaddr_in v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4.sin_addr) == 1) {
    v4.sin_family = AF_INET;
    v4.sin_port = nport;
    std::memcpy(&out->storage, &v4, sizeof(v4));
    out->len = sizeof(v4);
    return true;
  }
  sockaddr_in6 v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6.sin6_addr) == 1) {
    v6.sin6_family = AF_INET6;
    v6.sin6_port = nport;
    std::memcpy(&out->storage, &v6, sizeof(v6));
    out->len = sizeof(v6);
    return true;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr ||
      res->ai_addrlen > sizeof(out->storage)) {
    if (res != nullptr) freeaddrinfo(res);
    *error = "cannot resolve host '" + host + "'";
    return false;
  }
  std::memcpy(&out->storage, res->ai_addr, res->ai_addrlen);
  out->len = res->ai_addrlen;
  freeaddrinfo(res);
  if (out->family() == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&out->storage)->sin_port = nport;
  } else if (out->family() == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(&out->storage)->sin6_port = nport;
  } else {
    *error = "host '" + host + "' resolves to neither IPv4 nor IPv6";
    return false;
  }
  return true;
}

std::string format_address(const sockaddr* addr) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (addr->sa_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(addr);
    inet_ntop(AF_INET6, &v6->sin6_addr, buf, sizeof(buf));
    return wire::join_host_port(buf, ntohs(v6->sin6_port));
  }
  const auto* v4 = reinterpret_cast<const sockaddr_in*>(addr);
  inet_ntop(AF_INET, &v4->sin_addr, buf, sizeof(buf));
  return wire::join_host_port(buf, ntohs(v4->sin_port));
}

static void set_nonblocking(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

Fd listen_on(const std::string& host, int port, std::string* bound) {
  Address addr;
  std::string error;
  if (!parse_address(wire::join_host_port(host, port), &addr, &error)) {
    throw std::runtime_error("ftar listen: " + error);
  }
  Fd fd(::socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) throw std::runtime_error(std::string("ftar listen: socket: ") + strerror(errno));
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), addr.get(), addr.len) != 0) {
    throw std::runtime_error("ftar listen: bind " + wire::join_host_port(host, port) + ": " +
                             strerror(errno));
  }
  if (::listen(fd.get(), 128) != 0) {
    throw std::runtime_error(std::string("ftar listen: listen: ") + strerror(errno));
  }
  sockaddr_storage got{};
  socklen_t len = sizeof(got);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&got), &len);
  set_nonblocking(fd.get());
  *bound = format_address(reinterpret_cast<const sockaddr*>(&got));
  return fd;
}

Fd connect_start(const Address& addr, int* error) {
  Fd fd(::socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) {
    *error = errno;
    return Fd();
  }
  if (::connect(fd.get(), addr.get(), addr.len) != 0 &&
      errno != EINPROGRESS) {
    *error = errno;
    return Fd();
  }
  *error = 0;
  return fd;
}

int connect_result(int fd) {
  int err = 0;
  socklen_t len = sizeof(err);
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
  return err;
}

Fd accept_one(int listen_fd) {
  const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  return Fd(fd);
}

void tune_stream(int fd, int buffer_bytes) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (buffer_bytes > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof(buffer_bytes));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof(buffer_bytes));
  }
  set_nonblocking(fd);
}

Io send_two(int fd, const void* a, size_t a_len, const void* b, size_t b_len, size_t* done,
            int* err) {
  iovec iov[2];
  int cnt = 0;
  size_t d = *done;
  if (d < a_len) {
    iov[cnt].iov_base = const_cast<char*>(static_cast<const char*>(a) + d);
    iov[cnt].iov_len = a_len - d;
    ++cnt;
    d = 0;
  } else {
    d -= a_len;
  }
  if (d < b_len) {
    iov[cnt].iov_base = const_cast<char*>(static_cast<const char*>(b) + d);
    iov[cnt].iov_len = b_len - d;
    ++cnt;
  }
  if (cnt == 0) return Io::kProgress;
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = cnt;
  const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n > 0) {
    *done += static_cast<size_t>(n);
    return Io::kProgress;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return Io::kWouldBlock;
  *err = n < 0 ? errno : 0;
  return (n < 0 && errno != EPIPE && errno != ECONNRESET) ? Io::kError : Io::kClosed;
}

Io recv_into(int fd, void* buf, size_t len, size_t* done, int* err) {
  if (*done >= len) return Io::kProgress;
  const ssize_t n = ::recv(fd, static_cast<char*>(buf) + *done, len - *done, MSG_DONTWAIT);
  if (n > 0) {
    *done += static_cast<size_t>(n);
    return Io::kProgress;
  }
  if (n == 0) {
    *err = 0;
    return Io::kClosed;
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Io::kWouldBlock;
  *err = errno;
  return errno == ECONNRESET ? Io::kClosed : Io::kError;
}

}  // namespace fthsdp::tcp
