// CurveZMQ authentication for the broker's sockets: a ZAP handler (RFC 27)
// on its own thread, in the broker's libzmq context. Each connection's CURVE
// handshake asks it whether the peer's public key is allowed in the socket's
// domain ("clients" on the front, "workers" on the back); an allowed key's
// name (a client's tenant, a worker's name) becomes the User-Id of every
// message on that connection. The allow-lists are replaced at run time, from
// any thread, without touching connections already admitted.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace turbomq::broker {

inline constexpr const char* kClientDomain = "clients";
inline constexpr const char* kWorkerDomain = "workers";

class ZapAuthenticator {
 public:
  // Binds inproc://zeromq.zap.01 in `ctx` (before any CURVE socket binds).
  explicit ZapAuthenticator(void* ctx);
  ~ZapAuthenticator();
  ZapAuthenticator(const ZapAuthenticator&) = delete;
  ZapAuthenticator& operator=(const ZapAuthenticator&) = delete;

  // domain -> {Z85 public key -> name}; a domain not set admits nobody.
  void allow(const std::string& domain, std::map<std::string, std::string> keys);
  void stop();  // before the context terminates

  // Handshakes answered since start: admitted, refused.
  int64_t admitted() const { return admitted_; }
  int64_t refused() const { return refused_; }

 private:
  void run();
  bool lookup(const std::string& domain, const std::string& key, std::string& name);

  void* sock_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> admitted_{0}, refused_{0};
  std::mutex mu_;
  std::map<std::string, std::map<std::string, std::string>> allowed_;
};

}  // namespace turbomq::broker
