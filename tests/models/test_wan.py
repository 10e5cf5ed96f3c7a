"""Wan2.2-T2V-A14B and its tiny twin: registry, shapes, the expert stages, the two-expert trace."""

from __future__ import annotations

import pytest

from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.memory.analysis import expert_uses, summarize
from xema_ray.models import get_model_spec
from xema_ray.templates import RequestTemplate, named_templates

GB = 10**9


def test_registered_with_real_and_tiny_configs() -> None:
    real, tiny = get_model_spec("wan2.2-t2v-a14b"), get_model_spec("tiny-wan2.2")
    assert (real.family, real.kind, tiny.family) == ("wan", "video", "wan")
    assert real.transformer_config["num_layers"] == 40 and real.transformer_config["ffn_dim"] == 13824
    assert real.sampling.boundary_ratio == tiny.sampling.boundary_ratio == 0.875  # tiny keeps both experts
    assert real.text_encoder.family == tiny.text_encoder.family == "umt5"
    assert real.frame_rate == 16.0 and real.spatial_multiple == 16 and real.temporal_compression == 4
    assert [t.shape_key for t in named_templates("wan2.2-t2v-a14b")] == [
        "wan2.2-t2v-a14b/832x480x81", "wan2.2-t2v-a14b/1280x720x81"]


def test_error_raised_if_frames_are_not_one_plus_a_multiple_of_four() -> None:
    with pytest.raises(ValueError, match="1 \\+ a multiple of 4"):
        RequestTemplate(model="wan2.2-t2v-a14b", height=720, width=1280, frames=80)
    with pytest.raises(ValueError, match="multiples of 16"):
        RequestTemplate(model="wan2.2-t2v-a14b", height=724, width=1280, frames=81)


def test_expert_stages_follow_the_schedule_and_the_boundary() -> None:
    t = RequestTemplate(model="wan2.2-t2v-a14b", height=720, width=1280, frames=81, steps=40)
    high, low = t.spec.expert_stages(t)
    # UniPC on flow sigmas at shift 12: timestep >= 875 for the first 26 of 40 steps
    assert (high.component, high.first_step, high.last_step) == ("transformer", 0, 25)
    assert (low.component, low.first_step, low.last_step) == ("transformer_2", 26, 39)


def test_replicated_trace_names_each_step_after_its_expert_exactly_as_a_full_trace() -> None:
    # 10 steps: UniPC traced for 6 (two settling steps, model outputs alive for two steps), 4 replicated
    t = RequestTemplate(model="tiny-wan2.2", height=64, width=64, frames=9, steps=10)
    full = trace_template(t, TraceOptions(replicate=False))  # the pipeline switches experts itself
    replicated = trace_template(t)  # one expert traced, the other's steps renamed
    assert replicated.signature() == full.signature()
    uses = expert_uses(replicated)
    assert [(u.component, u.first_step, u.last_step) for u in uses] == [("transformer", 0, 6), ("transformer_2", 7, 9)]
    assert uses[0].weight_bytes == uses[1].weight_bytes > 0
    assert uses[0].last_event < uses[1].first_event


def test_real_model_on_meta_shows_both_experts_and_the_switch() -> None:
    t = RequestTemplate(model="wan2.2-t2v-a14b", height=480, width=832, frames=81, steps=40)
    s = summarize(trace_template(t))
    w = s.weight_bytes_by_component
    assert w["transformer"] == w["transformer_2"] and 28 * GB < w["transformer"] < 29 * GB  # 14.3 B params in bf16
    assert [(e.component, e.first_step) for e in s.experts] == [("transformer", 0), ("transformer_2", 26)]
    assert s.peak_bytes > w["transformer"] + w["transformer_2"]


def test_ti2v_5b_has_its_own_vae_with_16x_compression_at_24_fps() -> None:
    spec = get_model_spec("wan2.2-ti2v-5b")
    assert (spec.vae_scale_factor, spec.spatial_multiple, spec.frame_rate) == (16, 32, 24.0)
    assert not spec.two_experts and spec.vae_config["z_dim"] == 48
    assert [t.shape_key for t in named_templates("wan2.2-ti2v-5b")] == ["wan2.2-ti2v-5b/1280x704x121"]
    with pytest.raises(ValueError, match="multiples of 32"):
        RequestTemplate(model="wan2.2-ti2v-5b", height=720, width=1280, frames=121)


def test_ti2v_5b_720p_on_meta_fits_the_published_24gb_with_the_encoder_on_the_host() -> None:
    # the Wan team: TI2V-5B 1280x704 "can run on a GPU with at least 24GB VRAM" with --t5_cpu
    t = RequestTemplate(model="wan2.2-ti2v-5b", height=704, width=1280, frames=121, steps=50)
    s = summarize(trace_template(t))  # stand-in embeddings: the encoder is not on the device
    assert 9.9 * GB < s.weight_bytes_by_component["transformer"] < 10.1 * GB  # 5.0 B parameters
    assert s.experts == [] and s.peak_bytes < 24 * GB


def test_the_serving_worker_on_meta_runs_both_experts() -> None:
    """``xema verify``'s path: the worker's own load and call on meta cross the switch."""
    from xema_ray.measure.verify import worker_trace
    from xema_ray.plan import ExecutionConfig

    t = RequestTemplate(model="tiny-wan2.2", height=64, width=64, frames=9, steps=6)
    trace = worker_trace(ExecutionConfig(template=t))  # raised before the low-noise expert's inputs went to meta
    assert len(trace.step_bounds) == 6 and trace.peak() > 0
    assert trace.loaded_bytes > 2 * 115_000  # both experts placed at load (115 kB each, fp32)


def test_the_video_api_maps_seconds_at_each_wan_models_frame_rate() -> None:
    from xema_ray.serving.api.videos import UnsupportedTemplate, VideoCreate, map_video_request

    served = {t.shape_key: t for t in [*named_templates("wan2.2-t2v-a14b"), *named_templates("wan2.2-ti2v-5b")]}
    a14b = map_video_request(VideoCreate(model="wan2.2-t2v-a14b", prompt="p", size="1280x720", seconds="5"), served)
    assert a14b.frames == 81  # 5 s at 16 fps: 1 + 80 frames
    ti2v = map_video_request(VideoCreate(model="wan2.2-ti2v-5b", prompt="p", size="1280x704", seconds="5"), served)
    assert ti2v.frames == 121  # 5 s at 24 fps: 1 + 120 frames
    with pytest.raises(UnsupportedTemplate, match="does not serve 10 s"):
        map_video_request(VideoCreate(model="wan2.2-t2v-a14b", prompt="p", size="1280x720", seconds="10"), served)


# Wan2.2-T2V-A14B-Diffusers' scheduler/scheduler_config.json as published (diffusers writes the
# defaults too; these are the fields it sets)
PUBLISHED_SCHEDULER = {
    "_class_name": "UniPCMultistepScheduler", "_diffusers_version": "0.35.0.dev0", "beta_end": 0.02,
    "beta_schedule": "linear", "beta_start": 0.0001, "disable_corrector": [], "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero", "flow_shift": 3.0, "lower_order_final": True, "num_train_timesteps": 1000,
    "predict_x0": True, "prediction_type": "flow_prediction", "rescale_betas_zero_snr": False, "sample_max_value": 1.0,
    "solver_order": 2, "solver_p": None, "solver_type": "bh2", "steps_offset": 0, "thresholding": False,
    "time_shift_type": "exponential", "timestep_spacing": "linspace", "trained_betas": None, "use_beta_sigmas": False,
    "use_dynamic_shifting": False, "use_exponential_sigmas": False, "use_flow_sigmas": True, "use_karras_sigmas": False,
}


def test_a_published_unipc_scheduler_config_is_accepted_and_used(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    from xema_ray.models import BuildOptions
    from xema_ray.models.loading import CheckpointError

    spec = get_model_spec("wan2.2-t2v-a14b")
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(PUBLISHED_SCHEDULER))
    sched = spec.scheduler(UniPCMultistepScheduler, spec.scheduler_config, BuildOptions(weights_dir=tmp_path))
    assert isinstance(sched, UniPCMultistepScheduler) and sched.config.flow_shift == 3.0  # the checkpoint's own
    # without a checkpoint: the same solver at the Wan team's shift
    own = spec.scheduler(UniPCMultistepScheduler, spec.scheduler_config, BuildOptions())
    assert own.config.flow_shift == 12.0 and own.config.solver_order == 2 and own.config.use_flow_sigmas
    # a checkpoint naming another scheduler is refused (its steps allocate differently)
    euler = FlowMatchEulerDiscreteScheduler(shift=12.0).config
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler",
                                                                            **euler}))
    with pytest.raises(CheckpointError, match="UniPCMultistepScheduler"):
        spec.scheduler(UniPCMultistepScheduler, spec.scheduler_config, BuildOptions(weights_dir=tmp_path))


def test_a_tiny_checkpoint_keeps_and_loads_the_published_scheduler(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``write_checkpoint`` saves tiny-wan2.2 with its UniPC scheduler; the worker loads the folder
    (the scheduler from its scheduler_config.json) and serves a video from it."""
    import json

    from xema_ray.checkpoints import write_checkpoint
    from xema_ray.parallel.groups import ParallelConfig
    from xema_ray.plan import ExecutionConfig
    from xema_ray.runtime import Batch, GenerationRequest
    from xema_ray.runtime.worker import ModelLoadConfig, Worker

    path = write_checkpoint("tiny-wan2.2", tmp_path)
    assert json.loads((path / "scheduler" / "scheduler_config.json").read_text())["_class_name"] == "UniPCMultistepScheduler"
    w = Worker(platform="cpu")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(ModelLoadConfig(model="tiny-wan2.2", weights_dir=path))
    assert w.engine is not None and type(w.engine.pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    t = RequestTemplate(model="tiny-wan2.2", height=64, width=64, frames=9, steps=4)
    out = w.execute(Batch(config=ExecutionConfig(template=t),
                          requests=(GenerationRequest(request_id="a", prompt="waves", seed=1),), steps=t.steps)).outputs[0]
    w.shutdown()
    assert out.media_type == "video/mp4" and len(out.data) > 0
