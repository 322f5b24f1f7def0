// Internal to the broker_*.cpp files: the records behind BrokerCore's Worker,
// Pending and PendingEnd pointers, and the helpers the files share.

#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "broker_core.h"
#include "msgpack_lite.h"

namespace turbomq::broker {

// Python logging levels, for log().
inline constexpr int kDebug = 10, kInfo = 20, kWarning = 30, kError = 40;

inline void key(msgpack::Writer& w, const char* name) { w.str(name); }

// A message map of `fields` fields besides v and kind, those two written.
inline msgpack::Writer begin_message(const char* kind, uint32_t fields) {
  msgpack::Writer w;
  w.map(fields + 2);
  key(w, "v"); w.integer(1);
  key(w, "kind"); w.str(kind);
  return w;
}

struct BrokerCore::Worker {
  std::string identity;  // routing id on the back socket
  std::string worker_id, model;
  uint64_t id_hash = 0;  // of worker_id: its place in prefix routing, whatever its connection
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
  bool has_prompt = false, has_messages = false;
  std::string prompt_or_ids, params;  // encoded, as the client sent them
  bool stream = false;
  bool has_session = false;
  std::string session_id;   // the client's
  std::string tenant;       // its client's tenant ("" in plain mode)
  std::string session_key;  // "tenant:session_id": affinity and busy sessions use it
  bool has_prefix_key = false;  // stateless, with prefix routing on
  uint64_t prefix_key = 0;
  double arrived = 0.0, deadline = 0.0;
  double queued_at = -1.0;  // when it entered the queue; < 0: not queued
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
  std::string client, request_id, session_id, session_key;
  WorkerPtr worker;
  double deadline = 0.0;
};

}  // namespace turbomq::broker
