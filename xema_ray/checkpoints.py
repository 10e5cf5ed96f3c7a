"""``make checkpoints``: tiny but complete diffusers directories for the three tiny models.

Each directory is what ``DiffusionPipeline.save_pretrained`` writes — ``model_index.json``, the
transformer, VAE(s), scheduler, text encoder (transformers) and tokenizer (built here, no
download) — from the seeded weights a worker builds for that seed, so a worker loading the
directory serves bit for bit what a worker building the model from its config with the same
seed serves (the tests check it).

Example:
    python -m xema_ray.checkpoints --out checkpoints
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from xema_ray.models import BuildOptions, get_model_spec

TINY_MODELS = ("tiny-flux2", "tiny-cogvideox", "tiny-ltx2")


def write_checkpoint(model: str, out: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``model``'s pipeline (seeded weights, with its text encoder) to ``out/model``."""
    spec = get_model_spec(model)
    pipe = spec.build_pipeline(BuildOptions(device="cpu", dtype=dtype, seed=seed, text_encoder="device"))
    target = out / model
    pipe.save_pretrained(str(target), safe_serialization=True)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xema_ray.checkpoints", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("checkpoints"))
    p.add_argument("--models", default=",".join(TINY_MODELS))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for m in [x.strip() for x in args.models.split(",") if x.strip()]:
        if get_model_spec(m).size != "tiny":
            print(f"{m}: only tiny checkpoints are written here (real weights are never generated or downloaded)")
            return 2
        print(f"wrote {write_checkpoint(m, args.out, args.seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
