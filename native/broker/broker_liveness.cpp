// Liveness: workers registering, heartbeating and being lost (their requests moved
// or failed); clients gone silent or unreachable.

#include "broker_core.h"

#include <algorithm>

#include "broker_internal.h"

namespace turbomq::broker {

// --------------------------------------------------------------- workers
BrokerCore::WorkerPtr BrokerCore::find_worker(const std::string& ident) const {
  for (const WorkerPtr& w : workers_)
    if (w->identity == ident) return w;
  return nullptr;
}

void BrokerCore::on_register(const std::string& ident, const WorkerMessage& msg) {
  auto worker = std::make_shared<Worker>();
  worker->identity = ident;
  worker->worker_id.assign(msg.worker_id);
  worker->id_hash = hash_bytes(worker->worker_id, kWorkerIdSeed);
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
  msgpack::Writer w = begin_message("registered", 3);
  key(w, "heartbeat_interval"); w.real(settings_.heartbeat_interval);
  key(w, "liveness"); w.integer(settings_.liveness);
  key(w, "broker_id"); w.str(settings_.broker_id);
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
  const double t = now();
  for (const PendingPtr& p : orphans) {
    p->worker = nullptr;
    if (p->client_done) {
      release(p);
    } else if (p->cancelling) {
      cancelled_final(p);
    } else if ((workers_.empty() && settings_.fail_fast) ||
               p->redispatches >= settings_.max_redispatch) {
      fail(p, "worker_lost", "worker " + worker->worker_id +
                                 " was lost and the request could not be moved");
    } else {
      ++p->redispatches;
      ++stats_.redispatches;
      if (!p->delivered.empty()) ++stats_.redispatches_resumed;
      p->queued_at = t;
      requeue.push_back(p);
    }
  }
  // Moved requests go ahead of new ones: they were admitted first. With no
  // worker left they wait for one (or their deadline), unless fail_fast.
  queue_.insert(queue_.begin(), requeue.begin(), requeue.end());
  if (workers_.empty() && settings_.fail_fast) {
    while (!queue_.empty()) {
      PendingPtr p = queue_.front();
      queue_.pop_front();
      fail(p, "no_workers", "no worker is connected");
    }
  }
  drain_queue();
}

// --------------------------------------------------------------- clients
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

}  // namespace turbomq::broker
