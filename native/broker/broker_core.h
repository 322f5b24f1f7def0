// The broker's data plane: one thread, two ROUTER sockets, all routing state.
//
// Clients (DEALER) talk to the front socket, workers (DEALER) to the back one.
// docs/broker.md describes routing, heartbeats, re-dispatch and cancellation;
// turbomq.broker wraps this class and keeps configuration, logging and
// metrics in Python. Nothing here touches Python: the hooks do, rarely (a
// frame the fast path does not accept, a log line, a tick).
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "broker_auth.h"
#include "broker_prefix.h"
#include "broker_protocol.h"
#include "msgpack_lite.h"

namespace turbomq::broker {

// turbomq.broker.BrokerConfig, passed down from Python.
struct BrokerSettings {
  std::string front = "tcp://127.0.0.1:5555";
  std::string back = "tcp://127.0.0.1:5556";
  double heartbeat_interval = 0.5;
  int64_t liveness = 3;
  int64_t queue_bound = 1024;
  double client_timeout = 30.0;
  double default_timeout = 300.0;
  double cancel_grace = 2.0;
  int64_t max_redispatch = 3;
  int64_t send_hwm = 100000;
  double spin_us = 250.0;
  // false: a request with no worker to run it waits (queued) until one comes or
  // its deadline passes; true: it fails at once with no_workers / worker_lost.
  bool fail_fast = false;
  std::string broker_id;  // this process's id, in pong and registered replies
  // CurveZMQ: the broker's secret key (Z85, 40 characters). Set, both sockets
  // encrypt and admit only the public keys allow() lists; empty: plain.
  std::string curve_secret_key;
  // Per-tenant limits (0: none); past one, new requests get rate_limited.
  int64_t tenant_max_inflight = 0;
  double tenant_tokens_per_s = 0.0;  // generated tokens, a bucket of this rate ...
  double tenant_token_burst_s = 10.0;  // ... holding this many seconds of it
  // Cache-aware routing of requests without a session (docs/broker.md,
  // "Prefix routing"): a key from the leading prefix_bytes of the request,
  // weighted rendezvous hashing over the workers, a load bound of
  // (1 + prefix_balance) times a worker's share. Off: the most free slots.
  bool prefix_routing = true;
  int64_t prefix_bytes = 256;
  double prefix_balance = 0.5;
  ProtocolLimits limits;
  std::vector<std::string> retryable_codes;  // protocol.RETRYABLE_CODES
};

enum class Side { Client = 0, Worker = 1 };

struct Rejection {
  std::string code, message;
  std::optional<std::string> request_id;
};

struct BrokerHooks {
  // clients/protocol's verdict on a frame the fast path did not accept: nullopt if valid.
  std::function<std::optional<Rejection>(Side, std::string_view)> validate;
  std::function<void(int level, const std::string&)> log;  // Python logging levels
  // Once per tick: the stats snapshot (msgpack), the durations of the
  // requests finished since the last tick and the waits in the queue of the
  // requests dispatched since then, in seconds.
  std::function<void(const std::string&, const std::vector<double>&, const std::vector<double>&)>
      tick;
  // Run pending signal handlers; false: stop.
  std::function<bool()> check_signals;
};

class BrokerCore {
 public:
  BrokerCore(BrokerSettings settings, BrokerHooks hooks);
  ~BrokerCore();
  BrokerCore(const BrokerCore&) = delete;
  BrokerCore& operator=(const BrokerCore&) = delete;

  const std::string& front_endpoint() const { return front_endpoint_; }
  const std::string& back_endpoint() const { return back_endpoint_; }

  void run();                        // until stop()
  void stop() { stopping_ = true; }  // from any thread
  void close();
  std::string stats_snapshot() const;  // msgpack map, as in a stats reply
  // CURVE only: replace the public keys admitted in a domain (kClientDomain,
  // kWorkerDomain) with `keys` (Z85 key -> name); from any thread.
  void allow(const std::string& domain, std::map<std::string, std::string> keys);

 private:
  struct Worker;  // these three are defined in broker_internal.h
  struct Pending;
  struct PendingEnd;
  using WorkerPtr = std::shared_ptr<Worker>;
  using PendingPtr = std::shared_ptr<Pending>;

  // ---- the socket loop, sending, frames, tick and stats (broker_core.cpp)
  void* router(const std::string& endpoint, const char* domain, std::string& bound);
  // Parses `frame` into doc_. nullopt when the protocol accepts it (at sight,
  // or else by clients/protocol's verdict); otherwise clients/protocol's rejection.
  std::optional<Rejection> accept(Side side, std::string_view frame);
  void drain(void* sock, Side side);
  static double now();
  void on_client_frame(const std::string& client, std::string_view frame, size_t extra_frames);
  void on_worker_frame(const std::string& ident, std::string_view frame, size_t extra_frames);
  void tick(double now);
  void log(int level, const std::string& message) const;

  // sending. Pointers are taken by value wherever a failed send can end in
  // worker_lost(), which clears the references it was handed.
  bool send_client(const std::string& client, const std::string& frame);
  bool send_worker(WorkerPtr worker, const std::string& frame);
  void send_raw(const std::string& ident, const std::string& frame);
  void reply_error(const std::string& client, std::optional<std::string_view> request_id,
                   std::string_view code, std::string_view message);
  std::string error_frame(std::optional<std::string_view> request_id, std::string_view code,
                          std::string_view message, std::optional<bool> retryable = std::nullopt);
  std::string delta_frame(const Pending& p, int64_t seq, int64_t index, const int64_t* tokens,
                          size_t n, std::string_view text);
  std::string final_frame(const Pending& p, std::string_view reason, int64_t prompt_tokens,
                          int64_t cached_tokens, bool with_tokens, std::string_view text);
  std::string cancel_frame(const Pending& p);

  // ---- routing and session affinity (broker_routing.cpp)
  void on_generate(const std::string& client, const ClientRequest& req, double now);
  void refuse(const std::string& client, std::string_view request_id, const std::string& code,
              const std::string& message);
  // Whether `tenant` may not start a request now (why says so).
  bool over_tenant_limit(const std::string& tenant, double now, std::string& why);
  // Where a request goes now, or null when every worker is full. `preferred`:
  // a stateless request went to its prefix key's first choice.
  WorkerPtr pick(const std::string* session_key, const uint64_t* prefix_key, bool& preferred);
  WorkerPtr pick(const Pending& p, bool& preferred);
  void dispatch(const PendingPtr& p, const WorkerPtr& worker, double now, bool preferred);
  void drain_queue();
  void remove_queued(const PendingPtr& p);
  void on_cancel(const std::string& client, std::string_view request_id);
  void on_end_session(const std::string& client, const ClientRequest& req);
  void on_session_ended(const std::string& key, const WorkerMessage* error);

  // ---- liveness: workers and clients coming and going (broker_liveness.cpp)
  WorkerPtr find_worker(const std::string& ident) const;
  void on_register(const std::string& ident, const WorkerMessage& msg);
  void on_heartbeat(const WorkerPtr& worker, const WorkerMessage& msg);
  void worker_lost(WorkerPtr worker, const std::string& why);
  void client_gone(const std::string& client, const std::string& outcome);

  // ---- the request table: worker replies and how a request ends (broker_requests.cpp)
  PendingPtr current(const WorkerPtr& worker, const WorkerMessage& msg);
  void on_delta(const WorkerPtr& worker, const WorkerMessage& msg);
  void on_final(const WorkerPtr& worker, const WorkerMessage& msg);
  void on_worker_error(const WorkerPtr& worker, const WorkerMessage& msg);
  void fail_gap(const PendingPtr& p, const WorkerMessage& msg);
  void forget_client_side(const PendingPtr& p);
  void release(const PendingPtr& p);
  void finish(const PendingPtr& p, const std::string& outcome);
  void last_reply(const PendingPtr& p, const std::string& frame);
  void fail(const PendingPtr& p, const std::string& code, const std::string& message);
  void cancelled_final(const PendingPtr& p);
  void abandon(const PendingPtr& p, const std::string& outcome);

  BrokerSettings settings_;
  BrokerHooks hooks_;
  void* ctx_ = nullptr;
  std::unique_ptr<ZapAuthenticator> auth_;  // CURVE only
  void* front_ = nullptr;
  void* back_ = nullptr;
  std::string front_endpoint_, back_endpoint_;
  std::atomic<bool> stopping_{false};
  double silence_s_;  // a worker's allowance between messages

  // Registration order: the first of equally loaded workers wins, as it always has.
  std::vector<WorkerPtr> workers_;
  std::unordered_map<std::string, PendingPtr> requests_;  // broker key -> request
  std::map<std::pair<std::string, std::string>, PendingPtr> by_client_;  // (client, request id)
  std::unordered_map<std::string, std::unordered_set<std::string>> client_requests_;
  std::unordered_map<std::string, double> client_seen_;
  std::deque<PendingPtr> queue_;
  std::unordered_map<std::string, WorkerPtr> affinity_;  // session -> worker holding its KV
  std::unordered_set<std::string> busy_sessions_;
  std::map<std::string, std::shared_ptr<PendingEnd>> pending_ends_;
  // The tenant of the client message being handled: the User-Id its CURVE
  // key was admitted under ("" in plain mode). Sessions are keyed
  // "tenant:session_id" everywhere, so tenants never meet.
  std::string tenant_;
  struct TenantUse {
    int64_t inflight = 0;
    double tokens = 0.0;  // the token bucket's level
    double refilled = 0.0;  // when it was last topped up
  };
  std::unordered_map<std::string, TenantUse> tenants_;
  std::unordered_set<std::string> retryable_;
  std::vector<RouteCandidate> candidates_;  // pick()'s scratch, reused
  uint64_t next_key_ = 0;

  struct Stats {
    int64_t requests_received = 0, requests_resumed = 0, redispatches = 0, redispatches_resumed = 0,
            duplicates_dropped = 0, stale_dropped = 0, cancels_forwarded = 0,
            workers_registered = 0, workers_lost = 0, messages_in = 0, messages_out = 0;
    std::map<std::string, int64_t> outcomes, routing, frames_rejected, worker_frames_rejected;
    // tenant -> outcome -> requests (tenants come from the allow-list: a bounded set)
    std::map<std::string, std::map<std::string, int64_t>> tenant_outcomes;
  } stats_;
  std::vector<double> finished_durations_, queue_waits_;

  msgpack::Document doc_;  // reused per message
  ClientRequest client_req_;
  WorkerMessage worker_msg_;
};

}  // namespace turbomq::broker
