"""The emulated asynchronous device (xema_ray.platforms.async_host) itself: side-stream copies wait
in a queue until ordered, device memory is the host arena handed out again at once, and what CUDA
would get wrong shows up as a named hazard, or (``on_hazard="record"``) as the wrong bytes."""

from __future__ import annotations

from collections.abc import Iterator

import re

import pytest
import torch

from tests.host_arena import alloc, device  # noqa: F401 - fixtures
from xema_ray.allocator.emulated import locate
from xema_ray.allocator.runtime import StaticAllocator
from xema_ray.platforms import streams
from xema_ray.platforms.async_host import AsyncHostDevice, StreamHazard

pytestmark = pytest.mark.streams


@pytest.fixture
def make(alloc: StaticAllocator, device: int) -> Iterator:  # type: ignore[type-arg]
    alloc.reserve(0, 1 << 20, device=device)
    made: list = []

    def build(**kw: object) -> AsyncHostDevice:
        dev = AsyncHostDevice(str(alloc.library_path), device, lambda p: locate(alloc, p, device), **kw)  # type: ignore[arg-type]
        made.append(dev.installed())
        made[-1].__enter__()
        return dev

    yield build
    for ctx in made:
        ctx.__exit__(None, None, None)
    import gc

    gc.collect()
    alloc.poll(device=device)


def _hazard(fn) -> str | None:  # type: ignore[no-untyped-def]
    """The hazard ``fn`` raised (its traceback, and the tensors its frames hold, let go at once)."""
    try:
        fn()
    except StreamHazard as e:
        return str(e)
    return None


def _offload(pin: bool = True) -> tuple[torch.Tensor, object]:
    """What activation offload does: a device tensor's copy to the host queued, the tensor dropped,
    compute goes on allocating."""
    side = streams.TransferStream(torch.device("cpu"))
    t = torch.full((1024,), 7.0)
    host, event = streams.to_host(t, pin=pin, stream=side)
    del t
    _ = [torch.full((1024,), float(i)) for i in range(4)]  # the compute stream's next blocks
    streams.host_ready(event)
    return host, event


def test_the_copy_waits_until_ordered_and_reads_the_right_bytes(make) -> None:  # type: ignore[no-untyped-def]
    dev = make()
    with dev.running():
        host, _ = _offload()
    assert torch.equal(host, torch.full((1024,), 7.0)) and dev.hazards == []


def test_error_raised_if_the_source_is_reused_before_the_copy(make, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    dev = make()
    monkeypatch.setattr(streams, "mark_used", lambda t, s: None)  # record_stream under the pluggable allocator
    with dev.running():
        message = _hazard(_offload)
    assert message is not None and re.match(r"block #\d+ at offset 0x[0-9a-f]+ of the dynamic region \(4096 bytes\) "
                                            r"freed at compute event \d+, reused by stream compute", message), message


def test_recorded_hazard_gives_the_wrong_bytes(make, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    dev = make(on_hazard="record")
    monkeypatch.setattr(streams, "mark_used", lambda t, s: None)
    with dev.running():
        host, _ = _offload()
    assert not torch.equal(host, torch.full((1024,), 7.0))  # the compute stream's bytes, as a GPU would read
    assert any("read by stream side-" in h for h in dev.hazards)


def test_eager_policy_shows_nothing(make, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    dev = make(policy="eager")  # a synchronous device: what the CPU platform always was
    monkeypatch.setattr(streams, "mark_used", lambda t, s: None)
    with dev.running():
        host, _ = _offload()
    assert torch.equal(host, torch.full((1024,), 7.0)) and dev.hazards == []


def test_error_raised_if_compute_reads_a_copy_it_did_not_wait_for(make) -> None:  # type: ignore[no-untyped-def]
    dev = make()
    side = streams.TransferStream(torch.device("cpu"))
    with dev.running():
        x = streams.to_device(torch.ones(256), torch.device("cpu"), side)
        with pytest.raises(StreamHazard, match="before the copy into it on stream side-"):
            (x * 2).sum()
        side.wait(side.record(), [x])  # what the hooks do: compute ordered after the copy
        assert float((x * 2).sum()) == 512.0


def test_pending_free_counts_until_the_side_stream_ran(make, alloc: StaticAllocator, device: int) -> None:  # type: ignore[no-untyped-def]
    dev = make()
    side = streams.TransferStream(torch.device("cpu"))
    with dev.running():
        t = torch.full((1024,), 1.0)
        host, event = streams.to_host(t, pin=True, stream=side)
        del t
        s = alloc.stats(device=device)
        assert s.pending_free_bytes == 4096 and s.pending_blocks == 1
        streams.host_ready(event)
        alloc.poll(device=device)
        assert alloc.stats(device=device).pending_blocks == 0
