"""turbomq.clients.gateway: the OpenAI-compatible HTTP gateway, one more
client of the broker (docs/gateway.md). `/v1/completions`,
`/v1/chat/completions` (streamed as server-sent events), `/v1/models`,
`/health` and `/metrics`, served by one asyncio process (Starlette on
uvicorn) that forwards each request through an AsyncClient per tenant.

Needs turbomq's [gateway] extra; importing turbomq.clients never imports it.

    from turbomq.clients.gateway import GatewayConfig, create_app
    app = create_app(GatewayConfig(broker=["tcp://127.0.0.1:5555"]))
"""

from .app import Gateway, create_app
from .config import ApiKeys, ConfigError, GatewayConfig, load_api_keys, new_api_key
from .server import run_gateway, serve

__all__ = ["ApiKeys", "ConfigError", "Gateway", "GatewayConfig", "create_app", "load_api_keys",
           "new_api_key", "run_gateway", "serve"]
