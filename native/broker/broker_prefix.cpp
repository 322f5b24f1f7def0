#include "broker_prefix.h"

#include <algorithm>
#include <cmath>

namespace turbomq::broker {

using msgpack::Node;
using msgpack::Type;

namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL, kP2 = 0xC2B2AE3D27D4EB4FULL;
constexpr int kMaxKeyMessages = 8;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// splitmix64's finalizer: every input bit moves every output bit.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Little-endian whatever the machine, so every broker computes the same keys.
inline uint64_t load_le(const unsigned char* p, size_t n) {
  uint64_t w = 0;
  for (size_t i = 0; i < n; ++i) w |= static_cast<uint64_t>(p[i]) << (8 * i);
  return w;
}

// xxHash64's round over one lane: 8 bytes a step, a few hundred bytes in well
// under a microsecond.
class Hasher {
 public:
  explicit Hasher(uint64_t seed) : h_(seed ^ kP2) {}
  void u64(uint64_t v) {
    word(v);
    len_ += 8;
  }
  void bytes(std::string_view s) {
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    size_t n = s.size();
    len_ += n;
    for (; n >= 8; p += 8, n -= 8) word(load_le(p, 8));
    if (n > 0) word(load_le(p, n) | (static_cast<uint64_t>(n) << 56));
  }
  uint64_t done() const { return mix64(h_ ^ len_); }

 private:
  void word(uint64_t w) { h_ = rotl(h_ ^ (w * kP2), 31) * kP1; }
  uint64_t h_;
  uint64_t len_ = 0;
};

std::string_view head(std::string_view s, int64_t n) {
  return s.substr(0, static_cast<size_t>(std::max<int64_t>(n, 0)));
}

}  // namespace

uint64_t hash_bytes(std::string_view bytes, uint64_t seed) {
  Hasher h(seed);
  h.bytes(bytes);
  return h.done();
}

uint64_t prefix_key(const msgpack::Document& doc, const ClientRequest& req, std::string_view tenant,
                    int64_t prefix_bytes) {
  Hasher h(hash_bytes(tenant, kP1));
  const Node* n = req.prompt_node;
  if (n == nullptr) return h.done();
  if (n->type == Type::Str) {  // prompt
    h.u64('p');
    h.bytes(head(n->bytes, prefix_bytes));
  } else if (req.has_messages && n->type == Type::Array) {
    h.u64('m');
    int seen = 0;
    for (int32_t k = n->first; k >= 0 && seen < kMaxKeyMessages; k = doc.node(k).next, ++seen) {
      const Node& m = doc.node(k);
      if (m.type != Type::Map) break;
      const Node* role = doc.get(m, "role");
      const Node* content = doc.get(m, "content");
      const std::string_view r = role != nullptr && role->type == Type::Str ? role->bytes : "";
      const std::string_view c =
          content != nullptr && content->type == Type::Str ? head(content->bytes, prefix_bytes) : "";
      h.u64(r.size());
      h.bytes(r);
      h.u64(c.size());
      h.bytes(c);
      if (r == "user") break;
    }
  } else if (n->type == Type::Array) {  // input_ids
    h.u64('i');
    int64_t left = std::max<int64_t>(prefix_bytes / 4, 1);
    for (int32_t k = n->first; k >= 0 && left > 0; k = doc.node(k).next, --left)
      h.u64(static_cast<uint64_t>(doc.node(k).i));
  }
  return h.done();
}

RouteChoice rendezvous_pick(uint64_t key, const std::vector<RouteCandidate>& workers, double balance) {
  double total_slots = 0.0, total_inflight = 0.0;
  bool uniform = true;  // equal weights: the order of u is the order of the scores
  for (const RouteCandidate& w : workers) {
    total_slots += static_cast<double>(w.slots);
    total_inflight += static_cast<double>(w.inflight);
    uniform = uniform && w.slots == workers.front().slots;
  }
  // inflight < (1 + balance) * (total + 1) * slots / total_slots, without the division.
  const double bound = (1.0 + balance) * (total_inflight + 1.0);
  RouteChoice out;
  double best = 0.0, best_fit = 0.0;
  for (size_t i = 0; i < workers.size(); ++i) {
    const RouteCandidate& w = workers[i];
    // Weighted rendezvous (the logarithmic method): score = weight / -ln(u),
    // u uniform in (0, 1) from the key and the worker; a worker's share of
    // keys is its share of the weights, and removing one moves only its keys.
    const uint64_t x = mix64(key ^ mix64(w.id_hash));
    const double u = (static_cast<double>(x >> 11) + 0.5) * 0x1.0p-53;
    const double score =
        uniform ? u : static_cast<double>(std::max<int64_t>(w.slots, 1)) / -std::log(u);
    if (out.preferred_index < 0 || score > best) {
      best = score;
      out.preferred_index = static_cast<int>(i);
    }
    const bool fits = w.inflight < w.slots &&
                      static_cast<double>(w.inflight) * total_slots < bound * static_cast<double>(w.slots);
    if (fits && (out.index < 0 || score > best_fit)) {
      best_fit = score;
      out.index = static_cast<int>(i);
    }
  }
  out.preferred = out.index >= 0 && out.index == out.preferred_index;
  return out;
}

}  // namespace turbomq::broker
