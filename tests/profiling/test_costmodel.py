"""The roofline cost model: calibration points of docs/measured-facts.md, the effects the planner relies
on (SP communication, exposed offload copies, batching), store-based calibration, and speed."""

from __future__ import annotations

import time

import pytest

from xema_ray.plan import ExecutionConfig, Mitigation
from xema_ray.profiling import A6000_8X, H200, ProfileStore, RequestRecord, estimate_latency
from xema_ray.profiling.costmodel import block_compute_s, offload_step_s, transformer_blocks
from xema_ray.templates import RequestTemplate

FLUX = RequestTemplate(model="flux2", height=1024, width=1024)
COG720 = RequestTemplate(model="cogvideox-5b", height=720, width=1280, frames=49)


def test_flux2_blocks_match_h200_calibration() -> None:
    blocks = transformer_blocks(FLUX.spec, FLUX, rows=1)
    double, single = blocks[0], blocks[-1]
    assert double.weight_bytes == pytest.approx(1.96e9, rel=0.01) and single.weight_bytes == pytest.approx(0.98e9, rel=0.01)
    assert block_compute_s(double, H200) == pytest.approx(9.1e-3, rel=0.1)
    assert block_compute_s(single, H200) == pytest.approx(8.8e-3, rel=0.1)
    assert estimate_latency(ExecutionConfig(template=FLUX), H200).per_step_s == pytest.approx(0.56, rel=0.15)


def test_cogvideox_within_25_percent_of_h200_calibration() -> None:
    est = estimate_latency(ExecutionConfig(template=COG720), H200)
    assert est.source == "estimated" and "estimate" in est.label
    assert est.per_step_s == pytest.approx(7.98, rel=0.25)
    assert est.per_phase["decode"] == pytest.approx(6.0, rel=0.25)


def test_offload_hides_only_when_blocks_are_two_apart() -> None:
    # single Flux.2 block on the H200: 8.8 ms compute, 17.7 ms copy
    compute, copy = [8.8] * 12, [17.7] * 12
    base = sum(compute)
    spaced = offload_step_s(compute, copy, {2, 5, 8, 11}, 0.0)
    adjacent = offload_step_s(compute, copy, {8, 9, 10, 11}, 0.0)
    assert spaced - base < 0.1 * base  # every copy overlaps two blocks of compute
    assert adjacent - base > 2 * 8.8  # back-to-back offloaded blocks expose their copies


def test_block_offload_costs_more_on_a6000_pcie() -> None:
    offload = Mitigation(kind="block_offload", blocks=tuple(range(0, 56, 4)), intensity=14)
    for hw in (H200, A6000_8X):
        plain = estimate_latency(ExecutionConfig(template=FLUX), hw).per_step_s
        offl = estimate_latency(ExecutionConfig(template=FLUX, mitigations=(offload,)), hw).per_step_s
        assert plain is not None and offl is not None and offl >= plain
    h200_ratio = estimate_latency(ExecutionConfig(template=FLUX, mitigations=(offload,)), H200).per_step_s / estimate_latency(ExecutionConfig(template=FLUX), H200).per_step_s  # type: ignore[operator]
    assert h200_ratio < 1.2


def test_sp_divides_compute_and_pays_communication() -> None:
    one = estimate_latency(ExecutionConfig(template=COG720), A6000_8X).per_step_s
    pair = estimate_latency(ExecutionConfig(template=COG720, ulysses=2), A6000_8X).per_step_s  # NVLink pair
    four = estimate_latency(ExecutionConfig(template=COG720, ulysses=4), A6000_8X).per_step_s  # crosses PCIe
    ring4 = estimate_latency(ExecutionConfig(template=COG720, ulysses=2, ring=2), A6000_8X).per_step_s
    assert one is not None and pair is not None and four is not None and ring4 is not None
    assert one / 2 < pair < one * 0.6
    assert four > one / 4 and ring4 > one / 4


def test_batch_scaling_is_sublinear_when_weight_bound() -> None:
    small = RequestTemplate(model="flux2", height=256, width=256)
    b1 = estimate_latency(ExecutionConfig(template=small), H200).per_step_s
    b4 = estimate_latency(ExecutionConfig(template=small, batch=4), H200).per_step_s
    assert b1 is not None and b4 is not None and b1 < b4 < 4 * b1


def test_store_measurements_take_precedence_and_calibrate() -> None:
    hw = H200.model_copy(update={"fingerprint": "cuda-test"})
    store = ProfileStore()
    measured_cfg = ExecutionConfig(template=COG720)
    store.put_request(
        RequestRecord(
            fingerprint="cuda-test", model="cogvideox-5b", template=COG720.key, config_hash=measured_cfg.config_hash(),
            source="measured", total_s=7.98 * 50 + 6.0, per_phase={"denoise": 7.98 * 50, "decode": 6.0}, steps=50,
            measured_at=0.0, config=measured_cfg,
        )
    )
    exact = estimate_latency(measured_cfg, hw, store)
    assert exact.source == "measured" and exact.per_step_s == pytest.approx(7.98)
    other = ExecutionConfig(template=COG720.with_(height=480, width=720))
    calibrated = estimate_latency(other, hw, store)
    plain = estimate_latency(other, hw)
    assert calibrated.source == "estimated" and calibrated.calibrated and not plain.calibrated
    assert calibrated.per_step_s == pytest.approx(1.74, rel=0.15)  # the 480p point, from the 720p one


def test_estimate_is_cheap() -> None:
    configs = [ExecutionConfig(template=COG720, ulysses=u, batch=b) for u in (1, 2, 4) for b in (1, 2)]
    t0 = time.perf_counter()
    for c in configs:
        estimate_latency(c, A6000_8X)
    assert (time.perf_counter() - t0) / len(configs) < 0.02


def test_error_raised_if_config_needs_more_gpus_than_the_box() -> None:
    with pytest.raises(ValueError, match="needs 16 GPUs"):
        estimate_latency(ExecutionConfig(template=COG720, ulysses=8, dp=2), H200.model_copy(update={"gpus": 8}))


def test_a_store_record_another_version_wrote_is_left_out_not_fatal(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """The start-up cache (~/.cache/xema-ray/profiles.json) is shared by every version a user runs:
    a record whose template has a field this build does not know is skipped, the rest are read."""
    import json

    cfg = ExecutionConfig(template=COG720)
    good = RequestRecord(fingerprint="f", model="cogvideox-5b", template=COG720.key, config_hash=cfg.config_hash(),
                         source="measured", total_s=1.0, per_phase={"denoise": 1.0}, steps=50, measured_at=0.0, config=cfg)
    path = tmp_path / "profiles.json"
    store = ProfileStore(path)
    store.put_request(good)
    store.save()
    raw = json.loads(path.read_text())
    alien = json.loads(json.dumps(raw["requests"][0]))
    alien["config_hash"] = "other"
    alien["config"]["template"]["a_field_from_another_version"] = 1
    raw["requests"].append(alien)
    path.write_text(json.dumps(raw))
    with caplog.at_level("WARNING"):
        again = ProfileStore(path)
    assert again.requests() == [good] and "1 record(s) this build cannot read" in caplog.text
    raw["schema_version"] = -1  # a store of another layout altogether is still refused, by name
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="schema version -1"):
        ProfileStore(path)


def test_reference_images_cost_their_vae_encode_before_the_first_step() -> None:
    """The encode is priced in the text phase (where the trace has it), per reference and request;
    an image-to-video first frame is one frame, except Wan2.2 A14B's, encoded as the whole video."""
    def text_s(t: RequestTemplate, batch: int = 1) -> float:
        return estimate_latency(ExecutionConfig(template=t, batch=batch), A6000_8X).per_phase["text"]

    one, two = (FLUX.model_copy(update={"references": n, "reference_width": 1024, "reference_height": 1024}) for n in (1, 2))
    assert text_s(FLUX) == 0.0 < text_s(one)
    assert text_s(two) == pytest.approx(2 * text_s(one)) and text_s(one, batch=2) == pytest.approx(2 * text_s(one))
    # Flux.2's VAE on a 1024² image, the encoder a bit lighter than the decoder on the same image
    assert 0.5 < text_s(one) / estimate_latency(ExecutionConfig(template=FLUX), A6000_8X).per_phase["decode"] < 1.0

    wan = RequestTemplate(model="wan2.2-i2v-a14b", width=832, height=480, frames=81, steps=40, references=1)
    cog = RequestTemplate(model="cogvideox-5b-i2v", width=720, height=480, frames=49, references=1)
    for t, lo, hi in ((wan, 0.5, 1.0), (cog, 0.005, 0.05)):  # the whole padded video vs one frame, per its decode
        est = estimate_latency(ExecutionConfig(template=t), A6000_8X)
        assert lo < est.per_phase["text"] / est.per_phase["decode"] < hi, (t.shape_key, est.per_phase)
