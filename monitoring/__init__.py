"""turbomq.monitoring: the metric catalogue (every name, type, label, help
text) and the helpers that create and serve those metrics. See docs/metrics.md."""

from .catalogue import (BROKER_METRICS, COUNTER, GATEWAY_METRICS, GAUGE, HISTOGRAM, INFO,
                        WORKER_METRICS, MetricSpec, catalogue, series_names)
from .metrics import BrokerMetrics, GatewayMetrics, WorkerMetrics
from .server import MetricsServer, serve_metrics

__all__ = ["BROKER_METRICS", "COUNTER", "GATEWAY_METRICS", "GAUGE", "HISTOGRAM", "INFO", "WORKER_METRICS",
           "MetricSpec", "catalogue", "series_names", "BrokerMetrics", "GatewayMetrics", "WorkerMetrics",
           "MetricsServer", "serve_metrics"]
