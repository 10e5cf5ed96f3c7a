"""Host-homed weights: one exact-size buffer per component, one shared segment per node.

On CPU nothing is page-locked (``Platform.register_host`` is CUDA's), but the buffers, the views,
the shared segment and its lifetime are the same code a GPU worker runs; the GPU check measures
the pinned bytes (tests/gpu/test_host_memory_gpu.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.models.host_pack import plan_pack
from xema_ray.models.loading import build_on_meta
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.placement import HOST_BUFFER_ATTR, PLACEMENT_ATTR, WeightHome
from xema_ray.platforms.host_memory import HostBuffer, SharedSegments, process_owner, torch_pinned_bytes
from xema_ray.runtime.residency import Residency
from xema_ray.runtime.worker import ModelLoadConfig, Worker

HOST = ("transformer.transformer_blocks.0", "transformer.single_transformer_blocks.1")


@pytest.fixture
def shm(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    d = tmp_path / "shm"
    monkeypatch.setenv("XEMA_SHM_DIR", str(d))
    return d


def _transformer(host: tuple[str, ...] = HOST, share: bool = False):  # type: ignore[no-untyped-def]
    spec = get_model_spec("tiny-flux2")
    return spec.build_transformer(BuildOptions(device="cpu", seed=3, host_modules=host, share_host=share))


def _segments(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("xema-*") if not p.name.endswith((".lock", ".partial", ".owner"))) if d.exists() else []


def test_power_of_two_rounding_is_torchs() -> None:
    assert [torch_pinned_bytes(n) for n in (1, 1000, 1024, 1025, 3 * 2**30)] == [1, 1024, 1024, 2048, 4 * 2**30]


def test_host_tensors_are_views_into_one_exact_buffer_with_the_same_values() -> None:
    plain, homed = _transformer(()), _transformer()
    buf = getattr(homed, HOST_BUFFER_ATTR)
    report = getattr(homed, PLACEMENT_ATTR)
    assert isinstance(buf, HostBuffer) and not buf.shared
    host = [t for p in HOST for t in homed.get_submodule(p.removeprefix("transformer.")).parameters()]
    base = buf.data.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in host)  # views into the one buffer
    assert report.host_bytes == sum(t.numel() * t.element_size() for t in host)
    # exact: the tensors plus at most one alignment gap each, never a power of two per tensor
    assert report.host_bytes <= report.host_buffer_bytes < report.host_bytes + 256 * len(host)
    assert report.host_buffer_bytes == buf.nbytes and report.host_pinned_bytes == 0  # CPU: nothing page-locked
    for (name, a), b in zip(plain.state_dict().items(), homed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the same bytes wherever they live


def test_the_pack_matches_what_the_loader_places() -> None:
    spec = get_model_spec("tiny-flux2")
    meta = build_on_meta(spec.transformer_class(), spec.transformer_config, torch.bfloat16)
    prefixes = tuple(p.removeprefix("transformer.") for p in HOST)
    pack = plan_pack(meta, torch.bfloat16, lambda p: WeightHome.HOST if p.startswith(prefixes) else WeightHome.DEVICE)
    placed = spec.build_transformer(BuildOptions(device="meta", dtype=torch.bfloat16, host_modules=HOST))
    report = getattr(placed, PLACEMENT_ATTR)
    assert (report.host_bytes, report.host_buffer_bytes, report.host_pow2_bytes) == (
        pack.tensor_bytes, pack.nbytes, pack.pow2_bytes)
    assert report.host_pinned_bytes == pack.nbytes  # meta stands for a GPU worker: the buffer is pinned there
    assert pack.pow2_bytes > pack.nbytes  # what per-tensor pinning wasted


def test_workers_share_one_segment_and_the_last_one_removes_it(shm: Path) -> None:
    load = ModelLoadConfig(model="tiny-flux2", plans=(), share_host_weights="on", seed=3)
    workers, loaded = [], []
    residency = Residency(host_blocks=(0, 2))
    for _ in range(2):
        w = Worker(platform="cpu")
        w.init_device(ParallelConfig(rank=0, world_size=1))
        loaded.append(w.load_model(_with_blocks(load, residency)))
        workers.append(w)
    first, second = loaded
    assert first.host_shared_bytes == first.host_buffer_bytes > 0 and first.host_attached_bytes == 0
    assert second.host_attached_bytes == second.host_shared_bytes == first.host_shared_bytes  # filled by the first
    assert len(_segments(shm)) == 1
    a, b = (w.residency.blocks[0][1].state_dict() for w in workers)  # type: ignore[union-attr]
    assert all(torch.equal(a[k], b[k]) for k in a)  # the second worker's views read what the first wrote
    workers[0].shutdown()
    assert len(_segments(shm)) == 1  # the second still maps it
    workers[1].shutdown()
    assert _segments(shm) == []


def _with_blocks(load: ModelLoadConfig, residency: Residency) -> ModelLoadConfig:
    from xema_ray.plan import ExecutionConfig, Mitigation
    from xema_ray.templates import RequestTemplate

    t = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
    plan = ExecutionConfig(template=t, mitigations=(Mitigation(kind="block_offload", blocks=residency.host_blocks,
                                                               intensity=len(residency.host_blocks)),))
    return load.model_copy(update={"plans": (plan,)})


def test_a_switch_back_to_the_host_reuses_the_load_copy(shm: Path) -> None:
    w = Worker(platform="cpu")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(_with_blocks(ModelLoadConfig(model="tiny-flux2", share_host_weights="on"), Residency(host_blocks=(1,))))
    manager = w.residency
    assert manager is not None
    ptrs = [t.data_ptr() for t in manager.blocks[1][1].parameters()]
    # block 1 to the device, block 2 to the host (on CUDA into an exact buffer of its own; on the
    # CPU, whose "host" is the same memory, a clone stands for that copy)
    manager.switch(Residency(host_blocks=(2,)))
    manager.switch(Residency(host_blocks=(1,)))
    assert [t.data_ptr() for t in manager.blocks[1][1].parameters()] == ptrs  # the shared segment's views again
    assert not hasattr(manager.blocks[2][1], HOST_BUFFER_ATTR)
    w.shutdown()
    assert _segments(shm) == []


def test_an_unfinished_segment_is_never_mapped(shm: Path) -> None:
    seg = SharedSegments(shm)
    buf = seg.open("k", 4096)
    assert not buf.filled
    SharedSegments.abandon(buf)  # the writer failed
    again = seg.open("k", 4096)
    assert not again.filled  # filled anew, not taken half-written
    SharedSegments.publish(again)
    again.close()
    assert _segments(shm) == []


def test_another_process_maps_the_same_segment(shm: Path) -> None:
    seg = SharedSegments(shm)
    buf = seg.open("cross", 1024)
    buf.view(0, (256,), torch.float32).copy_(torch.arange(256, dtype=torch.float32))
    SharedSegments.publish(buf)
    code = ("import sys, torch; from pathlib import Path; from xema_ray.platforms.host_memory import SharedSegments as S;"
            "b = S(Path(sys.argv[1])).open('cross', 1024); assert b.filled;"
            "print(int(b.view(0, (256,), torch.float32).sum())); b.close()")
    out = subprocess.run([sys.executable, "-c", code, str(shm)], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str(sum(range(256)))
    assert _segments(shm) == ["xema-default-cross"]  # this process still holds it
    buf.close()
    assert _segments(shm) == []


def test_a_segment_larger_than_the_shm_folder_is_refused_before_writing(shm: Path) -> None:
    import os

    from xema_ray.platforms.host_memory import HostMemoryError

    shm.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(shm)
    with pytest.raises(HostMemoryError, match=r"bytes free, a shared weight segment needs"):
        SharedSegments(shm).open("huge", st.f_blocks * st.f_frsize * 2)
    assert _segments(shm) == [] and not list(shm.glob("*.partial"))


def test_error_raised_if_a_second_segment_does_not_fit_beside_the_first_enospc_injected(shm: Path) -> None:
    """Two segments that together exceed the tmpfs: the second's ``posix_fallocate`` answers ENOSPC,
    a HostMemoryError naming the bytes, before any page is written (a sparse file would have passed
    the free-bytes check and died of SIGBUS at the write past the tmpfs's end). Here ENOSPC comes from
    a stand-in fallocate that grants 64 KiB in all; test_..._on_a_tiny_tmpfs below mounts a real one."""
    import errno

    from xema_ray.platforms.host_memory import HostMemoryError

    granted = []

    def tiny_tmpfs(fd: int, offset: int, length: int) -> None:
        if sum(granted) + length > 64 << 10:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        granted.append(length)
        os.posix_fallocate(fd, offset, length)

    segs = SharedSegments(shm, app="a", fallocate=tiny_tmpfs)
    first = segs.open("first", 48 << 10)
    with pytest.raises(HostMemoryError, match=r"a shared weight segment needs 32,768 .*No space left on device"):
        SharedSegments(shm, app="b", fallocate=tiny_tmpfs).open("second", 32 << 10)
    assert [p.name for p in shm.glob("xema-b-*")] == ["xema-b-second.lock"]  # no segment, no pages left behind
    SharedSegments.publish(first)
    assert _segments(shm) == ["xema-a-first"]
    first.close()


_TINY_TMPFS = """
import sys
import time
from pathlib import Path
from xema_ray.platforms.host_memory import HostMemoryError, SharedSegments
d = Path(sys.argv[1])
a = SharedSegments(d, app="a").open("first", 3 << 20)
a.data.fill_(1)
try:
    SharedSegments(d, app="b").open("second", 3 << 20)  # 6 MiB on a 4 MiB tmpfs
except HostMemoryError as e:
    print("refused:", e)
else:
    print("granted")
"""


def test_error_raised_if_two_segments_together_exceed_a_tiny_tmpfs(tmp_path: Path) -> None:
    """The same on a real 4 MiB tmpfs, mounted in a private mount namespace (``unshare -rm``): the
    second segment is refused with ENOSPC naming its bytes; the process exits normally (no SIGBUS)."""
    import shutil

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) here: the tmpfs cannot be mounted (the injected-ENOSPC test covers the path)")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    script = tmp_path / "two.py"
    script.write_text(_TINY_TMPFS)
    probe = subprocess.run([unshare, "-rm", "sh", "-c", f"mount -t tmpfs -o size=4m none {mnt}"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here ({probe.stderr.strip()}): the injected-ENOSPC "
                    "test covers the path")
    proc = subprocess.run([unshare, "-rm", "sh", "-c",
                           f'mount -t tmpfs -o size=4m none {mnt} && exec "$0" "$1" "$2"',
                           sys.executable, str(script), str(mnt)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # -7 would be SIGBUS
    assert proc.stdout.startswith("refused:") and "needs 3,145,728" in proc.stdout, proc.stdout + proc.stderr
    assert "No space left on device" in proc.stdout or "bytes free" in proc.stdout


def test_error_raised_if_the_creator_holds_the_segment_longer_than_the_wait(shm: Path) -> None:
    from xema_ray.platforms.host_memory import HostMemoryError

    creating = SharedSegments(shm, app="a").open("slow", 4096)  # never published: a stuck creator
    t0 = time.monotonic()
    with pytest.raises(HostMemoryError, match=r"creating this shared weight segment for over 0 s \(owner \{'pid': "):
        SharedSegments(shm, app="a", wait_s=0.3).open("slow", 4096)
    assert 0.3 <= time.monotonic() - t0 < 5
    SharedSegments.abandon(creating)
    creating.close()


def test_segments_are_swept_only_when_their_owner_is_gone(shm: Path) -> None:
    """A killed worker's segment (owner gone, nobody maps it) is swept at the next open; a live
    holder's kept segment survives its last worker's close and every sweep; another app's is not
    this app's to sweep."""
    killed = ("import os, sys; from pathlib import Path; from xema_ray.platforms.host_memory import SharedSegments as S;"
              "[S.publish(S(Path(sys.argv[1]), app=app).open(key, 4096)) for app, key in (('a', 'stale'), ('b', 'other'))];"
              "os._exit(0)")  # killed: no close, no clean-up
    holder = process_owner(os.getppid()) | {"keep": True}  # a live process of the node holds it
    kept = SharedSegments(shm, app="a", owner=holder).open("kept", 4096)
    SharedSegments.publish(kept)
    kept.close()  # the group scaled to zero: its host copy stays for the next worker
    subprocess.run([sys.executable, "-c", killed, str(shm)], check=True, timeout=120)
    assert _segments(shm) == ["xema-a-kept", "xema-a-stale", "xema-b-other"]
    assert SharedSegments(shm, app="a").sweep() == ["xema-a-stale"]
    again = SharedSegments(shm, app="a").open("kept", 4096)
    assert again.filled  # mapped, not made anew
    again.close()
    assert _segments(shm) == ["xema-a-kept", "xema-b-other"]


def test_the_gpu_checks_block_pins_the_plans_bytes_rehearsed_on_meta() -> None:
    """tests/gpu/test_seeded_weights_gpu.py builds Flux.2's block 0 host-homed on its own and
    compares its buffer with the plan's figure for the whole model: the same slots (meta here)."""
    from xema_ray.models.loading import SeededWeights, materialize
    from xema_ray.runtime.host_bytes import worker_host_bytes

    spec = get_model_spec("flux2")
    sub = build_on_meta(spec.transformer_class(), spec.transformer_config, torch.bfloat16).get_submodule(
        "transformer_blocks.0")
    report = materialize(sub, torch.device("meta"), torch.bfloat16, SeededWeights(0, "transformer"),
                         lambda _p: WeightHome.HOST)
    planned = worker_host_bytes(spec, Residency(host_blocks=(0,)), None, share=False)
    assert report.host_pinned_bytes == planned.pinned_bytes == planned.resident_bytes > 1.9e9  # 1.96 GB
    assert report.host_pow2_bytes > 1.2 * report.host_pinned_bytes  # what per-tensor pinning held


def test_a_host_copy_is_kept_for_the_next_worker_which_maps_it_instead_of_reading(shm: Path) -> None:
    """The node's host copy holds every weight (device-homed ones too, copied to the device from
    it); kept by a live node-level holder, it outlives its last worker (a group scaled to zero), and
    the next worker maps it: it reads nothing and places the same weights."""
    from xema_ray.platforms.host_memory import SegmentHolder

    holder = SegmentHolder(pid=os.getppid(), start=process_owner(os.getppid())["start"])  # type: ignore[arg-type]
    load = _with_blocks(ModelLoadConfig(model="tiny-flux2", seed=3, host_copy=True, host_copy_holder=holder),
                        Residency(host_blocks=(1,)))
    plain = Worker(platform="cpu")
    plain.init_device(ParallelConfig(rank=0, world_size=1))
    plain.load_model(load.model_copy(update={"host_copy": False, "host_copy_holder": None}))
    assert _segments(shm) == []  # CPU, share_host_weights auto: no shared segment without the host copy
    reference = {k: v.clone() for k, v in plain.engine.pipe.transformer.state_dict().items()}  # type: ignore[union-attr]
    plain.shutdown()

    first = Worker(platform="cpu")
    first.init_device(ParallelConfig(rank=0, world_size=1))
    filled = first.load_model(load)
    assert filled.host_copy_bytes == filled.device_bytes > 0  # every device weight came through the host copy
    assert filled.host_attached_bytes == 0 and filled.host_shared_bytes == filled.host_buffer_bytes
    assert filled.host_buffer_bytes >= filled.device_bytes + filled.host_bytes
    first.shutdown()
    kept = _segments(shm)
    assert len(kept) >= 1  # the holder keeps it after its last worker

    second = Worker(platform="cpu")
    second.init_device(ParallelConfig(rank=0, world_size=1))
    warm = second.load_model(load)
    assert warm.host_attached_bytes == warm.host_shared_bytes == filled.host_shared_bytes  # mapped, not read
    assert warm.transient_bytes == 0 and warm.host_copy_bytes == filled.host_copy_bytes
    got = second.engine.pipe.transformer.state_dict()  # type: ignore[union-attr]
    assert all(torch.equal(got[k], reference[k]) for k in reference)
    # the device's weights are the worker's own (a CPU device gets a copy): the segment is never written
    block0 = second.engine.pipe.transformer.transformer_blocks[0]  # type: ignore[union-attr]
    seg_ptrs = {t.untyped_storage().data_ptr() for t in second.residency.blocks[1][1].parameters()}  # type: ignore[union-attr]
    assert all(p.untyped_storage().data_ptr() not in seg_ptrs for p in block0.parameters())
    second.shutdown()
    assert _segments(shm) == kept


def test_two_apps_on_one_node_keep_their_own_segments_and_never_sweep_each_others(shm: Path) -> None:
    """The Serve application's name reaches the loader (``ModelLoadConfig.app`` -> ``BuildOptions.app``
    -> ``materialize``'s ``HostShare``): two apps loading the same model and weights on one node
    each fill a segment named after their app (``xema-<app>-<key>``) instead of mapping the
    other's, and one app's sweep leaves the other's segment, even one whose owner is gone."""
    import json

    from xema_ray.platforms.host_memory import segment_app

    load = _with_blocks(ModelLoadConfig(model="tiny-flux2", share_host_weights="on", seed=3), Residency(host_blocks=(0,)))
    workers, loaded = [], []
    for app in ("xema", "other-app"):
        w = Worker(platform="cpu")
        w.init_device(ParallelConfig(rank=0, world_size=1))
        loaded.append(w.load_model(load.model_copy(update={"app": app})))
        workers.append(w)
    token = segment_app("other-app")
    assert token != "other-app" and token.startswith("other_app.")
    names = _segments(shm)
    assert len(names) == 2 and {n.split("-")[1] for n in names} == {"xema", token}
    assert [x.host_attached_bytes for x in loaded] == [0, 0]  # each app filled its own: nothing was mapped across
    assert all(x.host_shared_bytes > 0 for x in loaded)
    # a segment of app "xema" whose owner is gone (a killed worker's): "other-app"'s sweep (each
    # open runs one) leaves it; "xema"'s own removes it
    stale = shm / "xema-xema-stale"
    stale.write_bytes(bytes(4096))
    stale.with_name(stale.name + ".owner").write_text(json.dumps({"pid": 2**22 + 7, "start": None}))
    assert SharedSegments(shm, app=token).sweep() == [] and stale.exists()
    assert SharedSegments(shm, app="xema").sweep() == ["xema-xema-stale"] and not stale.exists()
    for w in workers:
        w.shutdown()
    assert _segments(shm) == []
