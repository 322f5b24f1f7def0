// KV cache bookkeeping: a refcounted pool of fixed-size blocks and an LRU
// "cache of KV caches" over sequences. No tensors live here; the engine owns
// the KV memory and reads it through the block tables kept by this class.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace turbomq {

using SeqId = int64_t;
using BlockId = int32_t;
// Names a full block by its content: a hash chained over the token ids of
// every block up to and including it (computed by the engine).
using BlockHash = uint64_t;

// ACTIVE: in a batch slot. CACHED: KV resident, no slot, in the LRU.
// EVICTED: KV dropped; the caller still holds the token ids elsewhere.
enum class SeqState : uint8_t { kActive = 0, kCached = 1, kEvicted = 2 };

const char* to_string(SeqState state);

// The seq_id is not known to the manager (Python: KeyError subclass).
class SequenceNotFound : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// The sequence is in the wrong state for the operation (Python: ValueError
// subclass).
class SequenceStateError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Fixed pool of block ids with refcounts. A free block either sits on a LIFO
// stack (no content worth keeping) or, when it holds a full block named by a
// hash, in an LRU of cached blocks that a later prompt with the same prefix
// takes back. Allocation takes the stack first, then the least recently
// freed cached block (forgetting its hash). All operations are O(1).
class BlockPool {
 public:
  explicit BlockPool(int32_t num_blocks);

  // Precondition: num_free() > 0. The block comes back with refcount 1.
  BlockId allocate();
  // Adds an owner to a block in use, or revives a cached free block.
  void retain(BlockId block);
  // Drops an owner; returns true when the block became free.
  bool release(BlockId block);
  // Names a block (no-op if it has a name, or another block has this one).
  void set_hash(BlockId block, BlockHash hash);
  // The block named `hash`, or -1.
  BlockId lookup(BlockHash hash) const;

  int32_t refcount(BlockId block) const { return refcounts_[block]; }
  bool has_hash(BlockId block) const { return has_hash_[block] != 0; }
  BlockHash hash(BlockId block) const { return hashes_[block]; }
  int32_t num_blocks() const { return static_cast<int32_t>(refcounts_.size()); }
  // Blocks allocate() can hand out: the stack plus the cached free blocks.
  int32_t num_free() const {
    return static_cast<int32_t>(free_stack_.size() + cached_free_.size());
  }
  int32_t num_cached_free() const { return static_cast<int32_t>(cached_free_.size()); }
  int64_t num_hashed() const { return static_cast<int64_t>(by_hash_.size()); }
  int64_t cached_evictions() const { return cached_evictions_; }
  // With recording on, every named block that allocate() gives new content
  // is listed with its old name, until take_reclaimed() hands the list over
  // (the engine copies that content to its host-RAM tier first).
  void set_record_reclaimed(bool on) { record_reclaimed_ = on; }
  std::vector<std::pair<BlockId, BlockHash>> take_reclaimed() {
    return std::exchange(reclaimed_, {});
  }
  const std::vector<BlockId>& free_stack() const { return free_stack_; }
  const std::list<BlockId>& cached_free() const { return cached_free_; }
  bool cached_position_ok(BlockId block, std::list<BlockId>::const_iterator it) const {
    return cached_pos_[block] == it;
  }
  const std::unordered_map<BlockHash, BlockId>& by_hash() const { return by_hash_; }

 private:
  void forget_hash(BlockId block);

  std::vector<int32_t> refcounts_;
  std::vector<BlockId> free_stack_;
  std::vector<uint8_t> has_hash_;
  std::vector<BlockHash> hashes_;
  std::list<BlockId> cached_free_;  // refcount 0 and named, oldest first
  std::vector<std::list<BlockId>::iterator> cached_pos_;
  std::unordered_map<BlockHash, BlockId> by_hash_;
  int64_t cached_evictions_ = 0;  // named free blocks reused for new content
  bool record_reclaimed_ = false;
  std::vector<std::pair<BlockId, BlockHash>> reclaimed_;
};

struct KVCacheStats {
  int64_t evictions = 0;
  int64_t cache_hits = 0;
  int64_t cache_misses = 0;
  int64_t evicted_tokens = 0;  // resident tokens dropped by evictions
  int64_t active_sequences = 0;
  int64_t cached_sequences = 0;
  int64_t evicted_sequences = 0;
  int64_t prefix_queries = 0;      // attach_prefix calls
  int64_t prefix_hit_blocks = 0;   // blocks they attached
  int64_t cached_blocks = 0;       // named blocks (in use or free)
  int64_t cached_free_blocks = 0;  // named blocks no table holds
  int64_t cached_block_evictions = 0;
};

class KVCacheManager {
 public:
  KVCacheManager(int64_t num_blocks, int64_t block_size);

  // Makes the sequence ACTIVE (creating it empty if unknown) and returns the
  // number of KV tokens still resident.
  int64_t acquire(SeqId seq_id);
  // ACTIVE -> CACHED at the most-recently-used end of the LRU.
  void release(SeqId seq_id);
  // Grows an ACTIVE sequence's table to cover num_tokens tokens, evicting
  // least-recently-used CACHED sequences if needed. All-or-nothing.
  bool reserve(SeqId seq_id, int64_t num_tokens);
  void set_num_tokens(SeqId seq_id, int64_t num_tokens);
  int64_t num_tokens(SeqId seq_id) const;
  // New ACTIVE dst sharing src's first floor(num_tokens / block_size) blocks.
  void fork(SeqId src_id, SeqId dst_id, int64_t num_tokens);
  // Prefix caching. An ACTIVE sequence with an empty table takes the pool's
  // blocks named by the leading `hashes` (refcount + 1 each; cached free
  // blocks are revived) and its resident tokens become their count times
  // block_size. Returns the number of blocks attached.
  int64_t attach_prefix(SeqId seq_id, const std::vector<BlockHash>& hashes);
  // How many leading `hashes` name blocks in the pool (changes nothing).
  int64_t match_prefix(const std::vector<BlockHash>& hashes) const;
  // Names the sequence's full, written blocks first_block, first_block+1, ...
  // so later prompts with the same prefix reuse them.
  void commit_block_hashes(SeqId seq_id, int64_t first_block,
                           const std::vector<BlockHash>& hashes);
  // Host-RAM tier support: see BlockPool::set_record_reclaimed.
  void set_record_reclaimed(bool on) { pool_.set_record_reclaimed(on); }
  std::vector<std::pair<BlockId, BlockHash>> take_reclaimed() {
    return pool_.take_reclaimed();
  }
  // Forces a CACHED sequence to EVICTED.
  void evict(SeqId seq_id);
  // Forgets the sequence in any state, dropping its blocks.
  void erase(SeqId seq_id);

  SeqState state(SeqId seq_id) const;
  bool contains(SeqId seq_id) const { return seqs_.count(seq_id) != 0; }
  const std::vector<BlockId>& block_table(SeqId seq_id) const;
  // Writes a row of `width` entries per id into out (row-major): the first
  // `width` blocks of each table, padded with -1.
  void fill_block_tables(const SeqId* seq_ids, size_t count, int64_t width,
                         int32_t* out) const;

  int64_t num_blocks() const { return pool_.num_blocks(); }
  int64_t block_size() const { return block_size_; }
  int64_t num_free_blocks() const { return pool_.num_free(); }
  int64_t num_used_blocks() const { return pool_.num_blocks() - pool_.num_free(); }

  // Oldest first.
  std::vector<SeqId> lru_order() const;
  // Ids evicted by the most recent reserve() call, in eviction order.
  const std::vector<SeqId>& last_evicted() const { return last_evicted_; }
  KVCacheStats stats() const;

  // Verifies every invariant; throws std::runtime_error naming the first
  // violation.
  void check() const;

 private:
  struct Sequence {
    SeqState state = SeqState::kActive;
    std::vector<BlockId> blocks;
    int64_t num_tokens = 0;                // tokens whose KV is written
    std::list<SeqId>::iterator lru_pos;    // valid only while CACHED
  };

  Sequence& get(SeqId seq_id, const char* op);
  const Sequence& get(SeqId seq_id, const char* op) const;
  void require_state(SeqId seq_id, const Sequence& seq, SeqState wanted,
                     const char* op) const;
  void set_state(Sequence& seq, SeqState next);
  void drop_blocks(Sequence& seq);
  void evict_cached(Sequence& seq);
  // Blocks that evicting every CACHED sequence would return to the pool.
  int64_t blocks_freed_by_evicting_all_cached() const;
  int64_t capacity_tokens(const Sequence& seq) const {
    return static_cast<int64_t>(seq.blocks.size()) * block_size_;
  }

  BlockPool pool_;
  int64_t block_size_;
  std::unordered_map<SeqId, Sequence> seqs_;  // element references are stable
  std::list<SeqId> lru_;                      // CACHED ids, oldest first
  std::vector<SeqId> last_evicted_;
  int64_t state_counts_[3] = {0, 0, 0};
  int64_t evictions_ = 0;
  int64_t cache_hits_ = 0;
  int64_t cache_misses_ = 0;
  int64_t evicted_tokens_ = 0;
  int64_t prefix_queries_ = 0;
  int64_t prefix_hit_blocks_ = 0;
  // Per-block counter for the eviction precheck; kept all-zero between calls
  // so the precheck allocates nothing.
  mutable std::vector<int32_t> cached_refs_scratch_;
};

}  // namespace turbomq
