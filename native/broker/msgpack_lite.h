// A small msgpack reader and writer for the broker's data plane.
//
// The reader parses one frame into a flat tree of nodes that point into the
// frame (no copies); a map lookup returns the *last* pair with the key, which
// is what a Python dict built from the same frame holds. Strings must be
// valid UTF-8 and ext types are refused: msgpack-python with raw=False
// rejects the first and the protocol the second, so a frame that parses here
// decodes in Python to the same values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace turbomq::msgpack {

enum class Type : uint8_t { Nil, Bool, Int, UInt, Float, Str, Bin, Array, Map };

struct Node {
  Type type = Type::Nil;
  bool boolean = false;
  int64_t i = 0;            // Int: every integer that fits int64
  uint64_t u = 0;           // UInt: integers above INT64_MAX
  double f = 0.0;           // Float (float32 widened)
  std::string_view bytes;   // Str / Bin payload
  uint32_t count = 0;       // Array: items; Map: pairs; Str: code points
  int32_t first = -1;       // first child; a map's children are key, value, key, value, ...
  int32_t next = -1;        // next sibling
  const char* begin = nullptr;  // the node's encoded bytes
  const char* end = nullptr;
};

class Document {
 public:
  // False unless `data` holds exactly one well-formed object no deeper than
  // max_depth whose maps have str or bin keys, none repeated.
  bool parse(const char* data, size_t size, int max_depth = 32);

  const Node& root() const { return nodes_[0]; }
  const Node& node(int32_t index) const { return nodes_[index]; }
  // The value of the last pair whose key is the string `key`, or nullptr.
  const Node* get(const Node& map, std::string_view key) const;
  // Distinct keys of a map whose keys are all strings; -1 when one is not.
  int distinct_str_keys(const Node& map) const;

 private:
  int32_t parse_one(int depth);
  bool keys_unique(const Node& map) const;

  std::vector<Node> nodes_;
  const char* p_ = nullptr;
  const char* end_ = nullptr;
};

// Strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF), as
// Python's decoder; sets `code_points` when valid.
bool utf8_code_points(std::string_view s, uint32_t& code_points);

class Writer {
 public:
  void map(uint32_t pairs);
  void array(uint32_t items);
  void str(std::string_view s);
  void integer(int64_t v);
  void uinteger(uint64_t v);
  void real(double v);
  void boolean(bool v) { buf_.push_back(v ? '\xc3' : '\xc2'); }
  void nil() { buf_.push_back('\xc0'); }
  void raw(const char* begin, const char* end) { buf_.append(begin, end); }
  void raw(std::string_view bytes) { buf_.append(bytes.data(), bytes.size()); }

  const std::string& bytes() const { return buf_; }
  std::string take() { return std::move(buf_); }

 private:
  void be(uint64_t v, int n);
  std::string buf_;
};

}  // namespace turbomq::msgpack
