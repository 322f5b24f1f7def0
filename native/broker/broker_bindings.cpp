// pybind11 layer of the broker's data plane (turbomq._native.broker).
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <zmq.h>

#include <chrono>
#include <stdexcept>

#include "broker_core.h"

namespace py = pybind11;

namespace turbomq {
namespace {

using broker::BrokerCore;
using broker::BrokerHooks;
using broker::BrokerSettings;
using broker::ProtocolLimits;
using broker::Rejection;
using broker::Side;

// Owns the core and the Python callables its hooks call (with the GIL).
class PyBroker {
 public:
  PyBroker(BrokerSettings settings, py::object validate, py::object log, py::object tick)
      : validate_(std::move(validate)), log_(std::move(log)), tick_(std::move(tick)) {
    BrokerHooks hooks;
    hooks.validate = [this](Side side, std::string_view frame) -> std::optional<Rejection> {
      py::gil_scoped_acquire gil;
      py::object verdict = validate_(static_cast<int>(side), py::bytes(frame.data(), frame.size()));
      if (verdict.is_none()) return std::nullopt;
      auto t = verdict.cast<py::tuple>();
      Rejection r{t[0].cast<std::string>(), t[1].cast<std::string>(), std::nullopt};
      if (!t[2].is_none()) r.request_id = t[2].cast<std::string>();
      return r;
    };
    hooks.log = [this](int level, const std::string& message) {
      py::gil_scoped_acquire gil;
      try {
        log_(level, message);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("turbomq broker log hook");
      }
    };
    if (!tick_.is_none()) {
      hooks.tick = [this](const std::string& snapshot, const std::vector<double>& durations,
                          const std::vector<double>& waits) {
        py::gil_scoped_acquire gil;
        tick_(py::bytes(snapshot), durations, waits);
      };
    }
    hooks.check_signals = [this]() {
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() == 0) return true;
      interrupted_ = std::make_unique<py::error_already_set>();
      return false;
    };
    core_ = std::make_unique<BrokerCore>(std::move(settings), std::move(hooks));
  }

  void run() {
    {
      py::gil_scoped_release release;
      core_->run();
    }
    if (interrupted_) {  // a signal handler raised: raise it here
      std::unique_ptr<py::error_already_set> e = std::move(interrupted_);
      throw *e;
    }
  }

  BrokerCore& core() { return *core_; }

 private:
  py::object validate_, log_, tick_;
  std::unique_ptr<py::error_already_set> interrupted_;
  std::unique_ptr<BrokerCore> core_;
};

py::object client_fields(const broker::ClientRequest& r) {
  py::dict d;
  d["kind"] = py::str(r.kind.data(), r.kind.size());
  d["request_id"] = py::str(r.request_id.data(), r.request_id.size());
  d["session_id"] = r.has_session ? py::object(py::str(r.session_id.data(), r.session_id.size()))
                                  : py::object(py::none());
  d["has_prompt"] = r.has_prompt;
  d["has_messages"] = r.has_messages;
  d["prompt_or_ids"] = py::bytes(r.prompt_or_ids.data(), r.prompt_or_ids.size());
  d["params"] = py::bytes(r.params.data(), r.params.size());
  d["stream"] = r.stream;
  d["timeout"] = r.timeout;
  return std::move(d);
}

py::object worker_fields(const broker::WorkerMessage& m) {
  py::dict d;
  auto s = [](std::string_view v) { return py::str(v.data(), v.size()); };
  d["kind"] = s(m.kind);
  d["request_id"] = m.has_request_id ? py::object(s(m.request_id)) : py::object(py::none());
  d["attempt"] = m.has_attempt ? py::object(py::int_(m.attempt)) : py::object(py::none());
  d["index"] = m.has_index ? py::object(py::int_(m.index)) : py::object(py::none());
  d["token_ids"] = m.token_ids;
  d["text"] = s(m.text);
  d["finish_reason"] = s(m.finish_reason);
  d["prompt_tokens"] = m.prompt_tokens;
  d["cached_tokens"] = m.cached_tokens;
  return std::move(d);
}

}  // namespace

void bind_broker(py::module_& parent) {
  py::module_ m = parent.def_submodule("broker", "the broker's data plane (libzmq)");

  py::class_<ProtocolLimits>(m, "ProtocolLimits")
      .def(py::init<>())
      .def_readwrite("max_frame_bytes", &ProtocolLimits::max_frame_bytes)
      .def_readwrite("max_prompt_tokens", &ProtocolLimits::max_prompt_tokens)
      .def_readwrite("max_prompt_chars", &ProtocolLimits::max_prompt_chars)
      .def_readwrite("max_id_chars", &ProtocolLimits::max_id_chars)
      .def_readwrite("max_new_tokens", &ProtocolLimits::max_new_tokens)
      .def_readwrite("max_stop_strings", &ProtocolLimits::max_stop_strings)
      .def_readwrite("max_stop_chars", &ProtocolLimits::max_stop_chars)
      .def_readwrite("max_stop_token_ids", &ProtocolLimits::max_stop_token_ids)
      .def_readwrite("max_delta_tokens", &ProtocolLimits::max_delta_tokens)
      .def_readwrite("max_text_chars", &ProtocolLimits::max_text_chars)
      .def_readwrite("max_timeout_s", &ProtocolLimits::max_timeout_s);

  py::class_<BrokerSettings>(m, "BrokerSettings")
      .def(py::init<>())
      .def_readwrite("front", &BrokerSettings::front)
      .def_readwrite("back", &BrokerSettings::back)
      .def_readwrite("heartbeat_interval", &BrokerSettings::heartbeat_interval)
      .def_readwrite("liveness", &BrokerSettings::liveness)
      .def_readwrite("queue_bound", &BrokerSettings::queue_bound)
      .def_readwrite("client_timeout", &BrokerSettings::client_timeout)
      .def_readwrite("default_timeout", &BrokerSettings::default_timeout)
      .def_readwrite("cancel_grace", &BrokerSettings::cancel_grace)
      .def_readwrite("max_redispatch", &BrokerSettings::max_redispatch)
      .def_readwrite("send_hwm", &BrokerSettings::send_hwm)
      .def_readwrite("spin_us", &BrokerSettings::spin_us)
      .def_readwrite("fail_fast", &BrokerSettings::fail_fast)
      .def_readwrite("broker_id", &BrokerSettings::broker_id)
      .def_readwrite("curve_secret_key", &BrokerSettings::curve_secret_key)
      .def_readwrite("tenant_max_inflight", &BrokerSettings::tenant_max_inflight)
      .def_readwrite("tenant_tokens_per_s", &BrokerSettings::tenant_tokens_per_s)
      .def_readwrite("tenant_token_burst_s", &BrokerSettings::tenant_token_burst_s)
      .def_readwrite("prefix_routing", &BrokerSettings::prefix_routing)
      .def_readwrite("prefix_bytes", &BrokerSettings::prefix_bytes)
      .def_readwrite("prefix_balance", &BrokerSettings::prefix_balance)
      .def_readwrite("limits", &BrokerSettings::limits)
      .def_readwrite("retryable_codes", &BrokerSettings::retryable_codes);

  py::class_<PyBroker>(m, "BrokerCore")
      .def(py::init<BrokerSettings, py::object, py::object, py::object>(), py::arg("settings"),
           py::arg("validate"), py::arg("log"), py::arg("tick") = py::none(),
           "Binds both sockets. validate(side, frame) -> None | (code, message, request_id); "
           "log(level, message); tick(stats_snapshot: bytes, durations: list[float]).")
      .def_property_readonly("front_endpoint", [](PyBroker& b) { return b.core().front_endpoint(); })
      .def_property_readonly("back_endpoint", [](PyBroker& b) { return b.core().back_endpoint(); })
      .def("run", &PyBroker::run, "Serve until stop() or a signal handler raises.")
      .def("stop", [](PyBroker& b) { b.core().stop(); })
      .def("allow", [](PyBroker& b, const std::string& domain,
                       std::map<std::string, std::string> keys) {
        b.core().allow(domain, std::move(keys));
      }, py::arg("domain"), py::arg("keys"),
         "CURVE only: the public keys (Z85 -> name) admitted in domain 'clients' or 'workers'.")
      .def("close", [](PyBroker& b) { b.core().close(); });

  m.def("zmq_version", [] {
    int major, minor, patch;
    zmq_version(&major, &minor, &patch);
    return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
  }, "the libzmq the data plane is linked with");

  // What the data plane reads from one frame (for tests against clients/protocol):
  // None unless the fast path accepts it, or, with fast_only=False, unless it parses.
  m.def("read_frame", [](int side, py::bytes frame, const ProtocolLimits& limits, bool fast_only) {
    std::string bytes = frame;
    msgpack::Document doc;
    const bool fits = static_cast<int64_t>(bytes.size()) <= limits.max_frame_bytes;
    if (!doc.parse(bytes.data(), bytes.size())) return py::object(py::none());
    if (side == static_cast<int>(Side::Client)) {
      if (fast_only && !(fits && broker::fast_client_request(doc, limits))) return py::object(py::none());
      broker::ClientRequest r;
      return broker::read_client_request(doc, r) ? client_fields(r) : py::object(py::none());
    }
    if (fast_only && !(fits && broker::fast_worker_message(doc, limits))) return py::object(py::none());
    broker::WorkerMessage w;
    return broker::read_worker_message(doc, w) ? worker_fields(w) : py::object(py::none());
  }, py::arg("side"), py::arg("frame"), py::arg("limits"), py::arg("fast_only") = true);

  // Prefix routing's two steps, as the data plane runs them (for tests).
  m.def("prefix_key", [](py::bytes frame, const std::string& tenant, int64_t prefix_bytes) {
    std::string bytes = frame;
    msgpack::Document doc;
    broker::ClientRequest r;
    if (!doc.parse(bytes.data(), bytes.size()) || !broker::read_client_request(doc, r) ||
        r.kind != "generate")
      return py::object(py::none());
    return py::object(py::int_(broker::prefix_key(doc, r, tenant, prefix_bytes)));
  }, py::arg("frame"), py::arg("tenant"), py::arg("prefix_bytes"),
     "The routing key of a generate frame (None if it is not one).");
  m.def("rendezvous_pick", [](uint64_t key, const std::vector<std::tuple<std::string, int64_t, int64_t>>& workers,
                              double balance) {
    std::vector<broker::RouteCandidate> candidates;
    for (const auto& [worker_id, slots, inflight] : workers)
      candidates.push_back({broker::hash_bytes(worker_id, broker::kWorkerIdSeed), slots, inflight});
    broker::RouteChoice c = broker::rendezvous_pick(key, candidates, balance);
    return py::make_tuple(c.index, c.preferred_index);
  }, py::arg("key"), py::arg("workers"), py::arg("balance"),
     "(chosen, first choice) indices into workers = [(worker_id, slots, inflight)]; chosen -1: all full.");
  m.def("prefix_routing_ns", [](py::bytes frame, const std::string& tenant, int64_t prefix_bytes,
                                int workers, int64_t iterations) {
    std::string bytes = frame;
    msgpack::Document doc;
    broker::ClientRequest r;
    if (!doc.parse(bytes.data(), bytes.size()) || !broker::read_client_request(doc, r) ||
        r.kind != "generate" || workers < 1 || iterations < 1)
      throw std::invalid_argument("a generate frame, workers >= 1 and iterations >= 1");
    std::vector<broker::RouteCandidate> candidates;
    for (int i = 0; i < workers; ++i)
      candidates.push_back({broker::hash_bytes("worker-" + std::to_string(i), broker::kWorkerIdSeed),
                            8, i % 8});
    volatile int64_t sink = 0;  // keeps the loop's work
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iterations; ++i) {
      const uint64_t key = broker::prefix_key(doc, r, tenant, prefix_bytes);
      sink = sink + broker::rendezvous_pick(key, candidates, 0.5).index;
    }
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - t0;
    return took.count() / static_cast<double>(iterations);
  }, py::arg("frame"), py::arg("tenant"), py::arg("prefix_bytes"), py::arg("workers"),
     py::arg("iterations"),
     "For benchmarks: nanoseconds per request of prefix routing's work (the key of this "
     "generate frame and the pick among `workers` workers), run in C++.");
}

}  // namespace turbomq
