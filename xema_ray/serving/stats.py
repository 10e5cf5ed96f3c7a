"""Request counters kept outside the Router (a Serve deployment of their own), so that
``/v1/stats`` does not restart from 0 when a Router replica is replaced."""

from __future__ import annotations


class Stats:
    """Serve deployment body; wrapped by ``serve.deployment`` in ``deployments/app.py``."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    async def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    async def get(self) -> dict[str, int]:
        return dict(self.counts)
