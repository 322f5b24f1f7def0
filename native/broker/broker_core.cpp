// The socket loop: binding, polling, receiving and sending, the frames it builds,
// the per-message demultiplexing, the tick and the stats snapshot.

#include "broker_core.h"

#include <sched.h>
#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "broker_internal.h"

namespace turbomq::broker {

namespace {
constexpr int kDrainBatch = 256;  // messages taken from one socket before looking at the other
}  // namespace

double BrokerCore::now() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

BrokerCore::BrokerCore(BrokerSettings settings, BrokerHooks hooks)
    : settings_(std::move(settings)), hooks_(std::move(hooks)) {
  silence_s_ = settings_.heartbeat_interval * static_cast<double>(settings_.liveness);
  retryable_.insert(settings_.retryable_codes.begin(), settings_.retryable_codes.end());
  ctx_ = zmq_ctx_new();
  if (ctx_ == nullptr) throw std::runtime_error("zmq_ctx_new failed");
  try {
    if (!settings_.curve_secret_key.empty()) {
      if (settings_.curve_secret_key.size() != 40)
        throw std::runtime_error("curve_secret_key must be 40 Z85 characters");
      auth_ = std::make_unique<ZapAuthenticator>(ctx_);  // before any CURVE socket binds
    }
    front_ = router(settings_.front, kClientDomain, front_endpoint_);
    back_ = router(settings_.back, kWorkerDomain, back_endpoint_);
  } catch (...) {
    close();
    throw;
  }
}

BrokerCore::~BrokerCore() { close(); }

void BrokerCore::close() {
  if (front_ != nullptr) zmq_close(front_);
  if (back_ != nullptr) zmq_close(back_);
  front_ = back_ = nullptr;
  if (auth_) auth_->stop();  // its socket too must close before the context ends
  auth_.reset();
  if (ctx_ != nullptr) zmq_ctx_term(ctx_);
  ctx_ = nullptr;
}

void* BrokerCore::router(const std::string& endpoint, const char* domain, std::string& bound) {
  void* sock = zmq_socket(ctx_, ZMQ_ROUTER);
  if (sock == nullptr) throw std::runtime_error("zmq_socket failed");
  int zero = 0, one = 1, hwm = static_cast<int>(settings_.send_hwm);
  // Frames a little over the limit get a frame_too_large reply; far over, the
  // peer's connection is dropped before the frame is buffered.
  int64_t max_size = 4 * settings_.limits.max_frame_bytes;
  zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof zero);
  zmq_setsockopt(sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one);  // a vanished peer fails the send
  zmq_setsockopt(sock, ZMQ_SNDHWM, &hwm, sizeof hwm);
  zmq_setsockopt(sock, ZMQ_RCVHWM, &hwm, sizeof hwm);
  zmq_setsockopt(sock, ZMQ_MAXMSGSIZE, &max_size, sizeof max_size);
  if (auth_) {
    const std::string& key = settings_.curve_secret_key;
    zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &one, sizeof one);
    zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, key.data(), key.size());
    zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, domain, std::char_traits<char>::length(domain));
  }
  if (zmq_bind(sock, endpoint.c_str()) != 0) {
    std::string why = zmq_strerror(zmq_errno());
    zmq_close(sock);
    throw std::runtime_error("cannot bind " + endpoint + ": " + why);
  }
  char buf[1024];
  size_t len = sizeof buf;
  zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, buf, &len);
  bound.assign(buf, len > 0 ? len - 1 : 0);
  return sock;
}

void BrokerCore::log(int level, const std::string& message) const {
  if (hooks_.log) hooks_.log(level, message);
}

// ------------------------------------------------------------------ loop
void BrokerCore::run() {
  zmq_pollitem_t items[2] = {{front_, 0, ZMQ_POLLIN, 0}, {back_, 0, ZMQ_POLLIN, 0}};
  const double interval = settings_.heartbeat_interval;
  const double spin_s = settings_.spin_us * 1e-6;
  double next_tick = now() + interval;
  double spin_until = 0.0;
  while (!stopping_) {
    double t = now();
    int events;
    if (t < spin_until) {
      events = zmq_poll(items, 2, 0);
      // Spinning must not hold off a thread waiting for this CPU: most often
      // our own I/O thread, carrying the next message.
      if (events == 0) sched_yield();
    } else {
      // Rounded up: a timeout truncated to 0 ms would spin until the tick.
      long wait_ms = static_cast<long>(std::ceil((next_tick - t) * 1000.0));
      events = zmq_poll(items, 2, wait_ms > 0 ? wait_ms : 0);
    }
    if (events < 0) {
      if (zmq_errno() == EINTR) {  // a signal: let its handler run
        if (hooks_.check_signals && !hooks_.check_signals()) break;
        continue;
      }
      if (zmq_errno() == ETERM) break;
      throw std::runtime_error(std::string("zmq_poll: ") + zmq_strerror(zmq_errno()));
    }
    if (events > 0) {
      if (items[0].revents & ZMQ_POLLIN) drain(front_, Side::Client);
      if (items[1].revents & ZMQ_POLLIN) drain(back_, Side::Worker);
      t = now();
      spin_until = t + spin_s;
    }
    if (t >= next_tick) {
      tick(t);
      next_tick = t + interval;
      if (hooks_.check_signals && !hooks_.check_signals()) break;
    }
  }
}

void BrokerCore::drain(void* sock, Side side) {
  zmq_msg_t ident, payload, extra;
  zmq_msg_init(&ident);
  zmq_msg_init(&payload);
  zmq_msg_init(&extra);
  for (int i = 0; i < kDrainBatch; ++i) {
    if (zmq_msg_recv(&ident, sock, ZMQ_DONTWAIT) < 0) break;  // EAGAIN: drained
    zmq_msg_recv(&payload, sock, 0);
    // More frames than [routing id, payload]: read them all, refuse the message.
    size_t extra_frames = 0;
    for (bool more = zmq_msg_more(&payload); more; more = zmq_msg_more(&extra)) {
      zmq_msg_recv(&extra, sock, 0);
      ++extra_frames;
    }
    ++stats_.messages_in;
    const std::string who(static_cast<const char*>(zmq_msg_data(&ident)), zmq_msg_size(&ident));
    if (side == Side::Client) {  // the tenant CURVE admitted this connection under
      const char* user = auth_ ? zmq_msg_gets(&payload, "User-Id") : nullptr;
      tenant_.assign(user != nullptr ? user : "");
    }
    const std::string_view frame(static_cast<const char*>(zmq_msg_data(&payload)),
                                 zmq_msg_size(&payload));
    try {
      if (side == Side::Client) on_client_frame(who, frame, extra_frames);
      else on_worker_frame(who, frame, extra_frames);
    } catch (const std::exception& e) {  // a bug in one message must not stop the broker
      log(kError, std::string("failed to handle a message: ") + e.what());
    }
    if (i == 0) {
      // A lone message (the usual case at low load) costs no failed receive.
      int ev = 0;
      size_t len = sizeof ev;
      zmq_getsockopt(sock, ZMQ_EVENTS, &ev, &len);
      if (!(ev & ZMQ_POLLIN)) break;
    }
  }
  zmq_msg_close(&ident);
  zmq_msg_close(&payload);
  zmq_msg_close(&extra);
}

// --------------------------------------------------------------- sending
bool BrokerCore::send_client(const std::string& client, const std::string& frame) {
  // With ROUTER_MANDATORY an unroutable id fails on the first frame, so a
  // message is never half sent.
  if (zmq_send(front_, client.data(), client.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
      zmq_send(front_, frame.data(), frame.size(), ZMQ_DONTWAIT) < 0) {
    int err = zmq_errno();
    if (err == EHOSTUNREACH || err == EAGAIN) {
      client_gone(client, "client_gone");  // gone, or not reading
      return false;
    }
    throw std::runtime_error(std::string("send to client: ") + zmq_strerror(err));
  }
  ++stats_.messages_out;
  return true;
}

bool BrokerCore::send_worker(WorkerPtr worker, const std::string& frame) {
  if (zmq_send(back_, worker->identity.data(), worker->identity.size(),
               ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
      zmq_send(back_, frame.data(), frame.size(), ZMQ_DONTWAIT) < 0) {
    int err = zmq_errno();
    if (err == EHOSTUNREACH || err == EAGAIN) {
      if (worker->alive) worker_lost(worker, "unreachable");
      return false;
    }
    throw std::runtime_error(std::string("send to worker: ") + zmq_strerror(err));
  }
  ++stats_.messages_out;
  return true;
}

void BrokerCore::send_raw(const std::string& ident, const std::string& frame) {
  if (zmq_send(back_, ident.data(), ident.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0)
    zmq_send(back_, frame.data(), frame.size(), ZMQ_DONTWAIT);
}

std::string BrokerCore::error_frame(std::optional<std::string_view> request_id,
                                    std::string_view code, std::string_view message,
                                    std::optional<bool> retryable) {
  msgpack::Writer w = begin_message("error", 4);
  key(w, "request_id");
  if (request_id) w.str(*request_id); else w.nil();
  key(w, "code"); w.str(code);
  key(w, "message"); w.str(message);
  key(w, "retryable");
  w.boolean(retryable ? *retryable : retryable_.count(std::string(code)) > 0);
  return w.take();
}

void BrokerCore::reply_error(const std::string& client, std::optional<std::string_view> request_id,
                             std::string_view code, std::string_view message) {
  send_client(client, error_frame(request_id, code, message));
}

std::string BrokerCore::delta_frame(const Pending& p, int64_t seq, int64_t index,
                                    const int64_t* tokens, size_t n, std::string_view text) {
  msgpack::Writer w = begin_message("delta", 5);
  key(w, "request_id"); w.str(p.request_id);
  key(w, "seq"); w.integer(seq);
  key(w, "index"); w.integer(index);
  key(w, "token_ids"); w.array(static_cast<uint32_t>(n));
  for (size_t k = 0; k < n; ++k) w.integer(tokens[k]);
  key(w, "text"); w.str(text);
  return w.take();
}

std::string BrokerCore::final_frame(const Pending& p, std::string_view reason,
                                    int64_t prompt_tokens, int64_t cached_tokens,
                                    bool with_tokens, std::string_view text) {
  msgpack::Writer w = begin_message("final", 6);
  key(w, "request_id"); w.str(p.request_id);
  key(w, "seq"); w.integer(p.seq);
  key(w, "finish_reason"); w.str(reason);
  key(w, "usage"); w.map(3);
  key(w, "prompt_tokens"); w.integer(prompt_tokens);
  key(w, "cached_tokens"); w.integer(cached_tokens);
  // Includes the tokens of earlier attempts.
  key(w, "completion_tokens"); w.integer(static_cast<int64_t>(p.delivered.size()));
  key(w, "token_ids");
  if (with_tokens) {
    w.array(static_cast<uint32_t>(p.delivered.size()));
    for (int64_t t : p.delivered) w.integer(t);
  } else {
    w.array(0);
  }
  key(w, "text"); w.str(text);
  return w.take();
}

std::string BrokerCore::cancel_frame(const Pending& p) {
  msgpack::Writer w = begin_message("cancel", 2);
  key(w, "request_id"); w.str(p.key);
  key(w, "attempt"); w.integer(p.attempt);
  return w.take();
}

// ---------------------------------------------------------------- frames
std::optional<Rejection> BrokerCore::accept(Side side, std::string_view frame) {
  const auto& limits = settings_.limits;
  const bool parsed = static_cast<int64_t>(frame.size()) <= limits.max_frame_bytes &&
                      doc_.parse(frame.data(), frame.size());
  if (parsed && (side == Side::Client ? fast_client_request(doc_, limits)
                                      : fast_worker_message(doc_, limits)))
    return std::nullopt;
  std::optional<Rejection> rejected = hooks_.validate(side, frame);
  if (!rejected && !parsed && !doc_.parse(frame.data(), frame.size()))
    // The protocol accepts what this reader cannot (nesting past its depth):
    // refuse it plainly rather than leave the sender waiting.
    return Rejection{"bad_frame", "the broker cannot read this frame (nested too deep)",
                     std::nullopt};
  return rejected;
}

void BrokerCore::on_client_frame(const std::string& client, std::string_view frame,
                                 size_t extra_frames) {
  const double t = now();
  client_seen_[client] = t;
  if (extra_frames > 0) {
    ++stats_.frames_rejected["bad_frame"];
    reply_error(client, std::nullopt, "bad_frame",
                "expected one frame per message, got " + std::to_string(extra_frames + 1));
    return;
  }
  if (std::optional<Rejection> rejected = accept(Side::Client, frame)) {
    ++stats_.frames_rejected[rejected->code];
    std::optional<std::string_view> rid;
    if (rejected->request_id) rid = *rejected->request_id;
    reply_error(client, rid, rejected->code, rejected->message);
    return;
  }
  ClientRequest& req = client_req_;
  if (!read_client_request(doc_, req)) throw std::runtime_error("unreadable client request");
  if (req.kind == "generate") {
    on_generate(client, req, t);
  } else if (req.kind == "cancel") {
    on_cancel(client, req.request_id);
  } else if (req.kind == "end_session") {
    on_end_session(client, req);
  } else if (req.kind == "health") {
    msgpack::Writer w = begin_message("health", 5);
    key(w, "request_id"); w.str(req.request_id);
    key(w, "status"); w.str(workers_.empty() ? "degraded" : "ok");
    key(w, "workers"); w.integer(static_cast<int64_t>(workers_.size()));
    key(w, "queue_depth"); w.integer(static_cast<int64_t>(queue_.size()));
    key(w, "inflight"); w.integer(static_cast<int64_t>(requests_.size()));
    send_client(client, w.take());
  } else if (req.kind == "stats") {
    msgpack::Writer w = begin_message("stats", 2);
    key(w, "request_id"); w.str(req.request_id);
    key(w, "stats"); w.raw(stats_snapshot());
    send_client(client, w.take());
  } else if (req.kind == "ping") {
    // Being heard from keeps the client's requests alive; the pong's broker id
    // tells the client whether the broker that holds its requests is still this one.
    msgpack::Writer w = begin_message("pong", 1);
    key(w, "broker_id"); w.str(settings_.broker_id);
    send_client(client, w.take());
  }
}

void BrokerCore::on_worker_frame(const std::string& ident, std::string_view frame,
                                 size_t extra_frames) {
  if (extra_frames > 0) {
    ++stats_.worker_frames_rejected["bad_frame"];
    return;
  }
  if (std::optional<Rejection> rejected = accept(Side::Worker, frame)) {
    ++stats_.worker_frames_rejected[rejected->code];
    log(kWarning, "rejected a frame from a worker: " + rejected->message);
    return;
  }
  WorkerMessage& msg = worker_msg_;
  if (!read_worker_message(doc_, msg)) throw std::runtime_error("unreadable worker message");
  WorkerPtr worker = find_worker(ident);
  if (!worker || msg.kind == "register") {
    if (msg.kind == "register") {
      on_register(ident, msg);
    } else {  // dropped earlier, or the broker restarted
      msgpack::Writer w = begin_message("reconnect", 0);
      send_raw(ident, w.take());
    }
    return;
  }
  worker->expiry = now() + silence_s_;
  if (msg.kind == "delta") on_delta(worker, msg);
  else if (msg.kind == "final") on_final(worker, msg);
  else if (msg.kind == "heartbeat") on_heartbeat(worker, msg);
  else if (msg.kind == "error") on_worker_error(worker, msg);
  else if (msg.kind == "session_ended") on_session_ended(std::string(msg.request_id), nullptr);
}

// ------------------------------------------------------------------ tick
void BrokerCore::tick(double t) {
  const std::vector<WorkerPtr> workers = workers_;
  msgpack::Writer hb = begin_message("heartbeat", 0);
  const std::string heartbeat = hb.take();
  for (const WorkerPtr& w : workers) {
    if (!w->alive) continue;
    if (t > w->expiry) worker_lost(w, "missed heartbeats");
    else send_worker(w, heartbeat);
  }
  const double silent_before = t - settings_.client_timeout;
  std::vector<std::string> silent;
  for (const auto& kv : client_requests_) {
    auto seen = client_seen_.find(kv.first);
    if (seen == client_seen_.end() || seen->second < silent_before) silent.push_back(kv.first);
  }
  for (const std::string& c : silent) client_gone(c, "client_gone");
  for (auto c = client_seen_.begin(); c != client_seen_.end();)
    c = c->second < silent_before && !client_requests_.count(c->first) ? client_seen_.erase(c)
                                                                        : std::next(c);
  std::vector<PendingPtr> pending;
  for (const auto& kv : requests_) pending.push_back(kv.second);
  std::sort(pending.begin(), pending.end(),
            [](const PendingPtr& a, const PendingPtr& b) { return a->number < b->number; });
  for (const PendingPtr& p : pending) {
    if (!requests_.count(p->key)) continue;  // released by an earlier one's handling
    if (p->client_done) {
      if (t > p->release_at) release(p);  // the worker never confirmed the cancel
    } else if (p->cancelling && t > p->release_at) {
      cancelled_final(p);
    } else if (t > p->deadline) {
      last_reply(p, error_frame(std::string_view(p->request_id), "timeout",
                                "the request's deadline passed"));
      abandon(p, "timeout");
    }
  }
  std::vector<std::string> expired;
  for (const auto& kv : pending_ends_)
    if (t > kv.second->deadline) expired.push_back(kv.first);
  for (const std::string& k : expired) {
    auto end = pending_ends_[k];
    pending_ends_.erase(k);
    send_client(end->client, error_frame(std::string_view(end->request_id), "timeout",
                                         "the worker did not answer end_session"));
  }
  if (hooks_.tick) {
    try {
      hooks_.tick(stats_snapshot(), finished_durations_, queue_waits_);
    } catch (const std::exception& e) {  // metrics must not stop the broker
      log(kError, std::string("the tick hook failed: ") + e.what());
    }
    finished_durations_.clear();
    queue_waits_.clear();
  }
}

void BrokerCore::allow(const std::string& domain, std::map<std::string, std::string> keys) {
  if (!auth_) throw std::runtime_error("allow() needs a broker with a curve_secret_key");
  auth_->allow(domain, std::move(keys));
}

std::string BrokerCore::stats_snapshot() const {
  msgpack::Writer w;
  auto counts = [&](const char* name, const std::map<std::string, int64_t>& m) {
    key(w, name);
    w.map(static_cast<uint32_t>(m.size()));
    for (const auto& kv : m) {
      w.str(kv.first);
      w.integer(kv.second);
    }
  };
  auto count = [&](const char* name, int64_t v) {
    key(w, name);
    w.integer(v);
  };
  int64_t slots_total = 0, slots_free = 0;
  for (const WorkerPtr& wk : workers_) {
    slots_total += wk->slots;
    slots_free += wk->free_slots();
  }
  w.map(25);
  key(w, "tenant_outcomes");
  w.map(static_cast<uint32_t>(stats_.tenant_outcomes.size()));
  for (const auto& t : stats_.tenant_outcomes) {
    w.str(t.first);
    w.map(static_cast<uint32_t>(t.second.size()));
    for (const auto& kv : t.second) {
      w.str(kv.first);
      w.integer(kv.second);
    }
  }
  count("auth_admitted", auth_ ? auth_->admitted() : 0);
  count("auth_refused", auth_ ? auth_->refused() : 0);
  count("requests_received", stats_.requests_received);
  count("requests_resumed", stats_.requests_resumed);
  counts("requests_by_outcome", stats_.outcomes);
  counts("routing", stats_.routing);
  counts("frames_rejected", stats_.frames_rejected);
  counts("worker_frames_rejected", stats_.worker_frames_rejected);
  count("redispatches", stats_.redispatches);
  count("redispatches_resumed", stats_.redispatches_resumed);
  count("duplicates_dropped", stats_.duplicates_dropped);
  count("stale_dropped", stats_.stale_dropped);
  count("cancels_forwarded", stats_.cancels_forwarded);
  count("workers_registered", stats_.workers_registered);
  count("workers_lost", stats_.workers_lost);
  count("messages_in", stats_.messages_in);
  count("messages_out", stats_.messages_out);
  count("queue_depth", static_cast<int64_t>(queue_.size()));
  count("workers_alive", static_cast<int64_t>(workers_.size()));
  count("inflight", static_cast<int64_t>(requests_.size()));
  count("slots_total", slots_total);
  count("slots_free", slots_free);
  count("sessions_tracked", static_cast<int64_t>(affinity_.size()));
  count("clients", static_cast<int64_t>(client_requests_.size()));
  return w.take();
}

}  // namespace turbomq::broker
