"""What encoding reference images costs in time, by the roofline cost model (``vae_encode_s``), on
one GPU of a hardware profile (default: the reference box's RTX A6000): per template, the encode
(``text`` phase, before the first step), the decode and the whole request at batch 1, and the
encode's share. An estimate, not a measurement (no GPU). Milliseconds to run.

Example:
    python bench/reference_encode_cost.py --out bench/results/reference-encode-a6000.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from xema_ray.plan import ExecutionConfig
from xema_ray.profiling import A6000_8X, H200
from xema_ray.profiling.costmodel import cost_model_estimate
from xema_ray.templates import RequestTemplate

TEMPLATES = [
    RequestTemplate(model="flux2", width=1024, height=1024, steps=50),
    RequestTemplate(model="flux2", width=1024, height=1024, steps=50, references=1),
    RequestTemplate(model="flux2", width=1024, height=1024, steps=50, references=2),
    RequestTemplate(model="cogvideox-5b-i2v", width=720, height=480, frames=49, steps=50, references=1),
    RequestTemplate(model="ltx2", width=768, height=512, frames=121, steps=40, references=1),
    RequestTemplate(model="wan2.2-i2v-a14b", width=832, height=480, frames=81, steps=40, references=1),
    RequestTemplate(model="wan2.2-ti2v-5b", width=1280, height=704, frames=121, steps=50, references=1),
]
HARDWARE = {"a6000": A6000_8X, "h200": H200}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="a6000")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    hw = HARDWARE[args.hardware]
    rows = []
    print(f"{'template':<46}{'encode s':>10}{'decode s':>10}{'request s':>11}{'encode %':>10}")
    for t in TEMPLATES:
        est = cost_model_estimate(ExecutionConfig(template=t), hw)
        encode, decode = est.per_phase["text"], est.per_phase["decode"]
        rows.append({"template": t.shape_key, "encode_s": encode, "decode_s": decode, "total_s": est.total_s,
                     "encode_share": encode / est.total_s})
        print(f"{t.shape_key:<46}{encode:>10.2f}{decode:>10.2f}{est.total_s:>11.1f}{100 * encode / est.total_s:>9.2f}%")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"hardware": hw.name, "source": "estimated (roofline cost model)", "rows": rows},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
