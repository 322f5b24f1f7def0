// The request table: a worker's deltas, finals and errors applied to the pending
// request, and how a request ends (finish, release, abandon, fail).

#include "broker_core.h"

#include "broker_internal.h"

namespace turbomq::broker {

// ------------------------------------------------------- worker replies
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
  if (settings_.tenant_tokens_per_s > 0.0) tenants_[p->tenant].tokens -= static_cast<double>(n);
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
  if (settings_.tenant_tokens_per_s > 0.0)
    tenants_[p->tenant].tokens -= static_cast<double>(msg.token_ids.size());
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
  if (p->has_session) busy_sessions_.erase(p->session_key);
  if (auto u = tenants_.find(p->tenant); u != tenants_.end() && --u->second.inflight <= 0 &&
                                          settings_.tenant_tokens_per_s <= 0.0)
    tenants_.erase(u);  // nothing to remember for it
  if (!queue_.empty()) drain_queue();
}

void BrokerCore::finish(const PendingPtr& p, const std::string& outcome) {
  if (hooks_.tick) finished_durations_.push_back(now() - p->arrived);
  ++stats_.outcomes[outcome];
  ++stats_.tenant_outcomes[p->tenant][outcome];
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

void BrokerCore::abandon(const PendingPtr& p, const std::string& outcome) {
  // The client gets nothing more for `p`; the worker is told to stop.
  ++stats_.outcomes[outcome];
  ++stats_.tenant_outcomes[p->tenant][outcome];
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

}  // namespace turbomq::broker
