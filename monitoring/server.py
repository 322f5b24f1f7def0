"""Serve a registry on /metrics over HTTP, in a daemon thread."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server


@dataclass
class MetricsServer:
    httpd: object
    thread: object
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1",
                  port: int = 0) -> tuple[MetricsServer, int]:
    """Serve `registry`; port 0 picks a free port, so several workers on one
    host never collide. Returns (server, bound_port); server.close() stops it.
    Use host "0.0.0.0" where Prometheus scrapes from another container."""
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    bound = httpd.server_address[1]
    return MetricsServer(httpd, thread, host, bound), bound
