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

bool parse_address(const std::string& address, sockaddr_in* out, std::string* error) {
  std::string host;
  long port = 0;
  if (!wire::split_host_port(address, &host, &port, error)) return false;
  std::memset(out, 0, sizeof(*out));
  out->sin_family = AF_INET;
  out->sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &out->sin_addr) == 1) return true;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    *error = "cannot resolve host '" + host + "' (IPv4)";
    return false;
  }
  out->sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return true;
}

std::string format_address(const sockaddr_in& addr) {
  char buf[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &addr.sin_addr, buf, sizeof(buf));
  return std::string(buf) + ":" + std::to_string(ntohs(addr.sin_port));
}

static void set_nonblocking(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

Fd listen_on(const std::string& host, int port, std::string* bound) {
  sockaddr_in addr;
  std::string error;
  if (!parse_address(host + ":" + std::to_string(port), &addr, &error)) {
    throw std::runtime_error("ftar listen: " + error);
  }
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) throw std::runtime_error(std::string("ftar listen: socket: ") + strerror(errno));
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    throw std::runtime_error("ftar listen: bind " + host + ":" + std::to_string(port) + ": " +
                             strerror(errno));
  }
  if (::listen(fd.get(), 128) != 0) {
    throw std::runtime_error(std::string("ftar listen: listen: ") + strerror(errno));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  set_nonblocking(fd.get());
  *bound = format_address(addr);
  return fd;
}

Fd connect_start(const sockaddr_in& addr, int* error) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) {
    *error = errno;
    return Fd();
  }
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 &&
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
