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

bool BrokerCore::over_tenant_limit(const std::string& tenant, double t, std::string& why) {
  TenantUse& use = tenants_[tenant];
  if (settings_.tenant_max_inflight > 0 && use.inflight >= settings_.tenant_max_inflight) {
    why = "tenant has " + std::to_string(use.inflight) + " requests in flight, its limit";
    return true;
  }
  const double rate = settings_.tenant_tokens_per_s;
  if (rate > 0.0) {
    const double cap = rate * settings_.tenant_token_burst_s;
    use.tokens = use.refilled == 0.0 ? cap : std::min(cap, use.tokens + (t - use.refilled) * rate);
    use.refilled = t;
    if (use.tokens <= 0.0) {
      why = "tenant is over its rate of " + std::to_string(static_cast<int64_t>(rate)) +
            " tokens/s; retry in " + std::to_string(-use.tokens / rate + 0.1).substr(0, 4) + " s";
      return true;
    }
  }
  return false;
}

void BrokerCore::refuse(const std::string& client, std::string_view request_id,
                        const std::string& code, const std::string& message) {
  ++stats_.outcomes[code];
  ++stats_.tenant_outcomes[tenant_][code];
  reply_error(client, request_id, code, message);
}

void BrokerCore::on_generate(const std::string& client, const ClientRequest& req, double t) {
  ++stats_.requests_received;
  const std::string rid(req.request_id);
  const std::string sid(req.session_id);
  const std::string skey = tenant_ + ":" + sid;
  if (by_client_.count({client, rid}))
    return refuse(client, rid, "duplicate_request", "request id " + quoted(rid) + " is already in flight");
  if (req.has_session && busy_sessions_.count(skey))
    return refuse(client, rid, "session_busy",
                  "session " + quoted(sid) + " already has a request in flight");
  if (std::string why; over_tenant_limit(tenant_, t, why))
    return refuse(client, rid, "rate_limited", why);
  if (workers_.empty() && settings_.fail_fast)
    return refuse(client, rid, "no_workers", "no worker is connected");
  // Computed once, here: the key of a stateless request, or of a session's
  // first turn here (no owner yet: it goes where its system prompt is
  // likely cached). A known session's turn carries only its new messages;
  // affinity routes it.
  const bool keyed = settings_.prefix_routing && (!req.has_session || !affinity_.count(skey));
  const uint64_t prefix = keyed ? prefix_key(doc_, req, tenant_, settings_.prefix_bytes) : 0;
  bool preferred = false;
  WorkerPtr worker = pick(req.has_session ? &skey : nullptr, keyed ? &prefix : nullptr, preferred);
  if (!worker && static_cast<int64_t>(queue_.size()) >= settings_.queue_bound)
    return refuse(client, rid, "overloaded",
                  "every worker is busy and " + std::to_string(queue_.size()) + " requests are queued");
  auto p = std::make_shared<Pending>();
  p->number = ++next_key_;
  p->key = hex(p->number);
  p->client = client;
  p->request_id = rid;
  p->has_prompt = req.has_prompt;
  p->has_messages = req.has_messages;
  p->prompt_or_ids.assign(req.prompt_or_ids);
  p->params.assign(req.params);
  p->stream = req.stream;
  p->has_session = req.has_session;
  p->session_id = sid;
  p->tenant = tenant_;
  p->session_key = skey;
  p->has_prefix_key = keyed;
  p->prefix_key = prefix;
  ++tenants_[tenant_].inflight;
  p->arrived = t;
  p->deadline = t + (req.timeout > 0 ? req.timeout : settings_.default_timeout);
  p->delivered = req.resume_tokens;  // a resumed request continues after these
  p->text.assign(req.resume_text);
  if (!p->delivered.empty()) ++stats_.requests_resumed;
  requests_[p->key] = p;
  by_client_[{client, rid}] = p;
  client_requests_[client].insert(p->key);
  if (p->has_session) busy_sessions_.insert(skey);
  if (!worker) {
    p->queued_at = t;
    queue_.push_back(p);
  } else {
    dispatch(p, worker, t, preferred);
  }
}

BrokerCore::WorkerPtr BrokerCore::pick(const Pending& p, bool& preferred) {
  return pick(p.has_session ? &p.session_key : nullptr, p.has_prefix_key ? &p.prefix_key : nullptr,
              preferred);
}

BrokerCore::WorkerPtr BrokerCore::pick(const std::string* session_key, const uint64_t* prefix_key,
                                       bool& preferred) {
  preferred = false;
  if (session_key != nullptr) {
    auto it = affinity_.find(*session_key);
    if (it != affinity_.end() && it->second->alive && it->second->free_slots() > 0) return it->second;
  }
  if (prefix_key != nullptr) {
    candidates_.clear();
    for (const WorkerPtr& w : workers_)
      candidates_.push_back({w->id_hash, w->slots, static_cast<int64_t>(w->inflight.size())});
    const RouteChoice c = rendezvous_pick(*prefix_key, candidates_, settings_.prefix_balance);
    if (c.index < 0) return nullptr;
    preferred = c.preferred;
    return workers_[static_cast<size_t>(c.index)];
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

void BrokerCore::dispatch(const PendingPtr& p, const WorkerPtr& worker, double t, bool preferred) {
  if (p->queued_at >= 0.0) {
    if (hooks_.tick) queue_waits_.push_back(t - p->queued_at);
    p->queued_at = -1.0;
  }
  msgpack::Writer w = begin_message("dispatch", p->has_session ? 10 : 9);
  key(w, "request_id"); w.str(p->key);
  key(w, "attempt"); w.integer(p->attempt + 1);
  key(w, p->has_prompt ? "prompt" : p->has_messages ? "messages" : "input_ids");
  w.raw(p->prompt_or_ids);
  key(w, "params");
  if (p->params.empty()) w.map(0); else w.raw(p->params);
  key(w, "resume_tokens"); w.array(static_cast<uint32_t>(p->delivered.size()));
  for (int64_t tok : p->delivered) w.integer(tok);
  key(w, "resume_text"); w.str(p->text);
  key(w, "timeout"); w.real(std::round(std::max(p->deadline - t, 0.001) * 1000.0) / 1000.0);
  // The client's id: the same whichever broker sends the turn, so a worker
  // can tell a re-sent turn that was committed already.
  key(w, "turn_id"); w.str(p->request_id);
  key(w, "tenant"); w.str(p->tenant);  // the worker keys the session by tenant too
  if (p->has_session) {
    key(w, "session_id"); w.str(p->session_id);
  }
  std::string frame = w.take();
  if (static_cast<int64_t>(frame.size()) > settings_.limits.max_frame_bytes) {
    // The broker's fields took a frame near the limit over it; a worker would
    // drop it unread. Answer now instead of holding a slot until the deadline.
    return fail(p, "frame_too_large",
                "the request is " + std::to_string(frame.size()) + " bytes with the broker's "
                "fields, over max_frame_bytes = " + std::to_string(settings_.limits.max_frame_bytes));
  }
  ++p->attempt;
  p->worker = worker;
  worker->inflight[p->key] = p;
  // A stateless request: "prefix" when it went to its key's first choice,
  // "stateless" when load sent it elsewhere (or prefix routing is off).
  const char* decision = preferred ? "prefix" : "stateless";
  if (p->has_session) {
    auto it = affinity_.find(p->session_key);
    decision = it == affinity_.end() ? "new" : it->second == worker ? "affinity" : "moved";
    affinity_[p->session_key] = worker;
  }
  send_worker(worker, frame);
  ++stats_.routing[decision];
}

void BrokerCore::drain_queue() {
  while (!queue_.empty()) {
    PendingPtr p = queue_.front();
    bool preferred = false;
    WorkerPtr worker = pick(*p, preferred);
    if (!worker) return;
    queue_.pop_front();
    dispatch(p, worker, now(), preferred);
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
  const std::string skey = tenant_ + ":" + sid;
  if (busy_sessions_.count(skey)) {
    reply_error(client, rid, "session_busy", "session " + quoted(sid) + " has a request in flight");
    return;
  }
  WorkerPtr worker;
  auto it = affinity_.find(skey);
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
  end->session_key = skey;
  end->worker = worker;
  end->deadline = now() + settings_.cancel_grace * 5;
  pending_ends_[end_key] = end;
  msgpack::Writer w = begin_message("end_session", 3);
  key(w, "request_id"); w.str(end_key);
  key(w, "session_id"); w.str(sid);
  key(w, "tenant"); w.str(tenant_);
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
  affinity_.erase(end->session_key);
  for (const WorkerPtr& w : workers_) w->sessions.erase(end->session_key);
  msgpack::Writer w = begin_message("session_ended", 2);
  key(w, "request_id"); w.str(end->request_id);
  key(w, "session_id"); w.str(end->session_id);
  send_client(end->client, w.take());
}

}  // namespace turbomq::broker
