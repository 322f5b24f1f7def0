// The broker's side of the wire protocol, in C++.
//
// turbomq.clients.protocol stays the one definition of the protocol: it
// alone decides that a frame is invalid and says why. Here are
//   * fast acceptors: the common well-formed generate / delta / final,
//     accepted exactly where clients/protocol accepts them (a test runs a fuzz
//     corpus through both); any other frame goes to clients/protocol's decoder;
//   * readers: the fields the broker uses, from a frame already accepted.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "msgpack_lite.h"

namespace turbomq::broker {

// turbomq.clients.protocol.Limits, passed down from Python.
struct ProtocolLimits {
  int64_t max_frame_bytes = 1 << 20;
  int64_t max_prompt_tokens = 65536;
  int64_t max_prompt_chars = 262144;
  int64_t max_id_chars = 128;
  int64_t max_new_tokens = 65536;
  int64_t max_stop_strings = 16;
  int64_t max_stop_chars = 256;
  int64_t max_stop_token_ids = 256;
  int64_t max_delta_tokens = 65536;
  int64_t max_text_chars = 1 << 19;
  double max_timeout_s = 86400.0;
};

constexpr int64_t kMaxTokenId = (int64_t{1} << 31) - 1;

// What the broker reads from a client request.
struct ClientRequest {
  std::string_view kind;
  std::string_view request_id;
  bool has_session = false;
  std::string_view session_id;
  // generate: the encoded prompt (a str) or input_ids (an array), and params
  // (a map; empty when absent), forwarded to the worker as they came.
  bool has_prompt = false;
  bool has_messages = false;  // a chat prompt, in prompt_or_ids
  std::string_view prompt_or_ids;
  const msgpack::Node* prompt_node = nullptr;  // the same, parsed (valid while its document is)
  std::string_view params;
  bool stream = false;
  double timeout = 0.0;  // 0: none given
  // What the client already has of this request's output (a resumed request).
  std::vector<int64_t> resume_tokens;
  std::string_view resume_text;
};

// What the broker reads from a worker message.
struct WorkerMessage {
  std::string_view kind;
  bool has_request_id = false;
  std::string_view request_id;
  bool has_attempt = false;
  int64_t attempt = 0;
  bool has_index = false;
  int64_t index = 0;
  std::vector<int64_t> token_ids;
  std::string_view text;
  std::string_view finish_reason;
  int64_t prompt_tokens = 0, cached_tokens = 0;  // final's usage (completion is the broker's)
  // register
  std::string_view worker_id, model;
  int64_t slots = 0, kv_blocks = 0;
  // heartbeat
  int64_t free_kv_blocks = 0, queue_len = 0;
  bool sessions_reset = false;
  std::vector<std::string_view> sessions_added, sessions_removed;
  // error
  std::string_view code, message;
  bool retryable = false;
};

// A version-1 map with a string kind: what both fast acceptors start from.
bool is_v1_map(const msgpack::Document& doc);

// A generate that protocol.decode_client_request accepts.
bool fast_client_request(const msgpack::Document& doc, const ProtocolLimits& limits);
// A delta or final that protocol.decode_worker_message accepts.
bool fast_worker_message(const msgpack::Document& doc, const ProtocolLimits& limits);

// Fields of a frame the protocol accepted; false if the frame does not parse
// so (which a frame clients/protocol accepted never does).
bool read_client_request(const msgpack::Document& doc, ClientRequest& out);
bool read_worker_message(const msgpack::Document& doc, WorkerMessage& out);

}  // namespace turbomq::broker
