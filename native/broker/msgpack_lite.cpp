#include "msgpack_lite.h"

#include <string>
#include <unordered_set>

#include <cstring>

namespace turbomq::msgpack {

bool utf8_code_points(std::string_view s, uint32_t& code_points) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  uint32_t n = 0;
  while (p < end) {
    unsigned c = *p;
    if (c < 0x80) {
      ++p;
    } else {
      int len;
      unsigned lo = 0x80, hi = 0xBF;  // bounds of the second byte
      if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
      } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0) lo = 0xA0;        // overlong
        else if (c == 0xED) hi = 0x9F;   // surrogates
      } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0) lo = 0x90;        // overlong
        else if (c == 0xF4) hi = 0x8F;   // past U+10FFFF
      } else {
        return false;
      }
      if (end - p < len || p[1] < lo || p[1] > hi) return false;
      for (int k = 2; k < len; ++k)
        if ((p[k] & 0xC0) != 0x80) return false;
      p += len;
    }
    ++n;
  }
  code_points = n;
  return true;
}

namespace {
inline uint64_t load_be(const char* p, int n) {
  uint64_t v = 0;
  for (int k = 0; k < n; ++k) v = (v << 8) | static_cast<unsigned char>(p[k]);
  return v;
}
}  // namespace

bool Document::parse(const char* data, size_t size, int max_depth) {
  nodes_.clear();
  p_ = data;
  end_ = data + size;
  if (parse_one(max_depth) != 0) return false;
  return p_ == end_;  // trailing bytes: not one object
}

int32_t Document::parse_one(int depth) {
  if (depth < 0 || p_ >= end_) return -1;
  const int32_t index = static_cast<int32_t>(nodes_.size());
  nodes_.emplace_back();
  const char* begin = p_;
  const auto c = static_cast<unsigned char>(*p_++);
  auto need = [&](size_t n) { return static_cast<size_t>(end_ - p_) >= n; };
  uint64_t length = 0;  // str/bin bytes, array items, map pairs
  if (c <= 0x7f) {
    nodes_[index].type = Type::Int;
    nodes_[index].i = c;
  } else if (c >= 0xe0) {
    nodes_[index].type = Type::Int;
    nodes_[index].i = static_cast<int8_t>(c);
  } else if (c <= 0x9f || (c >= 0xdc && c <= 0xdf)) {
    // fixmap / fixarray hold the count in the low nibble; map16/32, array16/32 after the byte.
    const bool is_map = c <= 0x8f || c >= 0xde;
    if (c <= 0x9f) {
      length = c & 0x0f;
    } else {
      int n = (c == 0xdc || c == 0xde) ? 2 : 4;
      if (!need(n)) return -1;
      length = load_be(p_, n);
      p_ += n;
    }
    nodes_[index].type = is_map ? Type::Map : Type::Array;
  } else if (c <= 0xbf || (c >= 0xd9 && c <= 0xdb) || (c >= 0xc4 && c <= 0xc6)) {
    const bool is_str = c <= 0xbf || c >= 0xd9;
    if (c <= 0xbf) {
      length = c & 0x1f;
    } else {
      int n = (c == 0xd9 || c == 0xc4) ? 1 : (c == 0xda || c == 0xc5) ? 2 : 4;
      if (!need(n)) return -1;
      length = load_be(p_, n);
      p_ += n;
    }
    if (!need(length)) return -1;
    Node& node = nodes_[index];
    node.type = is_str ? Type::Str : Type::Bin;
    node.bytes = std::string_view(p_, length);
    p_ += length;
    if (is_str && !utf8_code_points(node.bytes, node.count)) return -1;
  } else {
    Node& node = nodes_[index];
    switch (c) {
      case 0xc0: node.type = Type::Nil; break;
      case 0xc2: node.type = Type::Bool; node.boolean = false; break;
      case 0xc3: node.type = Type::Bool; node.boolean = true; break;
      case 0xca: {
        if (!need(4)) return -1;
        uint32_t bits = static_cast<uint32_t>(load_be(p_, 4));
        float v;
        std::memcpy(&v, &bits, 4);
        node.type = Type::Float;
        node.f = v;
        p_ += 4;
        break;
      }
      case 0xcb: {
        if (!need(8)) return -1;
        uint64_t bits = load_be(p_, 8);
        std::memcpy(&node.f, &bits, 8);
        node.type = Type::Float;
        p_ += 8;
        break;
      }
      case 0xcc: case 0xcd: case 0xce: case 0xcf: {
        int n = 1 << (c - 0xcc);
        if (!need(n)) return -1;
        uint64_t v = load_be(p_, n);
        p_ += n;
        if (v > static_cast<uint64_t>(INT64_MAX)) {
          node.type = Type::UInt;
          node.u = v;
        } else {
          node.type = Type::Int;
          node.i = static_cast<int64_t>(v);
        }
        break;
      }
      case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        int n = 1 << (c - 0xd0);
        if (!need(n)) return -1;
        uint64_t v = load_be(p_, n);
        p_ += n;
        int shift = 64 - 8 * n;  // sign-extend
        node.type = Type::Int;
        node.i = shift ? static_cast<int64_t>(v << shift) >> shift : static_cast<int64_t>(v);
        break;
      }
      default:
        return -1;  // 0xc1 (never used) and the ext types
    }
  }
  if (nodes_[index].type == Type::Array || nodes_[index].type == Type::Map) {
    const uint64_t children = nodes_[index].type == Type::Map ? 2 * length : length;
    // Each child takes at least one byte: a bogus count fails here, not in a huge loop.
    if (!need(children)) return -1;
    nodes_[index].count = static_cast<uint32_t>(length);
    int32_t prev = -1;
    for (uint64_t k = 0; k < children; ++k) {
      int32_t child = parse_one(depth - 1);
      if (child < 0) return -1;
      if (prev < 0) nodes_[index].first = child;
      else nodes_[prev].next = child;
      prev = child;
    }
    if (nodes_[index].type == Type::Map && !keys_unique(nodes_[index])) return -1;
  }
  nodes_[index].begin = begin;
  nodes_[index].end = p_;
  return index;
}

bool Document::keys_unique(const Node& map) const {
  // As the protocol's decoder: keys are str or bin, each once (a repeated
  // key would let two readers take different copies).
  std::unordered_set<std::string> seen;
  for (int32_t k = map.first; k >= 0; k = nodes_[nodes_[k].next].next) {
    const Node& key = nodes_[k];
    if (key.type != Type::Str && key.type != Type::Bin) return false;
    std::string tagged(1, key.type == Type::Str ? 's' : 'b');
    tagged.append(key.bytes);
    if (!seen.insert(std::move(tagged)).second) return false;
  }
  return true;
}

const Node* Document::get(const Node& map, std::string_view key) const {
  const Node* found = nullptr;
  for (int32_t k = map.first; k >= 0;) {
    const Node& name = nodes_[k];
    const Node& value = nodes_[name.next];
    if (name.type == Type::Str && name.bytes == key) found = &value;
    k = value.next;
  }
  return found;
}

int Document::distinct_str_keys(const Node& map) const {
  int distinct = 0;
  for (int32_t k = map.first; k >= 0; k = nodes_[nodes_[k].next].next) {
    const Node& name = nodes_[k];
    if (name.type != Type::Str) return -1;
    bool seen = false;
    for (int32_t j = map.first; j != k; j = nodes_[nodes_[j].next].next)
      if (nodes_[j].bytes == name.bytes) seen = true;
    distinct += !seen;
  }
  return distinct;
}

void Writer::be(uint64_t v, int n) {
  for (int k = n - 1; k >= 0; --k) buf_.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}

void Writer::map(uint32_t pairs) {
  if (pairs < 16) buf_.push_back(static_cast<char>(0x80 | pairs));
  else if (pairs < 65536) { buf_.push_back('\xde'); be(pairs, 2); }
  else { buf_.push_back('\xdf'); be(pairs, 4); }
}

void Writer::array(uint32_t items) {
  if (items < 16) buf_.push_back(static_cast<char>(0x90 | items));
  else if (items < 65536) { buf_.push_back('\xdc'); be(items, 2); }
  else { buf_.push_back('\xdd'); be(items, 4); }
}

void Writer::str(std::string_view s) {
  const size_t n = s.size();
  if (n < 32) buf_.push_back(static_cast<char>(0xa0 | n));
  else if (n < 256) { buf_.push_back('\xd9'); be(n, 1); }
  else if (n < 65536) { buf_.push_back('\xda'); be(n, 2); }
  else { buf_.push_back('\xdb'); be(n, 4); }
  buf_.append(s.data(), n);
}

void Writer::integer(int64_t v) {
  if (v >= 0) return uinteger(static_cast<uint64_t>(v));
  if (v >= -32) buf_.push_back(static_cast<char>(v));
  else if (v >= INT8_MIN) { buf_.push_back('\xd0'); be(static_cast<uint8_t>(v), 1); }
  else if (v >= INT16_MIN) { buf_.push_back('\xd1'); be(static_cast<uint16_t>(v), 2); }
  else if (v >= INT32_MIN) { buf_.push_back('\xd2'); be(static_cast<uint32_t>(v), 4); }
  else { buf_.push_back('\xd3'); be(static_cast<uint64_t>(v), 8); }
}

void Writer::uinteger(uint64_t v) {
  if (v < 128) buf_.push_back(static_cast<char>(v));
  else if (v < 256) { buf_.push_back('\xcc'); be(v, 1); }
  else if (v < 65536) { buf_.push_back('\xcd'); be(v, 2); }
  else if (v <= 0xffffffffULL) { buf_.push_back('\xce'); be(v, 4); }
  else { buf_.push_back('\xcf'); be(v, 8); }
}

void Writer::real(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  buf_.push_back('\xcb');
  be(bits, 8);
}

}  // namespace turbomq::msgpack
