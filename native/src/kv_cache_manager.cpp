#include "kv_cache_manager.h"

#include <algorithm>
#include <limits>

namespace turbomq {

namespace {

std::string seq_name(SeqId seq_id) {
  return "sequence " + std::to_string(seq_id);
}

}  // namespace

const char* to_string(SeqState state) {
  switch (state) {
    case SeqState::kActive:
      return "ACTIVE";
    case SeqState::kCached:
      return "CACHED";
    case SeqState::kEvicted:
      return "EVICTED";
  }
  return "UNKNOWN";
}

// ---------------------------------------------------------------- BlockPool

BlockPool::BlockPool(int32_t num_blocks)
    : refcounts_(num_blocks, 0),
      has_hash_(num_blocks, 0),
      hashes_(num_blocks, 0),
      cached_pos_(num_blocks) {
  free_stack_.reserve(num_blocks);
  // Pushed in reverse so that a fresh pool hands out 0, 1, 2, ...
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_stack_.push_back(b);
}

void BlockPool::forget_hash(BlockId block) {
  by_hash_.erase(hashes_[block]);
  has_hash_[block] = 0;
  hashes_[block] = 0;
}

BlockId BlockPool::allocate() {
  BlockId block;
  if (!free_stack_.empty()) {
    block = free_stack_.back();
    free_stack_.pop_back();
  } else {  // the least recently freed cached block gets new content
    block = cached_free_.front();
    cached_free_.pop_front();
    if (record_reclaimed_) reclaimed_.emplace_back(block, hashes_[block]);
    forget_hash(block);
    ++cached_evictions_;
  }
  refcounts_[block] = 1;
  return block;
}

void BlockPool::retain(BlockId block) {
  if (refcounts_[block] == 0) cached_free_.erase(cached_pos_[block]);
  ++refcounts_[block];
}

bool BlockPool::release(BlockId block) {
  if (--refcounts_[block] > 0) return false;
  if (has_hash_[block]) {
    cached_pos_[block] = cached_free_.insert(cached_free_.end(), block);
  } else {
    free_stack_.push_back(block);
  }
  return true;
}

void BlockPool::set_hash(BlockId block, BlockHash hash) {
  if (has_hash_[block] || by_hash_.count(hash) != 0) return;
  has_hash_[block] = 1;
  hashes_[block] = hash;
  by_hash_.emplace(hash, block);
}

BlockId BlockPool::lookup(BlockHash hash) const {
  auto it = by_hash_.find(hash);
  return it == by_hash_.end() ? -1 : it->second;
}

// ----------------------------------------------------------- KVCacheManager

static int32_t checked_num_blocks(int64_t num_blocks) {
  if (num_blocks < 0 || num_blocks > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("num_blocks must be in [0, 2^31-1], got " +
                                std::to_string(num_blocks));
  }
  return static_cast<int32_t>(num_blocks);
}

KVCacheManager::KVCacheManager(int64_t num_blocks, int64_t block_size)
    : pool_(checked_num_blocks(num_blocks)), block_size_(block_size) {
  if (block_size <= 0) {
    throw std::invalid_argument("block_size must be positive, got " +
                                std::to_string(block_size));
  }
  cached_refs_scratch_.assign(num_blocks, 0);
}

KVCacheManager::Sequence& KVCacheManager::get(SeqId seq_id, const char* op) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) {
    throw SequenceNotFound(std::string(op) + ": unknown " + seq_name(seq_id));
  }
  return it->second;
}

const KVCacheManager::Sequence& KVCacheManager::get(SeqId seq_id,
                                                    const char* op) const {
  return const_cast<KVCacheManager*>(this)->get(seq_id, op);
}

void KVCacheManager::require_state(SeqId seq_id, const Sequence& seq,
                                   SeqState wanted, const char* op) const {
  if (seq.state != wanted) {
    throw SequenceStateError(std::string(op) + ": " + seq_name(seq_id) +
                             " is " + to_string(seq.state) + ", expected " +
                             to_string(wanted));
  }
}

void KVCacheManager::set_state(Sequence& seq, SeqState next) {
  --state_counts_[static_cast<int>(seq.state)];
  ++state_counts_[static_cast<int>(next)];
  seq.state = next;
}

void KVCacheManager::drop_blocks(Sequence& seq) {
  for (BlockId block : seq.blocks) pool_.release(block);
  // Evicted sequences may linger for a long time; give the memory back.
  std::vector<BlockId>().swap(seq.blocks);
  seq.num_tokens = 0;
}

void KVCacheManager::evict_cached(Sequence& seq) {
  lru_.erase(seq.lru_pos);
  ++evictions_;
  evicted_tokens_ += seq.num_tokens;
  drop_blocks(seq);
  set_state(seq, SeqState::kEvicted);
}

int64_t KVCacheManager::acquire(SeqId seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) {
    seqs_.emplace(seq_id, Sequence{});
    ++state_counts_[static_cast<int>(SeqState::kActive)];
    return 0;
  }
  Sequence& seq = it->second;
  switch (seq.state) {
    case SeqState::kActive:
      throw SequenceStateError("acquire: " + seq_name(seq_id) +
                               " is already ACTIVE");
    case SeqState::kCached:
      lru_.erase(seq.lru_pos);
      if (seq.num_tokens > 0) ++cache_hits_;
      break;
    case SeqState::kEvicted:
      ++cache_misses_;
      break;
  }
  set_state(seq, SeqState::kActive);
  return seq.num_tokens;
}

void KVCacheManager::release(SeqId seq_id) {
  Sequence& seq = get(seq_id, "release");
  require_state(seq_id, seq, SeqState::kActive, "release");
  seq.lru_pos = lru_.insert(lru_.end(), seq_id);
  set_state(seq, SeqState::kCached);
}

int64_t KVCacheManager::blocks_freed_by_evicting_all_cached() const {
  // A block is freed only when every reference to it comes from a CACHED
  // table. Count cached references, then compare with the refcount; each
  // block is reset to 0 on its first visit so it is counted once.
  for (SeqId id : lru_) {
    for (BlockId block : seqs_.at(id).blocks) ++cached_refs_scratch_[block];
  }
  int64_t freed = 0;
  for (SeqId id : lru_) {
    for (BlockId block : seqs_.at(id).blocks) {
      int32_t cached_refs = cached_refs_scratch_[block];
      if (cached_refs != 0 && cached_refs == pool_.refcount(block)) ++freed;
      cached_refs_scratch_[block] = 0;
    }
  }
  return freed;
}

bool KVCacheManager::reserve(SeqId seq_id, int64_t num_tokens) {
  last_evicted_.clear();
  Sequence& seq = get(seq_id, "reserve");
  require_state(seq_id, seq, SeqState::kActive, "reserve");
  if (num_tokens < 0) {
    throw std::invalid_argument("reserve: num_tokens must be >= 0, got " +
                                std::to_string(num_tokens));
  }
  const int64_t blocks_wanted = num_tokens / block_size_ +
                                (num_tokens % block_size_ != 0 ? 1 : 0);
  const int64_t blocks_needed =
      blocks_wanted - static_cast<int64_t>(seq.blocks.size());
  if (blocks_needed <= 0) return true;
  if (blocks_needed > pool_.num_free()) {
    if (blocks_needed >
        pool_.num_free() + blocks_freed_by_evicting_all_cached()) {
      return false;  // nothing evicted: the precheck proved it cannot fit
    }
    while (pool_.num_free() < blocks_needed) {
      if (lru_.empty()) {  // unreachable unless the precheck is wrong
        throw std::logic_error("reserve: eviction precheck overestimated");
      }
      SeqId victim_id = lru_.front();
      evict_cached(seqs_.at(victim_id));
      last_evicted_.push_back(victim_id);
    }
  }
  seq.blocks.reserve(blocks_wanted);
  for (int64_t i = 0; i < blocks_needed; ++i) {
    seq.blocks.push_back(pool_.allocate());
  }
  return true;
}

void KVCacheManager::set_num_tokens(SeqId seq_id, int64_t num_tokens) {
  Sequence& seq = get(seq_id, "set_num_tokens");
  require_state(seq_id, seq, SeqState::kActive, "set_num_tokens");
  if (num_tokens < 0 || num_tokens > capacity_tokens(seq)) {
    throw std::invalid_argument(
        "set_num_tokens: " + seq_name(seq_id) + " num_tokens " +
        std::to_string(num_tokens) + " outside [0, " +
        std::to_string(capacity_tokens(seq)) + "] (table capacity)");
  }
  seq.num_tokens = num_tokens;
}

int64_t KVCacheManager::num_tokens(SeqId seq_id) const {
  return get(seq_id, "num_tokens").num_tokens;
}

void KVCacheManager::fork(SeqId src_id, SeqId dst_id, int64_t num_tokens) {
  if (src_id == dst_id) {
    throw std::invalid_argument("fork: src and dst are the same " +
                                seq_name(src_id));
  }
  Sequence& src = get(src_id, "fork");
  if (src.state == SeqState::kEvicted) {
    throw SequenceStateError("fork: source " + seq_name(src_id) +
                             " is EVICTED, expected ACTIVE or CACHED");
  }
  if (num_tokens < 0 || num_tokens > src.num_tokens) {
    throw std::invalid_argument(
        "fork: num_tokens " + std::to_string(num_tokens) + " outside [0, " +
        std::to_string(src.num_tokens) + "] (resident tokens of source " +
        seq_name(src_id) + ")");
  }
  auto dst_it = seqs_.find(dst_id);
  if (dst_it != seqs_.end() && dst_it->second.state != SeqState::kEvicted) {
    throw SequenceStateError("fork: destination " + seq_name(dst_id) + " is " +
                             to_string(dst_it->second.state) +
                             ", expected unknown or EVICTED");
  }
  if (dst_it == seqs_.end()) {
    Sequence fresh;
    fresh.state = SeqState::kEvicted;  // set_state below moves it to ACTIVE
    ++state_counts_[static_cast<int>(SeqState::kEvicted)];
    dst_it = seqs_.emplace(dst_id, std::move(fresh)).first;
  }
  Sequence& dst = dst_it->second;

  // Only full blocks are shared, so neither owner ever writes into them.
  const int64_t shared_blocks = num_tokens / block_size_;
  dst.blocks.assign(src.blocks.begin(), src.blocks.begin() + shared_blocks);
  for (BlockId block : dst.blocks) pool_.retain(block);
  dst.num_tokens = shared_blocks * block_size_;
  set_state(dst, SeqState::kActive);

  if (src.state == SeqState::kCached) {
    lru_.splice(lru_.end(), lru_, src.lru_pos);  // touched: now most recent
  }
}

int64_t KVCacheManager::attach_prefix(SeqId seq_id,
                                      const std::vector<BlockHash>& hashes) {
  Sequence& seq = get(seq_id, "attach_prefix");
  require_state(seq_id, seq, SeqState::kActive, "attach_prefix");
  if (!seq.blocks.empty()) {
    throw SequenceStateError("attach_prefix: " + seq_name(seq_id) + " already holds " +
                             std::to_string(seq.blocks.size()) + " blocks");
  }
  ++prefix_queries_;
  for (BlockHash hash : hashes) {
    const BlockId block = pool_.lookup(hash);
    if (block < 0) break;
    pool_.retain(block);
    seq.blocks.push_back(block);
  }
  prefix_hit_blocks_ += static_cast<int64_t>(seq.blocks.size());
  seq.num_tokens = capacity_tokens(seq);
  return static_cast<int64_t>(seq.blocks.size());
}

int64_t KVCacheManager::match_prefix(const std::vector<BlockHash>& hashes) const {
  int64_t matched = 0;
  for (BlockHash hash : hashes) {
    if (pool_.lookup(hash) < 0) break;
    ++matched;
  }
  return matched;
}

void KVCacheManager::commit_block_hashes(SeqId seq_id, int64_t first_block,
                                         const std::vector<BlockHash>& hashes) {
  Sequence& seq = get(seq_id, "commit_block_hashes");
  const int64_t full_blocks = seq.num_tokens / block_size_;
  const int64_t end = first_block + static_cast<int64_t>(hashes.size());
  if (first_block < 0 || end > full_blocks) {
    throw std::invalid_argument(
        "commit_block_hashes: blocks [" + std::to_string(first_block) + ", " +
        std::to_string(end) + ") of " + seq_name(seq_id) + " are not all full (" +
        std::to_string(full_blocks) + " full blocks written)");
  }
  for (int64_t i = first_block; i < end; ++i) {
    pool_.set_hash(seq.blocks[i], hashes[i - first_block]);
  }
}

void KVCacheManager::evict(SeqId seq_id) {
  Sequence& seq = get(seq_id, "evict");
  require_state(seq_id, seq, SeqState::kCached, "evict");
  evict_cached(seq);
}

void KVCacheManager::erase(SeqId seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) {
    throw SequenceNotFound("erase: unknown " + seq_name(seq_id));
  }
  Sequence& seq = it->second;
  if (seq.state == SeqState::kCached) lru_.erase(seq.lru_pos);
  drop_blocks(seq);
  --state_counts_[static_cast<int>(seq.state)];
  seqs_.erase(it);
}

SeqState KVCacheManager::state(SeqId seq_id) const {
  return get(seq_id, "state").state;
}

const std::vector<BlockId>& KVCacheManager::block_table(SeqId seq_id) const {
  return get(seq_id, "block_table").blocks;
}

void KVCacheManager::fill_block_tables(const SeqId* seq_ids, size_t count,
                                       int64_t width, int32_t* out) const {
  if (width < 0) {
    throw std::invalid_argument("block_tables: width must be >= 0, got " +
                                std::to_string(width));
  }
  for (size_t row = 0; row < count; ++row) {
    const std::vector<BlockId>& blocks = get(seq_ids[row], "block_tables").blocks;
    // A step only reads the blocks its context covers, while a table may hold
    // more (reserved ahead), so rows keep the first `width` entries.
    const int64_t length = std::min<int64_t>(static_cast<int64_t>(blocks.size()), width);
    int32_t* row_out = out + row * width;
    std::copy(blocks.begin(), blocks.begin() + length, row_out);
    std::fill(row_out + length, row_out + width, -1);
  }
}

std::vector<SeqId> KVCacheManager::lru_order() const {
  return std::vector<SeqId>(lru_.begin(), lru_.end());
}

KVCacheStats KVCacheManager::stats() const {
  KVCacheStats s;
  s.evictions = evictions_;
  s.cache_hits = cache_hits_;
  s.cache_misses = cache_misses_;
  s.evicted_tokens = evicted_tokens_;
  s.active_sequences = state_counts_[static_cast<int>(SeqState::kActive)];
  s.cached_sequences = state_counts_[static_cast<int>(SeqState::kCached)];
  s.evicted_sequences = state_counts_[static_cast<int>(SeqState::kEvicted)];
  s.prefix_queries = prefix_queries_;
  s.prefix_hit_blocks = prefix_hit_blocks_;
  s.cached_blocks = pool_.num_hashed();
  s.cached_free_blocks = pool_.num_cached_free();
  s.cached_block_evictions = pool_.cached_evictions();
  return s;
}

// -------------------------------------------------------------------- check

namespace {

[[noreturn]] void fail(const std::string& message) {
  throw std::runtime_error("KVCacheManager invariant violated: " + message);
}

}  // namespace

void KVCacheManager::check() const {
  const int32_t num_blocks = pool_.num_blocks();
  std::vector<int64_t> references(num_blocks, 0);
  int64_t counted_states[3] = {0, 0, 0};

  for (const auto& [seq_id, seq] : seqs_) {
    const std::string name = seq_name(seq_id);
    ++counted_states[static_cast<int>(seq.state)];
    if (seq.state == SeqState::kEvicted && !seq.blocks.empty()) {
      fail(name + " is EVICTED but owns " + std::to_string(seq.blocks.size()) +
           " blocks");
    }
    if (seq.num_tokens < 0 || seq.num_tokens > capacity_tokens(seq)) {
      fail(name + " has " + std::to_string(seq.num_tokens) +
           " resident tokens but its table holds " +
           std::to_string(capacity_tokens(seq)));
    }
    std::vector<BlockId> sorted = seq.blocks;
    std::sort(sorted.begin(), sorted.end());
    auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    if (dup != sorted.end()) {
      fail(name + " lists block " + std::to_string(*dup) +
           " more than once in its table");
    }
    for (BlockId block : seq.blocks) {
      if (block < 0 || block >= num_blocks) {
        fail(name + " references block " + std::to_string(block) +
             " outside [0, " + std::to_string(num_blocks) + ")");
      }
      ++references[block];
    }
  }

  for (int i = 0; i < 3; ++i) {
    if (counted_states[i] != state_counts_[i]) {
      fail(std::string("state counter for ") +
           to_string(static_cast<SeqState>(i)) + " is " +
           std::to_string(state_counts_[i]) + " but " +
           std::to_string(counted_states[i]) + " sequences are in that state");
    }
  }

  int64_t used = 0;
  for (BlockId block = 0; block < num_blocks; ++block) {
    if (pool_.refcount(block) != references[block]) {
      fail("block " + std::to_string(block) + " has refcount " +
           std::to_string(pool_.refcount(block)) + " but " +
           std::to_string(references[block]) + " table entries reference it");
    }
    if (references[block] > 0) ++used;
  }

  std::vector<bool> on_free_list(num_blocks, false);
  for (BlockId block : pool_.free_stack()) {
    if (block < 0 || block >= num_blocks) {
      fail("free list holds out-of-range block " + std::to_string(block));
    }
    if (on_free_list[block]) {
      fail("free list holds block " + std::to_string(block) + " twice");
    }
    on_free_list[block] = true;
    if (pool_.refcount(block) != 0) {
      fail("free list holds block " + std::to_string(block) +
           " whose refcount is " + std::to_string(pool_.refcount(block)));
    }
    if (pool_.has_hash(block)) {
      fail("free stack holds named block " + std::to_string(block));
    }
  }
  const auto& cached_free = pool_.cached_free();
  for (auto it = cached_free.begin(); it != cached_free.end(); ++it) {
    const BlockId block = *it;
    if (block < 0 || block >= num_blocks || on_free_list[block]) {
      fail("cached free list holds block " + std::to_string(block) +
           " out of range or twice");
    }
    on_free_list[block] = true;
    if (pool_.refcount(block) != 0 || !pool_.has_hash(block)) {
      fail("cached free list holds block " + std::to_string(block) +
           " with refcount " + std::to_string(pool_.refcount(block)) +
           (pool_.has_hash(block) ? "" : " and no name"));
    }
    if (!pool_.cached_position_ok(block, it)) {
      fail("block " + std::to_string(block) + " has a stale cached-list position");
    }
  }
  for (BlockId block = 0; block < num_blocks; ++block) {
    if (pool_.refcount(block) == 0 && !on_free_list[block]) {
      fail("block " + std::to_string(block) +
           " has refcount 0 but is not on a free list (leaked)");
    }
  }
  int64_t named = 0;
  for (BlockId block = 0; block < num_blocks; ++block) {
    if (!pool_.has_hash(block)) continue;
    ++named;
    if (pool_.lookup(pool_.hash(block)) != block) {
      fail("block " + std::to_string(block) + " is named but its hash maps elsewhere");
    }
  }
  if (named != pool_.num_hashed()) {
    fail("hash map holds " + std::to_string(pool_.num_hashed()) + " names but " +
         std::to_string(named) + " blocks are named");
  }
  if (num_free_blocks() + used != num_blocks) {
    fail("num_free " + std::to_string(num_free_blocks()) + " + used " +
         std::to_string(used) + " != num_blocks " + std::to_string(num_blocks));
  }

  std::unordered_map<SeqId, int> lru_seen;
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    const SeqId seq_id = *it;
    if (++lru_seen[seq_id] > 1) {
      fail(seq_name(seq_id) + " appears more than once in the LRU");
    }
    auto found = seqs_.find(seq_id);
    if (found == seqs_.end()) {
      fail("LRU holds unknown " + seq_name(seq_id));
    }
    if (found->second.state != SeqState::kCached) {
      fail("LRU holds " + seq_name(seq_id) + " which is " +
           to_string(found->second.state));
    }
    if (found->second.lru_pos != it) {
      fail(seq_name(seq_id) + " has a stale LRU position");
    }
  }
  if (static_cast<int64_t>(lru_.size()) != counted_states[1]) {
    fail("LRU holds " + std::to_string(lru_.size()) + " sequences but " +
         std::to_string(counted_states[1]) + " are CACHED");
  }
  for (int32_t count : cached_refs_scratch_) {
    if (count != 0) fail("eviction precheck scratch was not reset");
  }
}

}  // namespace turbomq
