"""turbomq.broker: routes client requests to workers (no torch here).

    from turbomq.broker import BrokerConfig, run_broker
    run_broker(BrokerConfig(front="tcp://127.0.0.1:5555", back="tcp://127.0.0.1:5556"))
"""

from .config import BrokerConfig
from .core import Broker, run_broker
from .main import main

__all__ = ["Broker", "BrokerConfig", "run_broker", "main"]
