#include "broker_protocol.h"

#include <cmath>
#include <initializer_list>

namespace turbomq::broker {

using msgpack::Document;
using msgpack::Node;
using msgpack::Type;

namespace {

// Python's `msg.get(name) is None`.
bool none(const Node* n) { return n == nullptr || n->type == Type::Nil; }

bool int_in(const Node* n, int64_t lo, int64_t hi) {
  return n != nullptr && n->type == Type::Int && n->i >= lo && n->i <= hi;
}

// protocol._is_num: an int or a finite float.
bool number(const Node* n, double& v) {
  if (n == nullptr) return false;
  switch (n->type) {
    case Type::Int: v = static_cast<double>(n->i); return true;
    case Type::UInt: v = static_cast<double>(n->u); return true;
    case Type::Float: v = n->f; return std::isfinite(n->f);
    default: return false;
  }
}

bool str_chars(const Node* n, int64_t lo, int64_t hi) {
  return n != nullptr && n->type == Type::Str && n->count >= lo && n->count <= hi;
}

bool token_ids(const Document& doc, const Node* n, int64_t min_len, int64_t max_len) {
  if (n == nullptr || n->type != Type::Array || n->count < min_len || n->count > max_len)
    return false;
  for (int32_t k = n->first; k >= 0; k = doc.node(k).next)
    if (!int_in(&doc.node(k), 0, kMaxTokenId)) return false;
  return true;
}

// Every key a string from `allowed` (protocol: `msg.keys() <= allowed`).
bool keys_within(const Document& doc, const Node& map, std::initializer_list<std::string_view> allowed) {
  for (int32_t k = map.first; k >= 0; k = doc.node(doc.node(k).next).next) {
    const Node& name = doc.node(k);
    if (name.type != Type::Str) return false;
    bool known = false;
    for (auto a : allowed) known |= name.bytes == a;
    if (!known) return false;
  }
  return true;
}

bool in_range(const Node* n, double lo, double hi, bool lo_open) {
  double v;
  return number(n, v) && (lo_open ? v > lo : v >= lo) && v <= hi;
}

// protocol._check_params accepts every pair.
bool params_ok(const Document& doc, const Node& params, const ProtocolLimits& limits) {
  for (int32_t k = params.first; k >= 0; k = doc.node(doc.node(k).next).next) {
    const Node& name = doc.node(k);
    const Node* v = &doc.node(name.next);
    if (name.type != Type::Str) return false;
    const std::string_view key = name.bytes;
    bool ok;
    if (key == "max_tokens") {
      ok = int_in(v, 1, limits.max_new_tokens);
    } else if (key == "temperature") {
      ok = in_range(v, 0.0, 1e6, false);
    } else if (key == "top_p") {
      ok = in_range(v, 0.0, 1.0, true);
    } else if (key == "top_k") {
      ok = int_in(v, -1, kMaxTokenId);
    } else if (key == "min_p") {
      ok = in_range(v, 0.0, 1.0, false);
    } else if (key == "repetition_penalty") {
      ok = in_range(v, 0.0, 1e6, true);
    } else if (key == "seed") {  // nil or any msgpack integer: [-2^63, 2^64)
      ok = v->type == Type::Nil || v->type == Type::Int || v->type == Type::UInt;
    } else if (key == "stop") {
      if (v->type == Type::Str) {
        ok = str_chars(v, 1, limits.max_stop_chars);
      } else {
        ok = v->type == Type::Array && v->count <= limits.max_stop_strings;
        for (int32_t s = v->first; ok && s >= 0; s = doc.node(s).next)
          ok = str_chars(&doc.node(s), 1, limits.max_stop_chars);
      }
    } else if (key == "stop_token_ids") {
      ok = token_ids(doc, v, 0, limits.max_stop_token_ids);
    } else if (key == "ignore_eos" || key == "skip_special_tokens") {
      ok = v->type == Type::Bool;
    } else {
      ok = false;
    }
    if (!ok) return false;
  }
  return true;
}

std::string_view span(const Node& n) {
  return std::string_view(n.begin, static_cast<size_t>(n.end - n.begin));
}

int64_t int_or(const Node* n, int64_t fallback) {
  return n != nullptr && n->type == Type::Int ? n->i : fallback;
}

std::string_view str_or_empty(const Node* n) {
  return n != nullptr && n->type == Type::Str ? n->bytes : std::string_view();
}

}  // namespace

bool is_v1_map(const Document& doc) {
  const Node& root = doc.root();
  if (root.type != Type::Map) return false;
  const Node* v = doc.get(root, "v");
  const Node* kind = doc.get(root, "kind");
  return int_in(v, 1, 1) && kind != nullptr && kind->type == Type::Str;
}

bool fast_client_request(const Document& doc, const ProtocolLimits& limits) {
  // protocol._generate_ok, with _check_params accepting the params.
  if (!is_v1_map(doc)) return false;
  const Node& msg = doc.root();
  if (doc.get(msg, "kind")->bytes != "generate") return false;
  if (!keys_within(doc, msg, {"v", "kind", "request_id", "prompt", "input_ids", "session_id",
                              "params", "stream", "timeout"}))
    return false;
  if (!str_chars(doc.get(msg, "request_id"), 1, limits.max_id_chars)) return false;
  const Node* prompt = doc.get(msg, "prompt");
  const Node* ids = doc.get(msg, "input_ids");
  if (none(prompt)) {
    if (!token_ids(doc, ids, 1, limits.max_prompt_tokens)) return false;
  } else if (!none(ids) || !str_chars(prompt, 1, limits.max_prompt_chars)) {
    return false;
  }
  const Node* sid = doc.get(msg, "session_id");
  if (!none(sid) && !str_chars(sid, 1, limits.max_id_chars)) return false;
  const Node* stream = doc.get(msg, "stream");
  if (stream != nullptr && stream->type != Type::Bool) return false;
  const Node* timeout = doc.get(msg, "timeout");
  if (!none(timeout) && !in_range(timeout, 0.0, limits.max_timeout_s, true)) return false;
  const Node* params = doc.get(msg, "params");
  if (params != nullptr && (params->type != Type::Map || !params_ok(doc, *params, limits)))
    return false;
  return true;
}

bool fast_worker_message(const Document& doc, const ProtocolLimits& limits) {
  // protocol._w_delta_ok and _w_final_ok.
  if (!is_v1_map(doc)) return false;
  const Node& msg = doc.root();
  const std::string_view kind = doc.get(msg, "kind")->bytes;
  const bool delta = kind == "delta";
  if (!delta && kind != "final") return false;
  if (doc.distinct_str_keys(msg) != (delta ? 7 : 8)) return false;
  if (!str_chars(doc.get(msg, "request_id"), 1, limits.max_id_chars) ||
      !int_in(doc.get(msg, "attempt"), 0, kMaxTokenId) ||
      !str_chars(doc.get(msg, "text"), 0, limits.max_text_chars) ||
      !token_ids(doc, doc.get(msg, "token_ids"), 0, limits.max_delta_tokens))
    return false;
  if (delta) return int_in(doc.get(msg, "index"), 0, kMaxTokenId);
  const Node* reason = doc.get(msg, "finish_reason");
  if (reason == nullptr || reason->type != Type::Str ||
      !(reason->bytes == "stop" || reason->bytes == "length" || reason->bytes == "cancelled"))
    return false;
  const Node* usage = doc.get(msg, "usage");
  if (usage == nullptr || usage->type != Type::Map || doc.distinct_str_keys(*usage) != 3)
    return false;
  for (auto name : {"prompt_tokens", "cached_tokens", "completion_tokens"})
    if (!int_in(doc.get(*usage, name), 0, kMaxTokenId)) return false;
  return true;
}

bool read_client_request(const Document& doc, ClientRequest& out) {
  if (!is_v1_map(doc)) return false;
  const Node& msg = doc.root();
  out = ClientRequest();
  out.kind = doc.get(msg, "kind")->bytes;
  out.request_id = str_or_empty(doc.get(msg, "request_id"));
  const Node* sid = doc.get(msg, "session_id");
  if (sid != nullptr && sid->type == Type::Str) {
    out.has_session = true;
    out.session_id = sid->bytes;
  }
  if (out.kind != "generate") return true;
  const Node* prompt = doc.get(msg, "prompt");
  const Node* ids = doc.get(msg, "input_ids");
  const Node* messages = doc.get(msg, "messages");
  if (!none(prompt)) {
    out.has_prompt = true;
    out.prompt_node = prompt;
  } else if (!none(messages)) {
    out.has_messages = true;
    out.prompt_node = messages;
  } else if (!none(ids)) {
    out.prompt_node = ids;
  } else {
    return false;
  }
  out.prompt_or_ids = span(*out.prompt_node);
  const Node* params = doc.get(msg, "params");
  if (params != nullptr && params->type == Type::Map) out.params = span(*params);
  const Node* stream = doc.get(msg, "stream");
  out.stream = stream != nullptr && stream->type == Type::Bool && stream->boolean;
  double t;
  if (number(doc.get(msg, "timeout"), t)) out.timeout = t;
  if (const Node* r = doc.get(msg, "resume_tokens"); r != nullptr && r->type == Type::Array)
    for (int32_t k = r->first; k >= 0; k = doc.node(k).next) out.resume_tokens.push_back(doc.node(k).i);
  out.resume_text = str_or_empty(doc.get(msg, "resume_text"));
  return true;
}

namespace {
void read_strs(const Document& doc, const Node* list, std::vector<std::string_view>& out) {
  out.clear();
  if (list == nullptr || list->type != Type::Array) return;
  for (int32_t k = list->first; k >= 0; k = doc.node(k).next)
    out.push_back(str_or_empty(&doc.node(k)));
}
}  // namespace

bool read_worker_message(const Document& doc, WorkerMessage& out) {
  if (!is_v1_map(doc)) return false;
  const Node& msg = doc.root();
  out.kind = doc.get(msg, "kind")->bytes;
  const Node* rid = doc.get(msg, "request_id");
  out.has_request_id = rid != nullptr && rid->type == Type::Str;
  out.request_id = out.has_request_id ? rid->bytes : std::string_view();
  const Node* attempt = doc.get(msg, "attempt");
  out.has_attempt = attempt != nullptr && attempt->type == Type::Int;
  out.attempt = out.has_attempt ? attempt->i : 0;
  const Node* index = doc.get(msg, "index");
  out.has_index = index != nullptr && index->type == Type::Int;
  out.index = out.has_index ? index->i : 0;
  out.token_ids.clear();
  if (const Node* ids = doc.get(msg, "token_ids"); ids != nullptr && ids->type == Type::Array)
    for (int32_t k = ids->first; k >= 0; k = doc.node(k).next) out.token_ids.push_back(doc.node(k).i);
  out.text = str_or_empty(doc.get(msg, "text"));
  out.finish_reason = str_or_empty(doc.get(msg, "finish_reason"));
  if (const Node* usage = doc.get(msg, "usage"); usage != nullptr && usage->type == Type::Map) {
    out.prompt_tokens = int_or(doc.get(*usage, "prompt_tokens"), 0);
    out.cached_tokens = int_or(doc.get(*usage, "cached_tokens"), 0);
  }
  if (out.kind == "delta" || out.kind == "final") return true;
  out.worker_id = str_or_empty(doc.get(msg, "worker_id"));
  out.model = str_or_empty(doc.get(msg, "model"));
  out.slots = int_or(doc.get(msg, "slots"), 0);
  out.kv_blocks = int_or(doc.get(msg, "kv_blocks"), 0);
  out.free_kv_blocks = int_or(doc.get(msg, "free_kv_blocks"), 0);
  out.queue_len = int_or(doc.get(msg, "queue_len"), 0);
  const Node* reset = doc.get(msg, "sessions_reset");
  out.sessions_reset = reset != nullptr && reset->type == Type::Bool && reset->boolean;
  read_strs(doc, doc.get(msg, "sessions_added"), out.sessions_added);
  read_strs(doc, doc.get(msg, "sessions_removed"), out.sessions_removed);
  out.code = str_or_empty(doc.get(msg, "code"));
  out.message = str_or_empty(doc.get(msg, "message"));
  const Node* retryable = doc.get(msg, "retryable");
  out.retryable = retryable != nullptr && retryable->type == Type::Bool && retryable->boolean;
  return true;
}

}  // namespace turbomq::broker
