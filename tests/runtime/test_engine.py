"""The execution engine on the tiny models (CPU): real PNG / MP4 bytes, identical for the same
seed, per-phase timings and memory statistics, and loud failures for bad batches."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator

import pytest
import torch
from PIL import Image

from xema_ray.allocator.runtime import RequestReport
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import ExecutionConfig, Mitigation
from xema_ray.runtime import Batch, BatchResult, ExecutionEngine, GenerationRequest, MitigationLibraryMissing
from xema_ray.templates import RequestTemplate

from tests.batch_sizes import assert_same_picture_across_batch_sizes, decode_mp4, mean_abs_difference

TEMPLATES = {
    "tiny-flux2": RequestTemplate(model="tiny-flux2", height=64, width=48, steps=2),
    "tiny-cogvideox": RequestTemplate(model="tiny-cogvideox", height=48, width=64, frames=9, steps=2),
    "tiny-ltx2": RequestTemplate(model="tiny-ltx2", height=64, width=64, frames=9, steps=2),
    "tiny-wan2.2": RequestTemplate(model="tiny-wan2.2", height=64, width=64, frames=9, steps=2),  # one step per expert
    "tiny-qwen-image": RequestTemplate(model="tiny-qwen-image", height=64, width=64, steps=2),
    # TI2V-5B's twin as text-to-video (its first-frame path: tests/runtime/test_references.py)
    "tiny-wan2.2-ti2v": RequestTemplate(model="tiny-wan2.2-ti2v", height=64, width=64, frames=9, steps=2),
}


#: the models of the module's engine (tests/runtime/conftest.py)
ENGINE_MODELS = list(TEMPLATES)


def _batch(template: RequestTemplate, seeds: list[int], **config: object) -> Batch:
    return Batch(
        config=ExecutionConfig(template=template, batch=len(seeds), **config),  # type: ignore[arg-type]
        requests=tuple(GenerationRequest(request_id=f"r{i}", prompt=f"prompt {s}", seed=s) for i, s in enumerate(seeds)), steps=template.steps
    )


def test_media_bytes_are_real_and_deterministic(engine: ExecutionEngine) -> None:
    template = TEMPLATES[engine.spec.name]
    first = engine.execute(_batch(template, [11, 12]))
    again = engine.execute(_batch(template, [11, 12]))
    assert [o.data for o in first.outputs] == [o.data for o in again.outputs]
    assert first.outputs[0].data != first.outputs[1].data  # different seeds, different pictures
    for out in first.outputs:
        assert (out.width, out.height, out.frames) == (template.width, template.height, template.frames)
        if engine.spec.kind == "image":
            assert out.media_type == "image/png" and out.data[:8] == b"\x89PNG\r\n\x1a\n"
            assert Image.open(io.BytesIO(out.data)).size == (template.width, template.height)
        else:
            assert out.media_type == "video/mp4" and out.data[4:8] == b"ftyp"
            frames = decode_mp4(out.data)
            assert frames.shape == (template.frames, template.height, template.width, 3)
    if engine.spec.family == "ltx2":
        assert all(o.audio_wav is not None and o.audio_wav[:4] == b"RIFF" for o in first.outputs)


def test_seed_alone_decides_the_output(engine: ExecutionEngine) -> None:
    """A request's output does not depend on its batch-mates: its noise has its own generator."""
    template = TEMPLATES[engine.spec.name]
    alone = engine.execute(_batch(template, [12])).outputs[0].data
    paired = engine.execute(_batch(template, [11, 12]))
    # another batch size: the same picture within the batch-size rounding (tests/batch_sizes.py),
    # while another seed is a different picture altogether
    same = assert_same_picture_across_batch_sizes(alone, paired.outputs[1].data)
    assert mean_abs_difference(alone, paired.outputs[0].data) > 10 * max(same, 0.1)


def test_result_reports_timings_and_memory(engine: ExecutionEngine) -> None:
    result = engine.execute(_batch(TEMPLATES[engine.spec.name], [3]))
    t = result.timings
    assert t.denoise_s > 0 and t.decode_s > 0 and t.encode_s > 0
    assert t.text_s + t.denoise_s + t.decode_s + t.encode_s <= t.total_s * 1.01
    assert result.memory.peak_bytes >= result.memory.current_bytes > 0
    assert result.sp_rank == 0 and result.mitigations == 0 and not result.layout_armed
    # the result crosses process boundaries as JSON, bytes included
    again = BatchResult.model_validate_json(result.model_dump_json())
    assert again.outputs[0].data == result.outputs[0].data


def test_layout_is_armed_through_the_injected_callable_with_the_batch_steps() -> None:
    spec = get_model_spec("tiny-flux2")
    armed: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def arm(ref: str, steps: int) -> Iterator[RequestReport | None]:
        armed.append((ref, steps))
        report = RequestReport(planned=3)
        yield report
        report.hits, report.misses = 2, 1  # filled at exit, as StaticAllocator.armed does

    engine = ExecutionEngine(
        spec.build_pipeline(BuildOptions()), spec, torch.device("cpu"), torch.float32, arm_layout=arm
    )
    template = TEMPLATES["tiny-flux2"]
    result = engine.execute(_batch(template, [1], layout_ref="layout-abc"))
    assert armed == [("layout-abc", template.steps)] and result.layout_armed
    assert (result.layout_hits, result.layout_misses) == (2, 1)  # the report the call yielded
    other = _batch(template, [1], layout_ref="layout-abc").model_copy(update={"steps": template.steps + 2})
    engine.execute(other)
    assert armed[-1] == ("layout-abc", template.steps + 2)  # the batch's own count, passed in the call


def test_error_raised_if_mitigation_library_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = get_model_spec("tiny-flux2")
    engine = ExecutionEngine(spec.build_pipeline(BuildOptions()), spec, torch.device("cpu"), torch.float32)
    monkeypatch.setitem(sys.modules, "xema_ray.mitigation", None)  # import now raises ImportError
    batch = _batch(TEMPLATES["tiny-flux2"], [1], mitigations=(Mitigation(kind="dit_chunking", blocks=(0,), intensity=2),))
    with pytest.raises(MitigationLibraryMissing, match="dit_chunking"):
        engine.execute(batch)


def test_error_raised_if_batch_is_invalid() -> None:
    template = TEMPLATES["tiny-flux2"]
    with pytest.raises(ValueError, match="does not match the config's batch size 2"):
        Batch(
            config=ExecutionConfig(template=template, batch=2),
            requests=(GenerationRequest(request_id="a", prompt="x", seed=0),), steps=template.steps
        )
    spec = get_model_spec("tiny-flux2")
    engine = ExecutionEngine(spec.build_pipeline(BuildOptions()), spec, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="this engine runs 'tiny-flux2'"):
        engine.execute(_batch(TEMPLATES["tiny-cogvideox"], [1]))
    with pytest.raises(ValueError, match="no process groups"):
        engine.execute(_batch(template, [1], ulysses=2))


def test_mitigations_are_installed_for_the_batch_only() -> None:
    spec = get_model_spec("tiny-flux2")
    engine = ExecutionEngine(spec.build_pipeline(BuildOptions()), spec, torch.device("cpu"), torch.float32)
    template = TEMPLATES["tiny-flux2"]
    plain = engine.execute(_batch(template, [5]))
    offload = Mitigation(kind="block_offload", blocks=(0, 2), intensity=2)
    mitigated = engine.execute(_batch(template, [5], mitigations=(offload,)))
    assert mitigated.mitigations == 1
    assert mitigated.outputs[0].data == plain.outputs[0].data  # offload is lossless
    assert engine.execute(_batch(template, [5])).outputs[0].data == plain.outputs[0].data  # and removed
