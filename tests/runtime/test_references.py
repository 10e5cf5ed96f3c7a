"""Reference images on the tiny models (CPU): each request's images are its own (alone or in a
batch), the same image and seed give the same bytes at one batch size and the same picture at
another (``tests/batch_sizes.py``), a different image a different result, and the analyzer traces
the conditioning path (placeholders of the template's size)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime import Batch, ExecutionEngine, GenerationRequest
from xema_ray.runtime.references import encode_reference
from xema_ray.templates import RequestTemplate

from tests.batch_sizes import MEAN_ABS_BOUND, assert_same_picture_across_batch_sizes, mean_abs_difference

TEMPLATES = {
    "tiny-flux2": RequestTemplate(model="tiny-flux2", height=64, width=64, steps=2, references=2),
    "tiny-cogvideox-i2v": RequestTemplate(model="tiny-cogvideox-i2v", height=64, width=64, frames=9, steps=1,
                                          references=1),
    "tiny-ltx2": RequestTemplate(model="tiny-ltx2", height=64, width=64, frames=9, steps=2, references=1),
    # two experts (step 0 high-noise, step 1 low-noise), the image latents and mask on channels
    "tiny-wan2.2-i2v": RequestTemplate(model="tiny-wan2.2-i2v", height=64, width=64, frames=9, steps=2,
                                       references=1),
    # TI2V-5B's path: the image's latents replace latent frame 0 through a mask
    "tiny-wan2.2-ti2v": RequestTemplate(model="tiny-wan2.2-ti2v", height=64, width=64, frames=9, steps=2,
                                        references=1),
}


def _image(seed: int, size: tuple[int, int]) -> bytes:
    rng = np.random.default_rng(seed)
    return encode_reference(Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)))


#: the models of the module's engine (tests/runtime/conftest.py)
ENGINE_MODELS = list(TEMPLATES)


def _batch(t: RequestTemplate, reqs: list[tuple[int, tuple[int, ...]]]) -> Batch:
    size = (t.reference_width, t.reference_height)
    return Batch(config=ExecutionConfig(template=t, batch=len(reqs)), requests=tuple(
        GenerationRequest(request_id=f"r{i}", prompt="a fox", seed=seed,
                          references=tuple(_image(k, size) for k in images))
        for i, (seed, images) in enumerate(reqs)), steps=t.steps)


def test_same_image_same_bytes_other_image_other_result(engine: ExecutionEngine) -> None:
    t = TEMPLATES[engine.spec.name]
    n = t.references
    first = engine.execute(_batch(t, [(7, tuple(range(n)))])).outputs[0].data
    other = engine.execute(_batch(t, [(7, tuple(range(10, 10 + n)))])).outputs[0].data
    # same seed and prompt, another image: another picture, beyond what batching moves
    assert mean_abs_difference(first, other) > 2 * MEAN_ABS_BOUND
    assert first == engine.execute(_batch(t, [(7, tuple(range(n)))])).outputs[0].data  # same batch size: same bytes
    # in a batch beside another request's images each request keeps its own: the same bytes at
    # that batch size, whatever the neighbour, and the same picture as alone
    both = engine.execute(_batch(t, [(7, tuple(range(10, 10 + n))), (7, tuple(range(n)))]))
    swapped = engine.execute(_batch(t, [(7, tuple(range(n))), (9, tuple(range(20, 20 + n)))]))
    assert swapped.outputs[0].data == both.outputs[1].data
    assert_same_picture_across_batch_sizes(both.outputs[1].data, first)
    assert_same_picture_across_batch_sizes(both.outputs[0].data, other)
    assert all((o.width, o.height, o.frames) == (t.width, t.height, t.frames) for o in both.outputs)


def test_the_trace_sees_the_references() -> None:
    base = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=2)
    one = trace_template(base.with_(references=1, reference_width=64, reference_height=64))
    two = trace_template(base.with_(references=2, reference_width=128, reference_height=128))
    plain = trace_template(base)
    # the longer sequence and the VAE encode of each reference allocate more
    assert plain.peak() < one.peak() < two.peak()


@pytest.mark.parametrize(("model", "steps"), [("tiny-cogvideox-i2v", 5), ("tiny-ltx2", 5), ("tiny-wan2.2-i2v", 10),
                                           ("tiny-wan2.2-ti2v", 8)])
def test_the_replicated_image_to_video_trace_equals_a_full_one(model: str, steps: int) -> None:
    # LTX-2's image path settles a step later (``settling_steps_for``): replicating earlier would differ;
    # Wan's UniPC traces 6 steps (two settling, outputs alive two steps): more replicate, across
    # I2V-A14B's expert switch too
    t = TEMPLATES[model].with_(steps=steps, batch=2)
    assert trace_template(t).signature() == trace_template(t, TraceOptions(replicate=False)).signature()


def test_error_raised_if_a_request_brings_another_count() -> None:
    t = TEMPLATES["tiny-flux2"]
    spec = t.spec
    img = Image.new("RGB", (t.reference_width, t.reference_height))
    with pytest.raises(ValueError, match="takes 2 reference"):
        spec.reference_inputs().kwargs(t, [[img]])


def test_error_raised_if_ltx2_image_to_video_asks_for_sequence_parallelism() -> None:
    # its per-token timestep (the conditioning mask) is not sharded by the split: one GPU per request
    with pytest.raises(ValueError, match="has no sequence-parallel split"):
        ExecutionConfig(template=TEMPLATES["tiny-ltx2"], ulysses=2)
    ExecutionConfig(template=TEMPLATES["tiny-flux2"], ulysses=2)  # Flux.2's references are split with the rest
