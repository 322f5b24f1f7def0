// Routing and session affinity: admitting a generate request, picking its worker,
// dispatch, the queue, cancels and end_session.

#include "broker_core.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "broker_internal.h"

namespace turbomq::broker {

namespace {
// Python's repr of a short str, near enough for a message: 'text'.
std::string quoted(std::string_view s) { return "'" + std::string(s) + "'"; }

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%llx", static_cast<unsigned long long>(v));
  return buf;
}
}  // namespace

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
  if (workers_.empty() && settings_.fail_fast)
    return refuse(client, rid, "no_workers", "no worker is connected");
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
  p->delivered = req.resume_tokens;  // a resumed request continues after these
  p->text.assign(req.resume_text);
  if (!p->delivered.empty()) ++stats_.requests_resumed;
  requests_[p->key] = p;
  by_client_[{client, rid}] = p;
  client_requests_[client].insert(p->key);
  if (p->has_session) busy_sessions_.insert(sid);
  if (!worker) {
    p->queued_at = t;
    queue_.push_back(p);
  } else {
    dispatch(p, worker, t);
  }
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
  if (p->queued_at >= 0.0) {
    if (hooks_.tick) queue_waits_.push_back(t - p->queued_at);
    p->queued_at = -1.0;
  }
  ++p->attempt;
  p->worker = worker;
  worker->inflight[p->key] = p;
  msgpack::Writer w = begin_message("dispatch", p->has_session ? 9 : 8);
  key(w, "request_id"); w.str(p->key);
  key(w, "attempt"); w.integer(p->attempt);
  key(w, p->has_prompt ? "prompt" : "input_ids"); w.raw(p->prompt_or_ids);
  key(w, "params");
  if (p->params.empty()) w.map(0); else w.raw(p->params);
  key(w, "resume_tokens"); w.array(static_cast<uint32_t>(p->delivered.size()));
  for (int64_t tok : p->delivered) w.integer(tok);
  key(w, "resume_text"); w.str(p->text);
  key(w, "timeout"); w.real(std::round(std::max(p->deadline - t, 0.001) * 1000.0) / 1000.0);
  // The client's id: the same whichever broker sends the turn, so a worker
  // can tell a re-sent turn that was committed already.
  key(w, "turn_id"); w.str(p->request_id);
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

// --------------------------------------------------------------- cancels
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

// ---------------------------------------------------------- end_session
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

}  // namespace turbomq::broker
