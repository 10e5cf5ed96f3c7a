"""The Router's request counter in Stats: one call per flush interval, not per request."""

from __future__ import annotations

import asyncio

from xema_ray.serving.stats import BufferedCounts


def test_counts_go_out_in_one_call_per_interval_and_on_flush() -> None:
    sent: list[tuple[str, int]] = []

    async def send(name: str, n: int) -> None:
        sent.append((name, n))

    async def main() -> None:
        c = BufferedCounts(send, flush_s=0.05)
        for _ in range(100):
            c.add("received")
        await asyncio.sleep(0.15)
        assert sent == [("received", 100)]  # a hundred requests, one call
        c.add("received")
        await c.flush()  # a reading flushes what is pending at once
        assert sent == [("received", 100), ("received", 1)]
        await asyncio.sleep(0.1)
        assert sent == [("received", 100), ("received", 1)]  # nothing sent twice

    asyncio.run(main())


def test_a_failed_send_never_raises() -> None:
    async def send(name: str, n: int) -> None:
        raise ConnectionError("Stats is gone")

    async def main() -> None:
        c = BufferedCounts(send, flush_s=0.01)
        c.add("received")
        await asyncio.sleep(0.05)
        await c.flush()

    asyncio.run(main())
