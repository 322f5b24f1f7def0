#include "broker_core.h"

#include <sched.h>
#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace turbomq::broker {

namespace {
constexpr int kDrainBatch = 256;  // messages taken from one socket before looking at the other
constexpr int kDebug = 10, kInfo = 20, kWarning = 30, kError = 40;

// Python's repr of a short str, near enough for a message: 'text'.
std::string quoted(std::string_view s) { return "'" + std::string(s) + "'"; }

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%llx", static_cast<unsigned long long>(v));
  return buf;
}

void key(msgpack::Writer& w, const char* name) { w.str(name); }

// A message map of `fields` fields besides v and kind, those two written.
msgpack::Writer begin_message(const char* kind, uint32_t fields) {
  msgpack::Writer w;
  w.map(fields + 2);
  key(w, "v"); w.integer(1);
  key(w, "kind"); w.str(kind);
  return w;
}
}  // namespace

struct BrokerCore::Worker {
  std::string identity;  // routing id on the back socket
  std::string worker_id, model;
  int64_t slots = 0, kv_blocks = 0;
  double expiry = 0.0;  // dropped when not heard from by then
  int64_t free_kv_blocks = 0;
  int64_t queue_len = 0;  // the worker's own backlog, from heartbeats
  std::unordered_set<std::string> sessions;  // session ids it reports resident
  std::unordered_map<std::string, PendingPtr> inflight;  // broker key -> request
  bool alive = true;
  // The broker's own count is current; a heartbeat's is up to an interval old.
  int64_t free_slots() const { return slots - static_cast<int64_t>(inflight.size()); }
};

// One generate request from accept to its final reply.
struct BrokerCore::Pending {
  uint64_t number = 0;  // admission order
  std::string key;      // broker-assigned id used towards workers
  std::string client;   // routing id on the front socket
  std::string request_id;  // the client's id
  bool has_prompt = false;
  std::string prompt_or_ids, params;  // encoded, as the client sent them
  bool stream = false;
  bool has_session = false;
  std::string session_id;
  double arrived = 0.0, deadline = 0.0;
  WorkerPtr worker;
  int64_t attempt = 0, redispatches = 0;
  std::vector<int64_t> delivered;  // token ids already accepted, in order
  std::string text;                // their text
  int64_t seq = 0;                 // next delta sequence number towards the client
  bool cancelling = false;   // the client cancelled; waiting for the worker's final
  bool client_done = false;  // the client got its last message; only the slot is held
  double release_at = 0.0;   // when client_done: free the slot by then even without a final
};

// An end_session waiting for the worker's answer.
struct BrokerCore::PendingEnd {
  std::string client, request_id, session_id;
  WorkerPtr worker;
  double deadline = 0.0;
};

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
    front_ = router(settings_.front, front_endpoint_);
    back_ = router(settings_.back, back_endpoint_);
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
  if (ctx_ != nullptr) zmq_ctx_term(ctx_);
  ctx_ = nullptr;
}

void* BrokerCore::router(const std::string& endpoint, std::string& bound) {
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
    throw std::runtime_error("a frame the protocol accepts did not parse");
  return rejected;
}

// --------------------------------------------------------------- clients
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
  }
  // ping: being heard from is all it does.
}

void BrokerCore::refuse(const std::string& client, std::string_view request_id,
                        const std::string& code, const std::string& message) {
  ++stats_.outcomes[code];
  reply_error(client, request_id, code, message);
}

void BrokerCore::on_generate(const std::string& client, const ClientRequest& req, double t) {
  ++stats_.requests_received;
  const std::string rid(req.request_id);
  const std::string sid(req.session_id);
  if (by_client_.count({client, rid}))
    return refuse(client, rid, "duplicate_request", "request id " + quoted(rid) + " is already in flight");
  if (req.has_session && busy_sessions_.count(sid))
    return refuse(client, rid, "session_busy",
                  "session " + quoted(sid) + " already has a request in flight");
  if (workers_.empty()) return refuse(client, rid, "no_workers", "no worker is connected");
  WorkerPtr worker = pick(req.has_session ? &sid : nullptr);
  if (!worker && static_cast<int64_t>(queue_.size()) >= settings_.queue_bound)
    return refuse(client, rid, "overloaded",
                  "every worker is busy and " + std::to_string(queue_.size()) + " requests are queued");
  auto p = std::make_shared<Pending>();
  p->number = ++next_key_;
  p->key = hex(p->number);
  p->client = client;
  p->request_id = rid;
  p->has_prompt = req.has_prompt;
  p->prompt_or_ids.assign(req.prompt_or_ids);
  p->params.assign(req.params);
  p->stream = req.stream;
  p->has_session = req.has_session;
  p->session_id = sid;
  p->arrived = t;
  p->deadline = t + (req.timeout > 0 ? req.timeout : settings_.default_timeout);
  requests_[p->key] = p;
  by_client_[{client, rid}] = p;
  client_requests_[client].insert(p->key);
  if (p->has_session) busy_sessions_.insert(sid);
  if (!worker) queue_.push_back(p);
  else dispatch(p, worker, t);
}

BrokerCore::WorkerPtr BrokerCore::pick(const std::string* session_id) {
  // Where a request goes now, or null when every worker is full.
  if (session_id != nullptr) {
    auto it = affinity_.find(*session_id);
    if (it != affinity_.end() && it->second->alive && it->second->free_slots() > 0) return it->second;
  }
  WorkerPtr best;
  for (const WorkerPtr& w : workers_) {
    const int64_t free = w->free_slots();
    if (free <= 0) continue;
    if (!best || free > best->free_slots() ||
        (free == best->free_slots() && w->free_kv_blocks > best->free_kv_blocks))
      best = w;
  }
  return best;
}

void BrokerCore::dispatch(const PendingPtr& p, const WorkerPtr& worker, double t) {
  ++p->attempt;
  p->worker = worker;
  worker->inflight[p->key] = p;
  msgpack::Writer w = begin_message("dispatch", p->has_session ? 8 : 7);
  key(w, "request_id"); w.str(p->key);
  key(w, "attempt"); w.integer(p->attempt);
  key(w, p->has_prompt ? "prompt" : "input_ids"); w.raw(p->prompt_or_ids);
  key(w, "params");
  if (p->params.empty()) w.map(0); else w.raw(p->params);
  key(w, "resume_tokens"); w.array(static_cast<uint32_t>(p->delivered.size()));
  for (int64_t tok : p->delivered) w.integer(tok);
  key(w, "resume_text"); w.str(p->text);
  key(w, "timeout"); w.real(std::round(std::max(p->deadline - t, 0.001) * 1000.0) / 1000.0);
  const char* decision = "stateless";
  if (p->has_session) {
    key(w, "session_id"); w.str(p->session_id);
    auto it = affinity_.find(p->session_id);
    decision = it == affinity_.end() ? "new" : it->second == worker ? "affinity" : "moved";
    affinity_[p->session_id] = worker;
  }
  send_worker(worker, w.take());
  ++stats_.routing[decision];
}

void BrokerCore::drain_queue() {
  while (!queue_.empty()) {
    PendingPtr p = queue_.front();
    WorkerPtr worker = pick(p->has_session ? &p->session_id : nullptr);
    if (!worker) return;
    queue_.pop_front();
    dispatch(p, worker, now());
  }
}

void BrokerCore::remove_queued(const PendingPtr& p) {
  auto it = std::find(queue_.begin(), queue_.end(), p);
  if (it != queue_.end()) queue_.erase(it);
}

void BrokerCore::on_cancel(const std::string& client, std::string_view request_id) {
  auto it = by_client_.find({client, std::string(request_id)});
  if (it == by_client_.end()) {
    reply_error(client, request_id, "unknown_request",
                "no request " + quoted(request_id) + " in flight (finished or never sent)");
    return;
  }
  PendingPtr p = it->second;
  if (!p->worker) {  // still queued: nothing ran, answer at once
    remove_queued(p);
    cancelled_final(p);
    return;
  }
  // The worker confirms with a final (finish_reason cancelled) carrying true usage.
  p->cancelling = true;
  p->release_at = now() + settings_.cancel_grace;
  ++stats_.cancels_forwarded;
  send_worker(p->worker, cancel_frame(*p));
}

void BrokerCore::on_end_session(const std::string& client, const ClientRequest& req) {
  const std::string rid(req.request_id), sid(req.session_id);
  if (busy_sessions_.count(sid)) {
    reply_error(client, rid, "session_busy", "session " + quoted(sid) + " has a request in flight");
    return;
  }
  WorkerPtr worker;
  auto it = affinity_.find(sid);
  if (it != affinity_.end() && it->second->alive) {
    worker = it->second;
  } else {  // any worker can drop a session: the token store is shared
    for (const WorkerPtr& w : workers_)
      if (!worker || w->free_slots() > worker->free_slots()) worker = w;
  }
  if (!worker) {
    reply_error(client, rid, "no_workers", "no worker is connected");
    return;
  }
  const std::string end_key = "e" + hex(++next_key_);
  auto end = std::make_shared<PendingEnd>();
  end->client = client;
  end->request_id = rid;
  end->session_id = sid;
  end->worker = worker;
  end->deadline = now() + settings_.cancel_grace * 5;
  pending_ends_[end_key] = end;
  msgpack::Writer w = begin_message("end_session", 2);
  key(w, "request_id"); w.str(end_key);
  key(w, "session_id"); w.str(sid);
  send_worker(worker, w.take());
}

void BrokerCore::client_gone(const std::string& client, const std::string& outcome) {
  // Cancel everything the client has in flight; nothing more is sent to it.
  auto it = client_requests_.find(client);
  if (it == client_requests_.end()) return;
  const std::vector<std::string> keys(it->second.begin(), it->second.end());
  for (const std::string& k : keys) {
    auto r = requests_.find(k);
    if (r == requests_.end()) continue;
    PendingPtr p = r->second;  // abandoning may erase the map's entry
    if (!p->client_done) abandon(p, outcome);
  }
}

void BrokerCore::abandon(const PendingPtr& p, const std::string& outcome) {
  // The client gets nothing more for `p`; the worker is told to stop.
  ++stats_.outcomes[outcome];
  p->client_done = true;
  forget_client_side(p);
  if (!p->worker) {
    remove_queued(p);
    release(p);
    return;
  }
  p->release_at = now() + settings_.cancel_grace;
  ++stats_.cancels_forwarded;
  send_worker(p->worker, cancel_frame(*p));
}

// --------------------------------------------------------------- workers
BrokerCore::WorkerPtr BrokerCore::find_worker(const std::string& ident) const {
  for (const WorkerPtr& w : workers_)
    if (w->identity == ident) return w;
  return nullptr;
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

void BrokerCore::on_register(const std::string& ident, const WorkerMessage& msg) {
  auto worker = std::make_shared<Worker>();
  worker->identity = ident;
  worker->worker_id.assign(msg.worker_id);
  worker->model.assign(msg.model);
  worker->slots = msg.slots;
  worker->kv_blocks = msg.kv_blocks;
  worker->free_kv_blocks = msg.kv_blocks;
  worker->expiry = now() + settings_.heartbeat_interval * static_cast<double>(settings_.liveness);
  WorkerPtr old;
  auto it = std::find_if(workers_.begin(), workers_.end(),
                         [&](const WorkerPtr& w) { return w->identity == ident; });
  if (it != workers_.end()) {
    old = *it;
    *it = worker;  // keeps its place in the order
  } else {
    workers_.push_back(worker);
  }
  ++stats_.workers_registered;
  if (old) worker_lost(old, "re-registered");  // it started over with us: its old work is gone
  log(kInfo, "worker " + worker->worker_id + " registered: " + std::to_string(worker->slots) +
                 " slots, " + std::to_string(worker->kv_blocks) + " kv blocks");
  msgpack::Writer w = begin_message("registered", 2);
  key(w, "heartbeat_interval"); w.real(settings_.heartbeat_interval);
  key(w, "liveness"); w.integer(settings_.liveness);
  send_worker(worker, w.take());
  drain_queue();
}

void BrokerCore::on_heartbeat(const WorkerPtr& worker, const WorkerMessage& msg) {
  worker->free_kv_blocks = msg.free_kv_blocks;
  worker->queue_len = msg.queue_len;
  auto drop_affinity = [&](const std::string& sid) {
    auto it = affinity_.find(sid);
    if (it != affinity_.end() && it->second == worker) affinity_.erase(it);
  };
  if (msg.sessions_reset) {
    for (const std::string& sid : worker->sessions) drop_affinity(sid);
    worker->sessions.clear();
  }
  for (std::string_view s : msg.sessions_removed) {
    const std::string sid(s);
    worker->sessions.erase(sid);
    drop_affinity(sid);
  }
  for (std::string_view s : msg.sessions_added) {
    const std::string sid(s);
    worker->sessions.insert(sid);
    auto it = affinity_.find(sid);
    // Where a session last ran beats an older copy another worker still holds.
    if (it == affinity_.end() || !it->second->alive) affinity_[sid] = worker;
  }
}

BrokerCore::PendingPtr BrokerCore::current(const WorkerPtr& worker, const WorkerMessage& msg) {
  // The request a worker message belongs to, or null for a stale one.
  auto it = requests_.find(std::string(msg.request_id));
  if (it == requests_.end() || it->second->worker != worker || !msg.has_attempt ||
      it->second->attempt != msg.attempt) {
    ++stats_.stale_dropped;
    return nullptr;
  }
  return it->second;
}

void BrokerCore::on_delta(const WorkerPtr& worker, const WorkerMessage& msg) {
  PendingPtr p = current(worker, msg);
  if (!p || p->client_done) return;
  std::vector<int64_t>& delivered = p->delivered;
  const int64_t have = static_cast<int64_t>(delivered.size());
  const int64_t* tokens = msg.token_ids.data();
  size_t n = msg.token_ids.size();
  if (msg.index != have) {
    if (msg.index > have) return fail_gap(p, msg);
    if (msg.index + static_cast<int64_t>(n) <= have) {  // a resend
      ++stats_.duplicates_dropped;
      n = 0;
    } else {  // overlaps what was delivered: keep the new part
      tokens += have - msg.index;
      n -= static_cast<size_t>(have - msg.index);
    }
  }
  delivered.insert(delivered.end(), tokens, tokens + n);
  if (n == 0 && msg.text.empty()) return;
  p->text.append(msg.text);
  if (p->stream) {
    // The worker's delta with the client's id and seq in place of key and attempt.
    const int64_t seq = p->seq++;
    send_client(p->client, delta_frame(*p, seq, have, tokens, n, msg.text));
  }
}

void BrokerCore::on_final(const WorkerPtr& worker, const WorkerMessage& msg) {
  PendingPtr p = current(worker, msg);
  if (!p) return;
  if (p->client_done) return release(p);
  // A final has no index: its tokens follow the last delta's.
  const int64_t start = static_cast<int64_t>(p->delivered.size());
  p->delivered.insert(p->delivered.end(), msg.token_ids.begin(), msg.token_ids.end());
  std::string text;
  if (p->stream) {
    p->text.append(msg.text);
    if (!msg.token_ids.empty() || !msg.text.empty()) {
      send_client(p->client, delta_frame(*p, p->seq, start, msg.token_ids.data(),
                                         msg.token_ids.size(), msg.text));
      ++p->seq;
    }
  } else {
    p->text.append(msg.text);
    text = p->text;
  }
  p->client_done = true;  // before the send: a gone client is not cancelled twice
  send_client(p->client, final_frame(*p, msg.finish_reason, msg.prompt_tokens, msg.cached_tokens,
                                     !p->stream, text));
  finish(p, msg.finish_reason == "cancelled" ? "cancelled" : "completed");
}

void BrokerCore::on_worker_error(const WorkerPtr& worker, const WorkerMessage& msg) {
  if (!msg.has_request_id) {
    log(kWarning, "worker " + worker->worker_id + " reported: " + std::string(msg.code) + " " +
                      std::string(msg.message));
    return;
  }
  const std::string rid(msg.request_id);
  if (pending_ends_.count(rid)) return on_session_ended(rid, &msg);
  PendingPtr p = current(worker, msg);
  if (!p) return;
  if (!p->client_done)
    last_reply(p, error_frame(std::string_view(p->request_id), msg.code, msg.message, msg.retryable));
  finish(p, "failed");
}

void BrokerCore::on_session_ended(const std::string& end_key, const WorkerMessage* error) {
  auto it = pending_ends_.find(end_key);
  if (it == pending_ends_.end()) {
    ++stats_.stale_dropped;
    return;
  }
  std::shared_ptr<PendingEnd> end = it->second;
  pending_ends_.erase(it);
  if (error != nullptr) {
    send_client(end->client, error_frame(std::string_view(end->request_id), error->code,
                                         error->message, error->retryable));
    return;
  }
  affinity_.erase(end->session_id);
  for (const WorkerPtr& w : workers_) w->sessions.erase(end->session_id);
  msgpack::Writer w = begin_message("session_ended", 2);
  key(w, "request_id"); w.str(end->request_id);
  key(w, "session_id"); w.str(end->session_id);
  send_client(end->client, w.take());
}

void BrokerCore::fail_gap(const PendingPtr& p, const WorkerMessage& msg) {
  log(kError, "worker skipped tokens on " + p->key + ": index " + std::to_string(msg.index) +
                  ", have " + std::to_string(p->delivered.size()));
  last_reply(p, error_frame(std::string_view(p->request_id), "internal",
                            "worker stream had a gap; request aborted"));
  abandon(p, "failed");
}

// ------------------------------------------------------------- lifecycle
void BrokerCore::forget_client_side(const PendingPtr& p) {
  by_client_.erase({p->client, p->request_id});
  auto it = client_requests_.find(p->client);
  if (it != client_requests_.end()) {
    it->second.erase(p->key);
    if (it->second.empty()) client_requests_.erase(it);
  }
}

void BrokerCore::release(const PendingPtr& p) {
  // Free everything `p` holds: its slot, its session lock, its entry.
  PendingPtr keep = p;  // the map may hold the last reference
  requests_.erase(p->key);
  if (p->worker) {
    p->worker->inflight.erase(p->key);
    p->worker = nullptr;
  }
  if (p->has_session) busy_sessions_.erase(p->session_id);
  if (!queue_.empty()) drain_queue();
}

void BrokerCore::finish(const PendingPtr& p, const std::string& outcome) {
  if (hooks_.tick) finished_durations_.push_back(now() - p->arrived);
  ++stats_.outcomes[outcome];
  p->client_done = true;
  forget_client_side(p);
  release(p);
}

void BrokerCore::last_reply(const PendingPtr& p, const std::string& frame) {
  // Marked done first: if the send finds the client gone, nothing is cancelled twice.
  p->client_done = true;
  send_client(p->client, frame);
}

void BrokerCore::fail(const PendingPtr& p, const std::string& code, const std::string& message) {
  last_reply(p, error_frame(std::string_view(p->request_id), code, message));
  finish(p, code);
}

void BrokerCore::cancelled_final(const PendingPtr& p) {
  // The broker's own final for a cancel the worker could not confirm.
  last_reply(p, final_frame(*p, "cancelled", 0, 0, !p->stream, p->stream ? "" : p->text));
  finish(p, "cancelled");
}

void BrokerCore::worker_lost(WorkerPtr worker, const std::string& why) {
  log(kWarning, "worker " + worker->worker_id + " lost (" + why + "); " +
                    std::to_string(worker->inflight.size()) + " requests in flight");
  worker->alive = false;
  auto it = std::find(workers_.begin(), workers_.end(), worker);
  if (it != workers_.end()) workers_.erase(it);
  ++stats_.workers_lost;
  for (auto a = affinity_.begin(); a != affinity_.end();)
    a = a->second == worker ? affinity_.erase(a) : std::next(a);
  std::vector<std::shared_ptr<PendingEnd>> ends;
  for (auto e = pending_ends_.begin(); e != pending_ends_.end();) {
    if (e->second->worker == worker) {
      ends.push_back(e->second);
      e = pending_ends_.erase(e);
    } else {
      ++e;
    }
  }
  for (const auto& end : ends)
    send_client(end->client, error_frame(std::string_view(end->request_id), "worker_lost",
                                         "the worker died before answering"));
  std::vector<PendingPtr> orphans;
  for (auto& kv : worker->inflight) orphans.push_back(kv.second);
  worker->inflight.clear();
  std::sort(orphans.begin(), orphans.end(),
            [](const PendingPtr& a, const PendingPtr& b) { return a->number < b->number; });
  std::vector<PendingPtr> requeue;
  for (const PendingPtr& p : orphans) {
    p->worker = nullptr;
    if (p->client_done) {
      release(p);
    } else if (p->cancelling) {
      cancelled_final(p);
    } else if (workers_.empty() || p->redispatches >= settings_.max_redispatch) {
      fail(p, "worker_lost", "worker " + worker->worker_id +
                                 " was lost and the request could not be moved");
    } else {
      ++p->redispatches;
      ++stats_.redispatches;
      if (!p->delivered.empty()) ++stats_.redispatches_resumed;
      requeue.push_back(p);
    }
  }
  // Moved requests go ahead of new ones: they were admitted first.
  queue_.insert(queue_.begin(), requeue.begin(), requeue.end());
  if (workers_.empty()) {
    while (!queue_.empty()) {
      PendingPtr p = queue_.front();
      queue_.pop_front();
      fail(p, "no_workers", "no worker is connected");
    }
  }
  drain_queue();
}

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
      hooks_.tick(stats_snapshot(), finished_durations_);
    } catch (const std::exception& e) {  // metrics must not stop the broker
      log(kError, std::string("the tick hook failed: ") + e.what());
    }
    finished_durations_.clear();
  }
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
  w.map(21);
  count("requests_received", stats_.requests_received);
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
