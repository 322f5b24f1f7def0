// pybind11 entry point of turbomq._native.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace turbomq {
void bind_kv_cache(py::module_& m);  // kv_cache_bindings.cpp
#ifdef TURBOMQ_WITH_CUDA
void bind_cuda(py::module_& m);  // native/cuda/cuda_bindings.cpp
#endif
#ifdef TURBOMQ_WITH_BROKER
void bind_broker(py::module_& m);  // native/broker/broker_bindings.cpp
#endif
}  // namespace turbomq

PYBIND11_MODULE(_native, m) {
  m.doc() = "turbomq native core: KV cache manager, kernels, the broker's data plane";
#ifdef TURBOMQ_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  turbomq::bind_kv_cache(m);
#ifdef TURBOMQ_WITH_CUDA
  turbomq::bind_cuda(m);
#endif
#ifdef TURBOMQ_WITH_BROKER
  turbomq::bind_broker(m);
#endif
}
