"""The gateway's HTTP application (Starlette): the OpenAI routes, API keys,
one AsyncClient per tenant, streaming as server-sent events, and a request
cancelled on its worker when its HTTP client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from turbomq.monitoring import GatewayMetrics

from .. import protocol as P
from ..aio import AsyncClient
from ..errors import TurbomqError
from ..keys import CurveClient, KeyFileError
from ..types import Delta, Final, Usage
from .config import ApiKeys, ConfigError, GatewayConfig
from .openai_api import (ApiError, Call, chunk, from_service, invalid, models_body,
                         parse_chat, parse_completion, response)

log = logging.getLogger("turbomq.gateway")

DEFAULT_TENANT = ""  # without API keys: the gateway's own identity at the broker


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


class Tenants:
    """One AsyncClient per tenant, made on first use: with CURVE each connects
    with its tenant's client key, so the broker knows every request's tenant."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.clients: dict[str, AsyncClient] = {}

    def check(self, tenants: set) -> None:
        """Refuse a tenant set this configuration cannot keep apart."""
        c = self.config
        if len(tenants) > 1 and not c.broker_key:
            raise ConfigError(
                f"the API keys name {len(tenants)} tenants, but a plain broker sees every "
                "client as one tenant: run the broker with CURVE and give --broker-key and "
                "--tenant-keys DIR (DIR/TENANT.key_secret per tenant)")
        if len(tenants) > 1 and not c.tenant_keys:
            raise ConfigError(
                f"the API keys name {len(tenants)} tenants: give --tenant-keys DIR "
                "(DIR/TENANT.key_secret per tenant), not one --curve-secret")
        if c.tenant_keys:
            missing = [t for t in sorted(tenants)
                       if not (Path(c.tenant_keys) / f"{t}.key_secret").is_file()]
            if missing:
                raise ConfigError(f"no client key in {c.tenant_keys} for tenant(s) "
                                  f"{', '.join(missing)} (expected TENANT.key_secret)")

    def curve_for(self, tenant: str) -> Optional[CurveClient]:
        c = self.config
        if not c.broker_key:
            return None
        secret = (Path(c.tenant_keys) / f"{tenant}.key_secret" if c.tenant_keys and tenant
                  else c.curve_secret)
        if secret is None:
            raise ConfigError(f"no client key for tenant {tenant!r}")
        try:
            return CurveClient.load(secret, c.broker_key)
        except KeyFileError as e:
            raise ConfigError(str(e)) from None

    def client(self, tenant: str) -> AsyncClient:
        client = self.clients.get(tenant)
        if client is None:
            client = AsyncClient(self.config.broker, timeout=self.config.request_timeout,
                                 curve=self.curve_for(tenant))
            self.clients[tenant] = client
        return client

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
        self.clients.clear()


class EventStream(StreamingResponse):
    """Server-sent events that end as soon as the HTTP client goes away,
    whatever ASGI version the server speaks: the body is streamed beside a
    watch on `receive`, then closed and `on_close` called, however it ended
    (even before the body started)."""

    def __init__(self, content, on_close: Callable[[], None], **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the connection broke mid-write
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
            self.on_close()


def _sse(obj: Any) -> str:
    return "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Gateway:
    def __init__(self, config: GatewayConfig, registry: Optional[CollectorRegistry] = None):
        config.check()
        self.config = config
        self.limits = P.DEFAULT_LIMITS
        self.registry = registry or CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.tenants = Tenants(config)
        self.api_keys = ApiKeys(config.api_keys, config.reload_interval) if config.api_keys else None
        self.tenants.check(self.api_keys.tenants if self.api_keys else {DEFAULT_TENANT})
        self.health: Optional[dict] = None  # the broker's last health answer; None: unknown
        self.broker_error: Optional[str] = None  # why the last health request failed
        self._health_task: Optional[asyncio.Task] = None
        self._side_tasks: set = set()
        self.started = int(time.time())

    # ------------------------------------------------------------ lifecycle
    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self._health_task = asyncio.get_running_loop().create_task(self._watch_health())
        try:
            yield
        finally:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._health_task
            await self.tenants.close()

    def _control_tenant(self) -> str:
        if self.api_keys and self.api_keys.tenants:
            return min(self.api_keys.tenants)
        return DEFAULT_TENANT

    async def _watch_health(self) -> None:
        while True:
            try:
                client = self.tenants.client(self._control_tenant())
                self.health = await client.health(timeout=max(2.0, self.config.health_interval))
                self.broker_error = None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the broker did not answer: no capacity known
                self.health = None
                self.broker_error = str(e) or type(e).__name__
            await asyncio.sleep(self.config.health_interval)

    def _spawn(self, coro) -> None:
        """Run `coro` on its own, outside the request's cancellation."""
        task = asyncio.get_running_loop().create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    # --------------------------------------------------------------- checks
    def _tenant(self, request: Request) -> str:
        if self.api_keys is None:
            return DEFAULT_TENANT
        self.api_keys.refresh(lambda keys: self.tenants.check(set(keys.values())))
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        tenant = self.api_keys.tenant(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer KEY`",
                           "invalid_request_error", "invalid_api_key")
        return tenant

    def _check_capacity(self) -> None:
        if self.broker_error is not None:
            raise ApiError(503, f"the broker does not answer: {self.broker_error}",
                           "service_unavailable_error", "no_capacity")
        if self.health is not None and self.health["workers"] == 0:
            raise ApiError(503, "no worker is connected to the broker",
                           "service_unavailable_error", "no_capacity")

    # --------------------------------------------------------------- routes
    async def models(self, request: Request) -> Response:
        try:
            self._tenant(request)
        except ApiError as e:
            self.metrics.requests.labels(endpoint="models", status=str(e.status)).inc()
            return JSONResponse(e.body(), e.status)
        self.metrics.requests.labels(endpoint="models", status="200").inc()
        return JSONResponse(models_body(list(self.config.served_model_names), self.started))

    async def health_route(self, request: Request) -> Response:
        h = self.health
        if h is None:
            return JSONResponse({"status": "unavailable", "workers": 0,
                                 "error": self.broker_error or "no answer from the broker yet"},
                                503)
        ok = h["workers"] > 0
        return JSONResponse({"status": "ok" if ok else "degraded", "workers": h["workers"],
                             "queue_depth": h["queue_depth"], "inflight": h["inflight"]},
                            200 if ok else 503)

    async def metrics_route(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion, "completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, parse_chat, "chat_completions")

    # ------------------------------------------------------------ generation
    async def _generate(self, request: Request, parse: Callable, endpoint: str) -> Response:
        start = time.monotonic()
        count = self.metrics.requests
        try:
            tenant = self._tenant(request)
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                raise invalid("the request body is not valid JSON") from None
            call = parse(body, self.limits)
            if call.model not in self.config.served_model_names:
                raise ApiError(404, f"The model `{call.model}` does not exist; this server has "
                               f"{', '.join(self.config.served_model_names)}",
                               "invalid_request_error", "model_not_found", "model")
            self._check_capacity()
            try:
                client = self.tenants.client(tenant)
            except ConfigError as e:  # e.g. a tenant's key file gone since it was checked
                log.error("no broker connection for tenant %r: %s", tenant, e)
                raise ApiError(500, "the gateway cannot reach the broker as this tenant",
                               "server_error", "internal") from None
        except ApiError as e:
            count.labels(endpoint=endpoint, status=str(e.status)).inc()
            return JSONResponse(e.body(), e.status)
        params = dict(call.params)
        timeout = min(params.pop("timeout", self.config.request_timeout),
                      self.config.request_timeout)
        kwargs = dict(call.inputs, **params, request_id=call.request_id, timeout=timeout)
        self.metrics.requests_in_flight.inc()
        if call.stream:
            return await self._stream(request, client, call, kwargs, endpoint, start)
        status = "200"
        try:
            result = await self._until_disconnect(request, client, call.request_id,
                                                  client.generate(**kwargs))
            self._count_tokens(result.usage)
            return JSONResponse(response(call, result.text, result.finish_reason, result.usage))
        except ClientGone:
            status = "499"
            return Response(status_code=499)
        except TurbomqError as e:
            err = from_service(e)
            status = str(err.status)
            return JSONResponse(err.body(), err.status)
        finally:
            self.metrics.requests_in_flight.dec()
            count.labels(endpoint=endpoint, status=status).inc()
            self.metrics.request_duration.observe(time.monotonic() - start)

    def _count_tokens(self, usage: Usage) -> None:
        self.metrics.tokens.labels(kind="prompt").inc(usage.prompt_tokens)
        self.metrics.tokens.labels(kind="cached").inc(usage.cached_tokens)
        self.metrics.tokens.labels(kind="completion").inc(usage.completion_tokens)

    async def _until_disconnect(self, request: Request, client: AsyncClient, request_id: str,
                                awaitable) -> Any:
        """Await `awaitable`, unless the HTTP client goes away first: then it
        is cancelled, the request with it (on the worker too), and ClientGone raised."""
        work = asyncio.ensure_future(awaitable)
        watch = asyncio.ensure_future(self._disconnected(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            watch.cancel()
            self._gone(client, request_id)
            raise
        if work.done():
            watch.cancel()
            return work.result()
        work.cancel()
        self._gone(client, request_id)
        raise ClientGone()

    def _gone(self, client: AsyncClient, request_id: str) -> None:
        self.metrics.disconnects.inc()
        # The client library cancels an abandoned request itself; this one is
        # sent from outside the request's own (cancelled) task, to be sure.
        if not client.closed:
            self._spawn(client.cancel(request_id))

    @staticmethod
    async def _disconnected(request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def _stream(self, request: Request, client: AsyncClient, call: Call, kwargs: dict,
                      endpoint: str, start: float) -> Response:
        events = client.generate(stream=True, **kwargs)
        end = _StreamEnd(self, client, call.request_id, events, endpoint, start)
        try:
            # The first event decides the status: an error before any output
            # is an HTTP error, not a stream.
            first = await self._until_disconnect(request, client, call.request_id,
                                                 events.__anext__())
        except ClientGone:
            end.status = "499"
            end.close(finished=True)  # cancelled already
            return Response(status_code=499)
        except TurbomqError as e:
            err = from_service(e)
            end.status = str(err.status)
            end.close(finished=True)
            return JSONResponse(err.body(), err.status)
        except BaseException:
            end.status = "500"
            end.close(finished=False)
            raise
        return EventStream(self._sse(call, events, first, end), end.close,
                           media_type="text/event-stream", headers=_SSE_HEADERS)

    async def _sse(self, call: Call, events, first, end: "_StreamEnd"):
        first_text = True
        event = first
        try:
            if call.chat:
                yield _sse(chunk(call, text="", role=True))
            while True:
                if isinstance(event, Delta):
                    if event.text:
                        if first_text:
                            self.metrics.ttft.observe(time.monotonic() - end.start)
                            first_text = False
                        yield _sse(chunk(call, text=event.text))
                elif isinstance(event, Final):
                    end.finished, end.status = True, "200"
                    self._count_tokens(event.usage)
                    yield _sse(chunk(call, reason=event.finish_reason))
                    if call.include_usage:
                        yield _sse(chunk(call, usage=event.usage))
                    yield "data: [DONE]\n\n"
                    return
                try:
                    event = await events.__anext__()
                except TurbomqError as e:  # after output began: the error ends the stream
                    end.finished = True
                    err = from_service(e)
                    end.status = str(err.status)
                    yield _sse(err.body())
                    yield "data: [DONE]\n\n"
                    return
        finally:
            end.close()


class _StreamEnd:
    """What ending a stream takes, once, however it ends: the request
    cancelled on the worker unless it finished, the counters."""

    def __init__(self, gateway: Gateway, client: AsyncClient, request_id: str, events,
                 endpoint: str, start: float):
        self.gateway, self.client, self.request_id, self.events = (gateway, client, request_id,
                                                                    events)
        self.endpoint, self.start = endpoint, start
        self.finished = False
        self.status = "499"  # unless it ends otherwise: the client went away
        self.closed = False

    def close(self, finished: Optional[bool] = None) -> None:
        if self.closed:
            return
        self.closed = True
        gw = self.gateway
        if not (self.finished if finished is None else finished):
            gw._gone(self.client, self.request_id)  # cancel on the worker
            gw._spawn(self.events.aclose())
        gw.metrics.requests_in_flight.dec()
        gw.metrics.requests.labels(endpoint=self.endpoint, status=self.status).inc()
        gw.metrics.request_duration.observe(time.monotonic() - self.start)


def create_app(config: GatewayConfig, registry: Optional[CollectorRegistry] = None) -> Starlette:
    """The gateway as an ASGI application (run it with any ASGI server)."""
    gw = Gateway(config, registry)
    routes = [
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/v1/completions", gw.completions, methods=["POST"]),
        Route("/v1/chat/completions", gw.chat_completions, methods=["POST"]),
        Route("/health", gw.health_route, methods=["GET"]),
        Route("/metrics", gw.metrics_route, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=gw.lifespan)
    app.state.gateway = gw
    return app
