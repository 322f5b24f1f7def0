"""turbomq.worker.cli: the `turbomq` command (`main`), `turbomq up` (`up`:
broker, workers and Redis on this machine) and `turbomq chat` (`chat`)."""

from .main import main

__all__ = ["main"]
