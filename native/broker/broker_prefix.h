// Cache-aware routing of stateless requests (docs/broker.md, "Prefix routing").
//
// The broker has no tokenizer, so a request's routing key is a hash of its
// tenant and its leading content as it came: the first bytes of a prompt, the
// first token ids, or the first messages up to the first user message. A key
// goes to a worker by weighted rendezvous hashing (highest random weight) over
// the live workers, bounded by load: a worker takes a key's request only
// while it has a free slot and its requests in flight stay under (1 + balance)
// times its share of all of them; past that the key's next worker in
// rendezvous order takes it. Requests with equal keys so land where the
// worker's prefix cache holds their KV, and a worker that comes or goes moves
// only its own share of keys. Pure functions: the core and the tests call them.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "broker_protocol.h"
#include "msgpack_lite.h"

namespace turbomq::broker {

// A 64-bit hash of a byte string, stable across processes and machines (so
// two brokers of an active-active pair agree); not cryptographic.
uint64_t hash_bytes(std::string_view bytes, uint64_t seed);

// The routing key of an accepted generate request in `doc` (read into `req`):
//   prompt     the first `prefix_bytes` bytes of its text;
//   input_ids  its first prefix_bytes / 4 ids (a token is about four bytes of text);
//   messages   role and the first `prefix_bytes` bytes of the content of each
//              message up to and including the first user message (at most 8),
//              so a conversation sent again with its whole history keeps its key;
// each kind apart, seeded with the tenant (the workers' prefix caches are per tenant).
uint64_t prefix_key(const msgpack::Document& doc, const ClientRequest& req, std::string_view tenant,
                    int64_t prefix_bytes);

struct RouteCandidate {
  uint64_t id_hash = 0;  // hash_bytes(worker id, kWorkerIdSeed): the same worker id, the same place
  int64_t slots = 0;     // capacity, and the worker's weight in the rendezvous
  int64_t inflight = 0;  // requests the broker has on it now
};

inline constexpr uint64_t kWorkerIdSeed = 0x7475726d6f6d7121ULL;

struct RouteChoice {
  int index = -1;          // into the candidates; -1: no worker has a free slot
  bool preferred = false;  // the key's first choice (the worker most likely to hold its prefix)
  int preferred_index = -1;
};

// The worker for `key` among `workers` (all live ones): the highest in
// weighted rendezvous order that has a free slot and stays within the load
// bound inflight < (1 + balance) * (total inflight + 1) * slots / total slots.
// Whenever any worker has a free slot one of them qualifies (the least loaded
// relative to its slots always does), so no request waits while a worker is free.
RouteChoice rendezvous_pick(uint64_t key, const std::vector<RouteCandidate>& workers, double balance);

}  // namespace turbomq::broker
