"""Text encoders on the serving path: the model's own encoder placed on the device, streamed
through it or on the CPU gives the same pixels; a directory loads what the config builds; the
analyzer and ``xema verify`` count the encoder; the planner places it by fit and cost."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from bench.scenarios.factories import plan_entry
from xema_ray.checkpoints import write_checkpoint
from xema_ray.memory.analysis import summarize
from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.models.loading import CheckpointError
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime.engine import Batch, GenerationRequest
from xema_ray.measure.verify import verify_config
from xema_ray.runtime.worker import ModelLoadConfig, Worker
from xema_ray.templates import RequestTemplate

TEMPLATES = {
    "tiny-flux2": RequestTemplate(model="tiny-flux2", height=64, width=64, steps=2),
    "tiny-cogvideox": RequestTemplate(model="tiny-cogvideox", height=64, width=64, frames=9, steps=2),
    "tiny-ltx2": RequestTemplate(model="tiny-ltx2", height=64, width=64, frames=9, steps=2),
}


def _worker(load: ModelLoadConfig) -> Worker:
    w = Worker(platform="cpu")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(load)
    return w


def _run(w: Worker, model: str, prompt: str = "a red fox in snow", seed: int = 1):  # type: ignore[no-untyped-def]
    batch = Batch(config=ExecutionConfig(template=TEMPLATES[model]),
                  requests=(GenerationRequest(request_id="r", prompt=prompt, seed=seed),), steps=TEMPLATES[model].steps)
    return w.execute(batch).outputs[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("checkpoints")
    for m in TEMPLATES:
        write_checkpoint(m, out)
    return out


@pytest.mark.parametrize("model", list(TEMPLATES))
def test_placements_and_checkpoint_give_the_same_bytes(model: str, checkpoints) -> None:  # type: ignore[no-untyped-def]
    ref_w = _worker(ModelLoadConfig(model=model, text_encoder="device"))
    ref = _run(ref_w, model)
    assert ref.prompt_tokens is not None and not ref.prompt_truncated
    # the three placements run the same code for every model; each is checked on one model here
    # (the streamed one on all: it is the one that moves weights) to keep the suite short
    for placement in ("streamed", "cpu") if model == "tiny-flux2" else ("streamed",):
        assert _run(_worker(ModelLoadConfig(model=model, text_encoder=placement)), model).data == ref.data, placement
    from_dir = _worker(ModelLoadConfig(model=model, weights_dir=checkpoints / model))
    assert from_dir.engine is not None and from_dir.engine.pipe.text_encoder is not None
    assert _run(from_dir, model).data == ref.data
    # the prompt reaches the pixels through the real tokenizer and encoder
    assert _run(ref_w, model, prompt="waves on a rocky shore").data != ref.data
    # a repeated prompt is served from the embedding cache, with the same bytes
    assert _run(ref_w, model).data == ref.data and ref_w.engine.prompts.cache.hits >= 1  # type: ignore[union-attr]


def test_long_prompt_is_truncated_and_reported() -> None:
    out = _run(_worker(ModelLoadConfig(model="tiny-cogvideox", text_encoder="device")), "tiny-cogvideox",
               prompt="waves crash on a rocky shore at sunset " * 20)
    assert out.prompt_truncated and out.prompt_tokens is not None and out.prompt_tokens > get_model_spec("tiny-cogvideox").text_tokens


def test_error_raised_if_checkpoint_component_missing_or_wrong(checkpoints, tmp_path) -> None:  # type: ignore[no-untyped-def]
    broken = tmp_path / "tiny-flux2"
    shutil.copytree(checkpoints / "tiny-flux2", broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(CheckpointError, match=r"tiny-flux2/vae/config.json: missing"):
        get_model_spec("tiny-flux2").build_pipeline(BuildOptions(weights_dir=broken))
    # stored in fp32, loaded in bf16: cast on load (a log line), not refused
    cast = get_model_spec("tiny-flux2").build_transformer(BuildOptions(weights_dir=checkpoints / "tiny-flux2", dtype=torch.bfloat16))
    assert {p.dtype for p in cast.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("model", list(TEMPLATES))
def test_verify_counts_the_encoder_where_it_runs(model: str) -> None:
    t = TEMPLATES[model]
    peaks = {p: verify_config(ExecutionConfig(template=t, text_encoder=p), budget_bytes=10**9) for p in ("device", "streamed", "cpu")}
    assert all(v.error is None and v.text_encoder == p for p, v in peaks.items())
    # resident on the device > streamed through it (every part it runs is on the host between
    # uses) >= not on it at all; host memory the other way round
    assert peaks["device"].load_peak_bytes > peaks["streamed"].load_peak_bytes >= peaks["cpu"].load_peak_bytes
    assert peaks["device"].host_bytes == 0 < peaks["streamed"].host_bytes <= peaks["cpu"].host_bytes


def test_analyzer_reports_encoder_weights_and_text_peak() -> None:
    t = TEMPLATES["tiny-flux2"]
    plain = summarize(trace_template(t))
    with_enc = summarize(trace_template(t, TraceOptions(text_encoder="device")))
    streamed = summarize(trace_template(t, TraceOptions(text_encoder="streamed")))
    enc = with_enc.weight_bytes_by_component["text_encoder"]
    assert "text_encoder" not in plain.weight_bytes_by_component and enc > 0
    assert with_enc.text_peak_bytes > plain.text_peak_bytes + enc * 0.9
    assert streamed.weight_bytes_by_component.get("text_encoder", 0) < enc
    assert plain.text_peak_bytes < streamed.text_peak_bytes < with_enc.text_peak_bytes


@pytest.mark.slow
def test_planner_places_encoder_by_fit_then_speed() -> None:
    from planner.latency import LatencyModel
    from planner.text_encoder import place_text_encoder, placement_costs

    # real size (meta only): Flux.2's 46.7 GB Mistral-3 on a 48 GB card
    t = RequestTemplate(model="flux2", height=1024, width=1024)
    entry = plan_entry(t, peak_bytes=40 * 10**9, latency_s=1.0, slo_s=100.0, latency_source="estimated")
    hw = LatencyModel("a6000").hardware
    need = {c.placement: max(c.peak_bytes, c.text_peak_bytes) for c in placement_costs(entry, hw)}
    speed = {c.placement: c.seconds for c in placement_costs(entry, hw)}
    assert need["device"] > need["streamed"] > need["cpu"] and speed["device"] <= speed["streamed"] < speed["cpu"]
    budgets = (need["device"], need["streamed"], need["cpu"])
    chosen = {b: place_text_encoder(entry, hw, b)[0] for b in budgets}
    assert [chosen[b].config.text_encoder for b in budgets] == ["device", "streamed", "cpu"]
    assert all(e.prediction.latency_s > 1.0 for e in chosen.values())
    json.loads(chosen[need["device"]].model_dump_json())


@pytest.mark.parametrize("model", ["tiny-flux2", "tiny-cogvideox"])
def test_encoder_facts_sent_as_json_place_as_measured_here(model: str) -> None:
    # the planning task measures the encoder facts and sends them as JSON; the driver's placement
    # from them equals the placement measured in the driver itself, at every budget
    from planner.latency import LatencyModel
    from planner.text_encoder import EncoderFacts, encoder_facts, place_text_encoder, placement_costs

    t = RequestTemplate(model=model, height=64, width=64, frames=1 if model == "tiny-flux2" else 9)
    entry = plan_entry(t, batch=2, peak_bytes=10**6, latency_s=1.0, slo_s=100.0, latency_source="estimated")
    hw = LatencyModel("a6000").hardware
    facts = EncoderFacts.model_validate_json(encoder_facts(entry.config).model_dump_json())
    assert facts.activation_bytes and all(v > 0 for v in facts.activation_bytes.values())
    costs = placement_costs(entry, hw)
    assert placement_costs(entry, hw, facts) == costs
    for budget in sorted({max(c.peak_bytes, c.text_peak_bytes) for c in costs}):
        assert place_text_encoder(entry, hw, budget, facts)[0] == place_text_encoder(entry, hw, budget)[0]
    with pytest.raises(ValueError, match="cannot merge"):
        facts.merged(facts.model_copy(update={"model": "other"}))
