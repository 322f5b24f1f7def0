"""Run the gateway: one asyncio process (uvicorn) serving the app. It prints
one JSON line once it listens (`{"gateway": URL, "port": N}`), for scripts
and `turbomq up`; SIGINT or SIGTERM stops it: no new connections, and
responses in flight get `shutdown_grace` seconds to finish."""

from __future__ import annotations

import asyncio
import json
import logging

import uvicorn

from .app import create_app
from .config import GatewayConfig

log = logging.getLogger("turbomq.gateway")


async def serve(config: GatewayConfig) -> None:
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level.lower(),
        access_log=False, lifespan="on", backlog=4096, timeout_keep_alive=30,
        # thousands of concurrent streams: no cap on connections here; the
        # broker's queue bound and per-tenant limits answer overload (429)
        limit_concurrency=None, server_header=False,
        timeout_graceful_shutdown=config.shutdown_grace))
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        if task.done():
            await task  # it failed to start: raise why
            raise RuntimeError("the gateway stopped while starting")
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    host = config.host if config.host not in ("0.0.0.0", "::") else "127.0.0.1"
    print(json.dumps({"gateway": f"http://{host}:{port}", "port": port,
                      "broker": config.broker}), flush=True)
    await task


def run_gateway(config: GatewayConfig) -> None:
    try:  # uvloop where installed (the [gateway] extra brings it): a faster event loop
        import uvloop
    except ImportError:
        asyncio.run(serve(config))
        return
    uvloop.run(serve(config))
