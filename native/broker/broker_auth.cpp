// The ZAP handler behind the broker's CURVE sockets (see broker_auth.h).

#include "broker_auth.h"

#include <zmq.h>

#include <stdexcept>
#include <vector>

namespace turbomq::broker {

namespace {
std::string frame_string(zmq_msg_t& m) {
  return std::string(static_cast<const char*>(zmq_msg_data(&m)), zmq_msg_size(&m));
}

void send_frames(void* sock, const std::vector<std::string>& frames) {
  for (size_t i = 0; i < frames.size(); ++i)
    zmq_send(sock, frames[i].data(), frames[i].size(), i + 1 < frames.size() ? ZMQ_SNDMORE : 0);
}
}  // namespace

ZapAuthenticator::ZapAuthenticator(void* ctx) {
  sock_ = zmq_socket(ctx, ZMQ_REP);
  if (sock_ == nullptr) throw std::runtime_error("zmq_socket failed for the ZAP handler");
  int zero = 0;
  zmq_setsockopt(sock_, ZMQ_LINGER, &zero, sizeof zero);
  if (zmq_bind(sock_, "inproc://zeromq.zap.01") != 0) {
    zmq_close(sock_);
    throw std::runtime_error(std::string("cannot bind the ZAP handler: ") + zmq_strerror(zmq_errno()));
  }
  thread_ = std::thread([this] { run(); });
}

ZapAuthenticator::~ZapAuthenticator() { stop(); }

void ZapAuthenticator::stop() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
  if (sock_ != nullptr) zmq_close(sock_);
  sock_ = nullptr;
}

void ZapAuthenticator::allow(const std::string& domain, std::map<std::string, std::string> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  allowed_[domain] = std::move(keys);
}

bool ZapAuthenticator::lookup(const std::string& domain, const std::string& key, std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto d = allowed_.find(domain);
  if (d == allowed_.end()) return false;
  auto k = d->second.find(key);
  if (k == d->second.end()) return false;
  name = k->second;
  return true;
}

void ZapAuthenticator::run() {
  zmq_pollitem_t item{sock_, 0, ZMQ_POLLIN, 0};
  while (!stopping_) {
    if (zmq_poll(&item, 1, 100) <= 0) continue;  // timeout: look at stopping_ again
    // version, request id, domain, address, identity, mechanism, credentials...
    std::vector<std::string> frames;
    zmq_msg_t m;
    zmq_msg_init(&m);
    bool more = true;
    while (more && zmq_msg_recv(&m, sock_, 0) >= 0) {
      frames.push_back(frame_string(m));
      more = zmq_msg_more(&m);
    }
    zmq_msg_close(&m);
    if (frames.size() < 6) {  // not a ZAP request: answer so the REP socket stays in step
      send_frames(sock_, {"1.0", frames.size() > 1 ? frames[1] : "", "500", "malformed request", "", ""});
      continue;
    }
    const std::string& request_id = frames[1];
    const std::string& domain = frames[2];
    const std::string& mechanism = frames[5];
    std::string name;
    bool ok = false;
    if (mechanism == "CURVE" && frames.size() >= 7 && frames[6].size() == 32) {
      char z85[41];
      zmq_z85_encode(z85, reinterpret_cast<const uint8_t*>(frames[6].data()), 32);
      ok = lookup(domain, std::string(z85, 40), name);
    }
    (ok ? admitted_ : refused_)++;
    send_frames(sock_, {"1.0", request_id, ok ? "200" : "400", ok ? "OK" : "key not allowed",
                        ok ? name : "", ""});
  }
}

}  // namespace turbomq::broker
