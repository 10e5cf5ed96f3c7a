"""The decode stage's two halves on the CPU (issue #54): a DiT worker whose plan hands its decode
to a pool stops at the latents and returns them per request; a decode worker, holding the VAE
alone, turns them into the very video the worker would have decoded in place."""

from __future__ import annotations

from pathlib import Path

import pytest

from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import DecodeStage, PlanTable
from xema_ray.runtime.decode_worker import DecodeLoad, DecodeWorker
from xema_ray.runtime.engine import Batch
from xema_ray.runtime.requests import GenerationRequest
from xema_ray.runtime.worker import ModelLoadConfig, Worker

from tests.batch_sizes import assert_same_picture_across_batch_sizes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def worker_and_config():  # type: ignore[no-untyped-def]
    table = PlanTable.load(str(ROOT / "plans" / "demo-cpu.json"))
    config = next(e.config for k, e in table.entries.items() if k.startswith("tiny-cogvideox/64x64x9"))
    w = Worker(platform="cpu")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(ModelLoadConfig(model="tiny-cogvideox", plans=(config,)))
    return w, config.model_copy(update={"decode": None}).for_batch(2)  # in place (the demo's entry has a pool)


def _batch(config, ids=("a", "b")):  # type: ignore[no-untyped-def]
    reqs = tuple(GenerationRequest(request_id=i, prompt=f"a fox {i}", seed=7 + k) for k, i in enumerate(ids))
    return Batch(config=config, requests=reqs, steps=config.template.steps)


def test_a_pooled_plan_hands_over_latents_and_the_decode_worker_makes_the_same_video(worker_and_config) -> None:  # type: ignore[no-untyped-def]
    w, config = worker_and_config
    in_place = w.engine.execute(_batch(config))
    assert len(in_place.outputs) == 2 and in_place.handed == []
    pooled = w.engine.execute(_batch(config.model_copy(update={"decode": DecodeStage(workers=1, gpus_per_worker=1)})))
    assert pooled.outputs == [] and [h.request_id for h in pooled.handed] == ["a", "b"]
    assert pooled.handed[0].latents.shape[0] == 1 and pooled.timings.decode_s < in_place.timings.decode_s
    d = DecodeWorker("cpu")
    assert d.load(DecodeLoad(model="tiny-cogvideox")) == "cpu"
    assert d.pipe.transformer is None and d.pipe.text_encoder is None and d.pipe.vae is not None
    # the pipeline decoded the batch of 2 in one VAE call, the decode worker one request at a time:
    # the same pictures within the bound across batch sizes (tests/batch_sizes.py), not the same bytes
    for handed, want in zip(pooled.handed, in_place.outputs, strict=True):
        got = d.decode(handed)
        assert (got.request_id, got.frames, got.width, got.height) == (want.request_id, 9, 64, 64)
        assert_same_picture_across_batch_sizes(got.data, want.data)
        assert got.prompt_tokens == want.prompt_tokens
    # a request alone, decoded in place and by the decode worker (one VAE call of one request on both
    # sides): bit-exact, as the same seeded VAE, the spec's own decode and the same encoder make it
    one = config.for_batch(1)
    alone = w.engine.execute(_batch(one, ids=("a",)))
    handed = w.engine.execute(_batch(one.model_copy(update={"decode": DecodeStage(workers=1, gpus_per_worker=1)}),
                                     ids=("a",))).handed
    assert d.decode(handed[0]).data == alone.outputs[0].data


def test_a_model_that_decodes_in_place_only_refuses_a_decode_worker() -> None:
    with pytest.raises(ValueError, match="tiny-ltx2 decodes in place only"):
        DecodeWorker("cpu").load(DecodeLoad(model="tiny-ltx2"))


def test_the_decode_workers_module_imports_no_model_code() -> None:
    """A pool starts its Ray actors from this module before its replica imports the model code
    (``ModelGroup`` spawns the pool first): importing it must not import torch or diffusers, or the
    actors' processes would start only after that import."""
    import json
    import subprocess
    import sys

    code = ("import json, sys\nimport xema_ray.runtime.decode_worker\n"
            "print(json.dumps(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
