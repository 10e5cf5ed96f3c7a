"""One phase vocabulary (``xema_ray.vocabulary``): stored data of earlier versions is read with
today's names; input with an old name is refused, naming the new ones."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from xema_ray.memory.trace import MemoryTrace
from xema_ray.profiling.costmodel import LatencyEstimate
from xema_ray.profiling.phases import PhaseShares
from xema_ray.profiling.store import ProfileStore
from xema_ray.runtime.emulation import EmulatedPhases
from xema_ray.vocabulary import LATENCY_PHASES, Phase, latency_phase, parse_phase, phase_of_trace, read_stored_phase


def test_one_name_per_phase() -> None:
    assert [p.value for p in Phase] == ["text", "denoise", "post", "decode", "encode"]
    assert Phase.POST not in LATENCY_PHASES and latency_phase("post") is Phase.DECODE
    assert [phase_of_trace(n) for n in ("text", "denoise.step0", "denoise.step7", "post", "decode.vae", "decode.audio_vae")] == [
        Phase.TEXT, Phase.DENOISE, Phase.DENOISE, Phase.POST, Phase.DECODE, Phase.DECODE]
    assert json.dumps({Phase.TEXT: 1.0}) == '{"text": 1.0}' and f"{Phase.DENOISE}.step3" == "denoise.step3"


def test_old_names_are_refused_in_input_naming_the_new_ones() -> None:
    with pytest.raises(ValueError, match="'setup' is now called 'text'.*text, denoise, post, decode, encode"):
        parse_phase("setup")
    with pytest.raises(ValueError, match="unknown phase 'tail'"):
        parse_phase("tail")
    with pytest.raises(ValidationError, match="'setup' is now called 'text'"):
        LatencyEstimate(total_s=1.0, per_phase={"setup": 1.0}, source="estimated")
    with pytest.raises(ValidationError, match="'tail' is now called 'decode_encode'"):
        PhaseShares.model_validate({"text": 0.1, "denoise": 0.6, "tail": 0.3})
    with pytest.raises(ValidationError, match="'step_s' is now called 'denoise_step_s'"):
        EmulatedPhases.model_validate({"steps": 2, "text_s": 0.0, "step_s": 1.0, "decode_s": 0.1, "peak_bytes": 0,
                                       "video": False, "width": 64, "height": 64, "frames": 1, "fps": 8.0})


def test_a_cached_trace_of_an_earlier_version_reads_setup_as_text(tmp_path: Path) -> None:
    n = 2
    trace = MemoryTrace(size=np.array([512, 512]), nbytes=np.array([512, 512]), begin=np.array([0, 1]), end=np.array([2, 3]),
                        category=np.array([2, 2], dtype=np.int8), module=np.array([-1, -1], dtype=np.int32),
                        phase=np.array([0, 1], dtype=np.int32), op=np.array([-1, -1], dtype=np.int32),
                        free_module=np.array([-1, -1], dtype=np.int32), n_events=2 * n, phases=["setup", "denoise.step0"])
    path = tmp_path / "trace.json"
    trace.save(path)
    assert MemoryTrace.load(path).phases == ["text", "denoise.step0"]
    assert read_stored_phase("post") == "post"


def test_a_profile_store_of_an_earlier_version_reads_setup_as_text(tmp_path: Path) -> None:
    path = tmp_path / "profiles.json"
    seg = {"fingerprint": "cpu", "model": "tiny-flux2", "exec_key": "k", "unit": "u", "seconds": 0.1, "samples": 1,
           "config_hash": "c", "measured_at": 0.0}
    path.write_text(json.dumps({
        "schema_version": 1,
        "segments": [{**seg, "signature": "unit:text_encoder@setup"}, {**seg, "signature": "untraced:setup"},
                     {**seg, "signature": "0123abcd"}],
        "requests": [{"fingerprint": "cpu", "model": "tiny-flux2", "template": "t", "config_hash": "c", "source": "measured",
                      "total_s": 1.0, "per_phase": {"setup": 0.25, "denoise": 0.5, "decode": 0.25}, "steps": 2,
                      "measured_at": 0.0}],
    }))
    store = ProfileStore(path)
    for sig in ("unit:text_encoder@text", "untraced:text", "0123abcd"):
        assert store.get_segment("cpu", "tiny-flux2", "k", sig) is not None
    (rec,) = store.requests()
    assert rec.per_phase == {Phase.TEXT: 0.25, Phase.DENOISE: 0.5, Phase.DECODE: 0.25}
    store.save()
    assert '"setup"' not in path.read_text() and "@setup" not in path.read_text()


# ---------------------------------------------------------------------------- latency sources
def test_one_latency_source_vocabulary() -> None:
    from xema_ray.plan import PlanPrediction
    from xema_ray.vocabulary import LatencySource

    assert [s.value for s in LatencySource] == ["measured", "profiled", "estimated", "measured+estimated"]
    pred = PlanPrediction(peak_bytes=1, latency_s=1.0, goodput_rps=1.0, slo_s=10.0, latency_source="measured+estimated")
    assert pred.latency_source is LatencySource.MEASURED_ESTIMATED
    assert '"latency_source":"measured+estimated"' in pred.model_dump_json()  # committed plans read and write as before
    with pytest.raises(ValidationError, match="counts a profiled latency as measured"):
        PlanPrediction(peak_bytes=1, latency_s=1.0, goodput_rps=1.0, slo_s=10.0, latency_source="profiled")
    with pytest.raises(ValidationError):
        LatencyEstimate(total_s=1.0, per_phase={}, source="measured+estimated")  # calibration is its own flag


def test_plan_entries_count_profiled_latencies_as_measured() -> None:
    from planner.latency import combine, source_label
    from xema_ray.vocabulary import LatencySource

    def est(source: str, calibrated: bool = False) -> LatencyEstimate:
        return LatencyEstimate(total_s=1.0, per_phase={}, source=source, calibrated=calibrated)

    assert [source_label(est(s)) for s in ("measured", "profiled", "estimated")] == ["measured", "measured", "estimated"]
    assert source_label(est("estimated", calibrated=True)) is LatencySource.MEASURED_ESTIMATED
    assert combine([LatencySource.MEASURED, LatencySource.MEASURED]) is LatencySource.MEASURED
    assert combine([LatencySource.ESTIMATED]) is LatencySource.ESTIMATED
    assert combine([LatencySource.MEASURED, LatencySource.ESTIMATED]) is LatencySource.MEASURED_ESTIMATED
