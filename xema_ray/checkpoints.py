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
    target = _fresh(out / model)
    pipe.save_pretrained(str(target), safe_serialization=True)
    _name_diffusers_class(target / "model_index.json", type(pipe))
    return target


def _name_diffusers_class(index: Path, cls: type) -> None:
    """``model_index.json`` names the diffusers pipeline class ``cls`` extends, as the published
    repositories do: a subclass of this project's (Flux.2's per-request reference images) saves
    under its own name, which neither diffusers nor the start-up check knows."""
    import json

    import diffusers

    base = next(c for c in cls.__mro__ if getattr(diffusers, c.__name__, None) is c)
    doc = json.loads(index.read_text())
    if doc.get("_class_name") != base.__name__:
        doc["_class_name"] = base.__name__
        index.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _fresh(target: Path) -> Path:
    """``target``, emptied: files of the other layout left beside new ones (a single file next to a
    shard index) would be read instead of them."""
    import shutil

    if target.exists():
        shutil.rmtree(target)
    return target


def write_published(model: str, out: Path, seed: int = 0) -> Path:
    """Write tiny ``model`` to ``out/model`` laid out exactly as its real model's published
    repository is (``xema_ray.models.published``): its ``model_index.json`` classes, the folders,
    each component in the dtype the repository stores it in, transformer and text encoder sharded
    with their ``*.safetensors.index.json``, the tokenizer as the repository ships it and the
    scheduler's config. The weights are the seeded ones ``write_checkpoint`` writes, rounded to
    the stored dtypes."""
    import json

    import diffusers

    from xema_ray.models.base import DTYPES
    from xema_ray.models.published import PUBLISHED
    from xema_ray.models.text_encoders import save_published_tokenizer

    spec = get_model_spec(model)
    layout = PUBLISHED[spec.published_layout]
    pipe = spec.build_pipeline(BuildOptions(device="cpu", dtype=torch.float32, seed=seed, text_encoder="device"))
    target = _fresh(out / model)
    target.mkdir(parents=True)
    index: dict[str, object] = {"_class_name": layout.pipeline, "_diffusers_version": diffusers.__version__}
    for name, comp in sorted(layout.components.items()):
        index[name] = [comp.library, comp.class_name]
        module = getattr(pipe, name)
        folder = target / name
        if name == "scheduler":
            module.save_pretrained(str(folder))
        elif name == "tokenizer":
            save_published_tokenizer(spec.text_encoder, module, comp.class_name, folder)
        else:
            assert comp.dtype is not None, name
            module = module.to(DTYPES[comp.dtype])
            nbytes = sum(t.numel() * t.element_size() for t in module.state_dict().values())
            # tiny shards: three or so per sharded component, as the real ones are several
            shard = f"{max(1, nbytes // 3 // 1000)}KB" if comp.sharded else "10GB"
            module.save_pretrained(str(folder), safe_serialization=True, max_shard_size=shard)
    (target / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xema_ray.checkpoints", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("checkpoints"))
    p.add_argument("--models", default=",".join(TINY_MODELS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=("save_pretrained", "published"), default="save_pretrained",
                   help="published: laid out as the real model's Hugging Face repository (dtypes, shards, tokenizer)")
    args = p.parse_args(argv)
    for m in [x.strip() for x in args.models.split(",") if x.strip()]:
        if get_model_spec(m).size != "tiny":
            print(f"{m}: only tiny checkpoints are written here (real weights are never generated or downloaded)")
            return 2
        write = write_published if args.layout == "published" else write_checkpoint
        print(f"wrote {write(m, args.out, args.seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
