// Python bindings of the KV cache manager (turbomq._native.KVCacheManager).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kv_cache_manager.h"

namespace py = pybind11;

namespace turbomq {

void bind_kv_cache(py::module_& m) {
  // Unknown ids surface as KeyError, wrong states as ValueError; subclasses so
  // callers can catch them precisely. Other bad arguments raise ValueError
  // (std::invalid_argument) and check() failures raise RuntimeError.
  py::register_exception<SequenceNotFound>(m, "SequenceNotFoundError",
                                           PyExc_KeyError);
  py::register_exception<SequenceStateError>(m, "SequenceStateError",
                                             PyExc_ValueError);

  py::enum_<SeqState>(m, "SeqState")
      .value("ACTIVE", SeqState::kActive)
      .value("CACHED", SeqState::kCached)
      .value("EVICTED", SeqState::kEvicted);

  py::class_<KVCacheManager>(m, "KVCacheManager")
      .def(py::init<int64_t, int64_t>(), py::arg("num_blocks"),
           py::arg("block_size"))
      .def("acquire", &KVCacheManager::acquire, py::arg("seq_id"))
      .def("release", &KVCacheManager::release, py::arg("seq_id"))
      .def("reserve", &KVCacheManager::reserve, py::arg("seq_id"),
           py::arg("num_tokens"))
      .def("set_num_tokens", &KVCacheManager::set_num_tokens,
           py::arg("seq_id"), py::arg("num_tokens"))
      .def("num_tokens", &KVCacheManager::num_tokens, py::arg("seq_id"))
      .def("fork", &KVCacheManager::fork, py::arg("src_id"), py::arg("dst_id"),
           py::arg("num_tokens"))
      .def("attach_prefix", &KVCacheManager::attach_prefix, py::arg("seq_id"),
           py::arg("hashes"),
           "an ACTIVE sequence with an empty table takes the blocks named by the "
           "leading hashes; returns how many")
      .def("match_prefix", &KVCacheManager::match_prefix, py::arg("hashes"),
           "how many leading hashes name blocks in the pool")
      .def("commit_block_hashes", &KVCacheManager::commit_block_hashes,
           py::arg("seq_id"), py::arg("first_block"), py::arg("hashes"),
           "names the sequence's full blocks first_block, first_block + 1, ...")
      .def("set_record_reclaimed", &KVCacheManager::set_record_reclaimed,
           py::arg("on"),
           "list named blocks given new content (for a host-RAM tier)")
      .def("take_reclaimed", &KVCacheManager::take_reclaimed,
           "[(block, old name)] reclaimed since the last call; clears the list")
      .def("evict", &KVCacheManager::evict, py::arg("seq_id"))
      .def("erase", &KVCacheManager::erase, py::arg("seq_id"))
      .def("state", &KVCacheManager::state, py::arg("seq_id"))
      .def("contains", &KVCacheManager::contains, py::arg("seq_id"))
      .def("__contains__", &KVCacheManager::contains, py::arg("seq_id"))
      .def("block_table", &KVCacheManager::block_table, py::arg("seq_id"))
      .def(
          "block_tables",
          [](const KVCacheManager& self, const std::vector<SeqId>& seq_ids,
             int64_t width) {
            if (width < 0) {
              throw std::invalid_argument(
                  "block_tables: width must be >= 0, got " +
                  std::to_string(width));
            }
            py::array_t<int32_t> out(
                {static_cast<py::ssize_t>(seq_ids.size()),
                 static_cast<py::ssize_t>(width)});
            self.fill_block_tables(seq_ids.data(), seq_ids.size(), width,
                                   out.mutable_data());
            return out;
          },
          py::arg("seq_ids"), py::arg("width"),
          "int32 array [len(seq_ids), width] of block ids, rows padded with -1")
      .def_property_readonly("num_blocks", &KVCacheManager::num_blocks)
      .def_property_readonly("block_size", &KVCacheManager::block_size)
      .def_property_readonly("num_free_blocks",
                             &KVCacheManager::num_free_blocks)
      .def_property_readonly("num_used_blocks",
                             &KVCacheManager::num_used_blocks)
      .def("lru_order", &KVCacheManager::lru_order,
           "CACHED sequence ids, least recently used first")
      .def("last_evicted", &KVCacheManager::last_evicted,
           "ids evicted by the most recent reserve() call, in eviction order")
      .def("stats",
           [](const KVCacheManager& self) {
             KVCacheStats s = self.stats();
             py::dict d;
             d["evictions"] = s.evictions;
             d["cache_hits"] = s.cache_hits;
             d["cache_misses"] = s.cache_misses;
             d["evicted_tokens"] = s.evicted_tokens;
             d["active_sequences"] = s.active_sequences;
             d["cached_sequences"] = s.cached_sequences;
             d["evicted_sequences"] = s.evicted_sequences;
             d["prefix_queries"] = s.prefix_queries;
             d["prefix_hit_blocks"] = s.prefix_hit_blocks;
             d["cached_blocks"] = s.cached_blocks;
             d["cached_free_blocks"] = s.cached_free_blocks;
             d["cached_block_evictions"] = s.cached_block_evictions;
             return d;
           })
      .def("check", &KVCacheManager::check,
           "raise RuntimeError if any bookkeeping invariant is broken")
      .def("__repr__", [](const KVCacheManager& self) {
        return "KVCacheManager(num_blocks=" + std::to_string(self.num_blocks()) +
               ", block_size=" + std::to_string(self.block_size()) +
               ", free=" + std::to_string(self.num_free_blocks()) + ")";
      });
}

}  // namespace turbomq
