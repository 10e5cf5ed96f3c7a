"""The emulated worker (xema_ray.runtime.emulated): a batch takes its plan entry's time divided by
time_scale, phase by phase; the step observer stops it and a pause parks it at step boundaries, as
with a real worker; its outputs are valid, marked files of the requested size."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest

from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import PlanTable
from xema_ray.profiling.hardware import A6000_8X
from xema_ray.runtime.emulated import EmulatedWorker, emulation_for, plan_phases, scale_table
from xema_ray.runtime.engine import Batch, GenerationRequest
from xema_ray.runtime.pause import PausedRun
from xema_ray.runtime.progress import BatchCancelled
from xema_ray.runtime.worker import ModelLoadConfig

ROOT = Path(__file__).resolve().parents[2]
TABLE = PlanTable.load(str(ROOT / "plans" / "a6000x8.json"))
COG = "cogvideox-5b/1280x720x49"  # 2,154 s planned
FLUX = "flux2/256x256x1"  # batch 3: 41.1 s planned, a partial batch of 1: 20.0 s


#: how late one wake-up may come on a loaded machine (two test suites beside each other: 0.11 s seen)
LATE_S = 0.25


def _took(seconds: float, planned: float, rel: float = 0.05, wakes: int = 1) -> None:
    """The emulator sleeps to absolute deadlines: its lateness does not add up over steps, so a run
    takes the planned time within ``rel``, plus at most ``wakes`` late wake-ups."""
    assert planned * (1 - rel) <= seconds <= planned * (1 + rel) + wakes * LATE_S, (seconds, planned)


def _worker(keys: list[str], time_scale: float) -> EmulatedWorker:
    w = EmulatedWorker(emulation=emulation_for(TABLE, time_scale, keys))
    w.init_device(ParallelConfig(rank=0, world_size=1))
    model = TABLE.entries[keys[0]].config.template.model
    w.load_model(ModelLoadConfig(model=model, plans=tuple(TABLE.entries[k].config for k in keys)))
    for k in keys:
        w._media(k)  # rendered once per template (load does it in the background): off the clock here
    return w


def _batch(key: str, n: int | None = None) -> Batch:
    # one in-process worker: the plan's SP 2 (Flux.2) runs at SP 1 here, same phases (the SP
    # group's per-step agreement is tests/serving/test_emulated_app.py's part, on Ray)
    cfg = TABLE.entries[key].config.model_copy(update={"ulysses": 1, "ring": 1, "mitigations": ()})
    n = cfg.batch if n is None else n
    return Batch(config=cfg.for_batch(n), requests=tuple(GenerationRequest(request_id=f"r{i}", prompt="p", seed=i)
                                                         for i in range(n)), steps=cfg.template.steps)


class Steps:
    """A step observer that records steps and stops after ``stop_at`` (None: never)."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.seen: list[tuple[int, float]] = []
        self.decoded = False

    def on_step(self, step: int, total: int) -> bool:
        self.seen.append((step, time.perf_counter()))
        return self.stop_at is not None and step >= self.stop_at

    def on_decoded(self) -> None:
        self.decoded = True


def test_phases_sum_to_the_plans_latency_and_text_is_the_planned_encoder() -> None:
    emu = emulation_for(TABLE, 100.0)
    for key, e in TABLE.entries.items():
        ph = emu.templates[key]
        assert ph.total_s == pytest.approx(e.prediction.latency_s / 100.0, rel=1e-9)
        assert ph.steps == e.config.template.steps and ph.pause_bytes == e.prediction.pause_bytes
    # the plan adds the streamed T5 encoder (+0.38 s) to the cost model's loop and decode
    text, denoise, decode = plan_phases(TABLE.entries[COG], A6000_8X)
    assert 0.3 < text < 0.5 and denoise > 50 * decode > 0


@pytest.mark.parametrize(("key", "n", "time_scale"), [(COG, 1, 1000.0), (FLUX, 3, 20.0), (FLUX, 1, 10.0)])
def test_a_batch_takes_the_plan_entrys_latency_over_time_scale(key: str, n: int, time_scale: float) -> None:
    w = _worker([key], time_scale)
    p = TABLE.entries[key].prediction
    planned = p.latency_by_batch.get(n, p.latency_s) / time_scale
    obs = Steps()
    t0 = time.perf_counter()
    r = w.execute(_batch(key, n), obs)
    took = time.perf_counter() - t0
    _took(took, planned)
    assert [s for s, _ in obs.seen] == list(range(1, 51)) and obs.decoded
    assert r.memory.peak_bytes == p.peak_bytes and r.memory.source == "plan (emulated)"
    _took(r.timings.total_s, planned)
    assert len(r.outputs) == n and all(o.emulated for o in r.outputs)


def test_the_observer_stops_a_batch_at_a_step_boundary() -> None:
    w = _worker([COG], 2000.0)
    ph = w.emulation.templates[COG]
    obs = Steps(stop_at=10)
    t0 = time.perf_counter()
    with pytest.raises(BatchCancelled) as e:
        w.execute(_batch(COG), obs, run_id="c")
    assert e.value.step == 10 and obs.seen[-1][0] == 10 and not obs.decoded
    took = time.perf_counter() - t0
    _took(took, ph.text_s + 10 * ph.denoise_step_s, rel=0.1)
    assert took < ph.total_s  # the other 40 steps and the decode never slept


@pytest.mark.parametrize("offload", [False, True])
def test_a_pause_parks_at_a_step_boundary_and_resume_finishes_the_rest(offload: bool) -> None:
    w = _worker([COG], 2000.0)
    ph = w.emulation.templates[COG]
    obs = Steps()
    threading.Timer(0.3, lambda: w.pause("p", offload=offload)).start()
    t0 = time.perf_counter()
    paused = w.execute(_batch(COG), obs, run_id="p")
    assert isinstance(paused, PausedRun) and 0 < paused.step < ph.steps
    assert paused.state_bytes == TABLE.entries[COG].prediction.pause_bytes and paused.offloaded is offload
    assert w.paused_runs() == [paused] and obs.seen[-1][0] == paused.step
    ran = time.perf_counter() - t0
    time.sleep(0.2)  # nothing runs while parked
    assert obs.seen[-1][0] == paused.step
    t1 = time.perf_counter()
    r = w.resume("p")
    rest = time.perf_counter() - t1
    moves = 2 * w.emulation.move_s(paused.state_bytes) if offload else 0.0
    _took(ran + rest, ph.total_s + moves, rel=0.1, wakes=2)
    assert r.pauses == 1 and r.paused_s >= 0.2 and [s for s, _ in obs.seen] == list(range(1, 51))
    assert w.paused_runs() == []


def test_a_pause_that_overtakes_its_batch_parks_it_at_the_first_boundary() -> None:
    w = _worker([COG], 2000.0)
    assert w.pause("early") is True
    paused = w.execute(_batch(COG), run_id="early")
    assert isinstance(paused, PausedRun) and paused.step == 1
    assert not isinstance(w.resume("early"), PausedRun)
    assert w.pause("early") is False  # finished: nothing to pause


def test_a_residency_switch_between_templates_is_charged() -> None:
    a, b = "flux2/256x256x1", "flux2/2048x2048x1"  # per_template residency: 0.94 s to switch
    assert emulation_for(TABLE, 40.0, [a, b]).switch_s[a][b] == pytest.approx(TABLE.residency["flux2"].switch_s[a][b] / 40)
    emu = emulation_for(TABLE, 800.0, [a, b])
    emu = emu.model_copy(update={"switch_s": {a: {b: 0.4}}})  # larger than the tolerance, to see it
    w = EmulatedWorker(emulation=emu)
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(ModelLoadConfig(model="flux2", plans=(TABLE.entries[a].config, TABLE.entries[b].config)))
    w._media(a), w._media(b)
    w.execute(_batch(a, 1))
    t0 = time.perf_counter()
    r = w.execute(_batch(b))
    _took(time.perf_counter() - t0, emu.templates[b].total_s + 0.4)
    assert r.timings.text_s >= 0.4
    t0 = time.perf_counter()
    w.execute(_batch(b))  # already held: no switch
    _took(time.perf_counter() - t0, emu.templates[b].total_s)  # LATE_S < the 0.4 s switch


def test_outputs_are_valid_files_of_the_requested_size_marked_emulated(tmp_path: Path) -> None:
    import imageio_ffmpeg
    from PIL import Image

    w = _worker([COG], 2000.0)
    out = w.execute(_batch(COG)).outputs[0]
    assert (out.media_type, out.width, out.height, out.frames, out.emulated) == ("video/mp4", 1280, 720, 49, True)
    path = tmp_path / "v.mp4"
    path.write_bytes(out.data)
    assert imageio_ffmpeg.count_frames_and_secs(str(path))[0] == 49
    gen = imageio_ffmpeg.read_frames(str(path))
    assert next(gen)["size"] == (1280, 720)
    frame = next(gen)
    assert len(frame) == 1280 * 720 * 3
    fw = _worker([FLUX], 40.0)
    img = fw.execute(_batch(FLUX)).outputs[0]
    im = Image.open(io.BytesIO(img.data))
    assert im.size == (256, 256) and im.format == "PNG" and img.emulated


def test_scale_table_puts_every_latency_on_the_emulated_clock() -> None:
    s = scale_table(TABLE, 100.0)
    for k, e in TABLE.entries.items():
        p, q = e.prediction, s.entries[k].prediction
        assert q.latency_s == pytest.approx(p.latency_s / 100) and q.slo_s == pytest.approx(p.slo_s / 100)
        assert q.latency_by_batch == pytest.approx({n: v / 100 for n, v in p.latency_by_batch.items()})
    a, b = "flux2/256x256x1", "flux2/2048x2048x1"
    assert s.residency["flux2"].switch_s[a][b] == pytest.approx(TABLE.residency["flux2"].switch_s[a][b] / 100)


def test_error_raised_if_a_plan_has_no_emulated_phases() -> None:
    w = EmulatedWorker(emulation=emulation_for(TABLE, 100.0, [COG]))
    w.init_device(ParallelConfig(rank=0, world_size=1))
    with pytest.raises(ValueError, match="no emulated phases for flux2/256x256x1"):
        w.load_model(ModelLoadConfig(model="flux2", plans=(TABLE.entries[FLUX].config,)))
