"""turbomq.monitoring: the metric catalogue (every name, type, label, help
text) and the helpers that create and serve those metrics. See docs/metrics.md."""

from .catalogue import (BROKER_METRICS, COUNTER, GAUGE, HISTOGRAM, INFO, WORKER_METRICS,
                        MetricSpec, catalogue, series_names)
from .metrics import BrokerMetrics, WorkerMetrics
from .server import MetricsServer, serve_metrics

__all__ = ["BROKER_METRICS", "COUNTER", "GAUGE", "HISTOGRAM", "INFO", "WORKER_METRICS",
           "MetricSpec", "catalogue", "series_names", "BrokerMetrics", "WorkerMetrics",
           "MetricsServer", "serve_metrics"]
