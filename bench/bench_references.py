"""What reference images cost on the device: the analyzer's shape-only trace (meta device, no
weights, no GPU) of Flux.2-dev 1024² with no, one and two 1024² references, and of CogVideoX-5B
720x480x49 text-to-video against CogVideoX-5B-I2V at the same shape (the I2V model serves 720x480
only: its learned positional embeddings are sized for it), and Wan2.2's first frames: T2V-A14B
against I2V-A14B at 832x480x81 and 1280x720x81, TI2V-5B 1280x704x121 without and with one. Each row: resident weights, the
request's peak and where it is, each phase's peak, the sequence length; and the difference each
reference makes. Prompt embeddings are the seeded stand-ins (``xema analyze --text-encoder none``).

Example:
    python bench/bench_references.py --out bench/results/references.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.memory.analysis import summarize
from xema_ray.templates import RequestTemplate

FLUX = RequestTemplate(model="flux2", width=1024, height=1024, steps=50)
COG_T2V = RequestTemplate(model="cogvideox-5b", width=720, height=480, frames=49, steps=50)
COG_I2V = RequestTemplate(model="cogvideox-5b-i2v", width=720, height=480, frames=49, steps=50, references=1)
TEMPLATES = {
    "flux2 1024² text-to-image": FLUX,
    "flux2 1024² + 1 reference (1024²)": FLUX.with_(references=1, reference_width=1024, reference_height=1024),
    "flux2 1024² + 2 references (1024²)": FLUX.with_(references=2, reference_width=1024, reference_height=1024),
    "cogvideox-5b 720x480x49 text-to-video": COG_T2V,
    "cogvideox-5b-i2v 720x480x49 + its first frame": COG_I2V,
}
for _w, _h in ((832, 480), (1280, 720)):
    _t2v = RequestTemplate(model="wan2.2-t2v-a14b", width=_w, height=_h, frames=81, steps=40)
    TEMPLATES[f"wan2.2-t2v-a14b {_w}x{_h}x81 text-to-video"] = _t2v
    TEMPLATES[f"wan2.2-i2v-a14b {_w}x{_h}x81 + its first frame"] = RequestTemplate(
        model="wan2.2-i2v-a14b", width=_w, height=_h, frames=81, steps=40, references=1)
_TI2V = RequestTemplate(model="wan2.2-ti2v-5b", width=1280, height=704, frames=121, steps=50)
TEMPLATES["wan2.2-ti2v-5b 1280x704x121 text-to-video"] = _TI2V
TEMPLATES["wan2.2-ti2v-5b 1280x704x121 + a first frame"] = _TI2V.with_(references=1)
#: (what the image adds, over what): the rows compared
COMPARED = {"flux2: first reference": (0, 1), "flux2: second reference": (1, 2),
            "cogvideox: image-to-video over text-to-video": (3, 4),
            "wan2.2 A14B 480p: image-to-video over text-to-video": (5, 6),
            "wan2.2 A14B 720p: image-to-video over text-to-video": (7, 8),
            "wan2.2-ti2v-5b: a first frame over text-to-video": (9, 10)}


def row(t: RequestTemplate) -> dict[str, Any]:
    t0 = time.perf_counter()
    trace = trace_template(t, TraceOptions(replay_blocks=True))
    s = summarize(trace)
    phases: dict[str, int] = {}
    for p in s.phase_peaks:  # denoising steps repeat: the largest of them
        name = "denoise (max over steps)" if p.phase.startswith("denoise") else p.phase
        phases[name] = max(phases.get(name, 0), p.peak_bytes)
    return {"template": t.key, "tokens": t.token_counts(), "resident_bytes": trace.resident_bytes(),
            "peak_bytes": s.peak_bytes, "peak_phase": s.peak_phase, "peak_module": s.peak_module,
            "activation_bytes_at_peak": s.activation_bytes_at_peak, "phase_peaks": phases,
            "trace_s": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/references.json"))
    args = p.parse_args(argv)
    rows = {}
    for name, t in TEMPLATES.items():
        rows[name] = row(t)
        r = rows[name]
        print(f"{name}: peak {r['peak_bytes'] / 1e9:.2f} GB in {r['peak_phase']}, activations "
              f"{r['activation_bytes_at_peak'] / 1e9:.2f} GB, weights {r['resident_bytes'] / 1e9:.2f} GB "
              f"({r['trace_s']} s)", flush=True)
    names = list(TEMPLATES)

    def added(a: str, b: str) -> dict[str, int]:
        out = {k: rows[b][k] - rows[a][k] for k in ("resident_bytes", "peak_bytes", "activation_bytes_at_peak")}
        first = {"text", "denoise (max over steps)"} & set(rows[a]["phase_peaks"]) & set(rows[b]["phase_peaks"])
        out.update({f"phase {k}": rows[b]["phase_peaks"][k] - rows[a]["phase_peaks"][k] for k in sorted(first)})
        return out

    result = {
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}), torch {torch.__version__}",
        "counted_on": "meta device (xema_ray.analyzer), bf16, stand-in prompt embeddings", "rows": rows,
        "added": {what: added(names[a], names[b]) for what, (a, b) in COMPARED.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["added"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
