"""The official openai client against a running ``make serve``: a LoRA adapter hot-added, used
through ``images.generate(..., extra_body={"lora": [...]})``, then removed, without a restart.

The adapter file is made here, locally (no download), in a published key layout: ai-toolkit's
Flux.2 names (``diffusion_model.double_blocks.<i>.img_attn.qkv.lora_A.weight``,
``single_blocks.<i>.linear1``, ...), which diffusers' Flux.2 LoRA loader converts. Its shapes come
from tiny-flux2's config (built on the meta device: no weights).

Example (after ``make serve`` answers /healthz):
    PYTHONPATH=. .venv/bin/python bench/lora_openai_demo.py --url http://127.0.0.1:8000 \\
        --out bench/results/lora_openai_demo.json
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
from openai import OpenAI, UnprocessableEntityError

from xema_ray.lora.synthetic import write_adapter
from xema_ray.models import BuildOptions, get_model_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", type=Path, default=Path("bench/results/lora_openai_demo.json"))
    ap.add_argument("--name", default="demo-style")
    args = ap.parse_args()
    log: dict[str, Any] = {"url": args.url}
    client = OpenAI(base_url=f"{args.url}/v1", api_key="unused")
    gen = {"model": "tiny-flux2", "prompt": "a lighthouse at dusk", "size": "64x64", "response_format": "b64_json"}

    def digest(resp: Any) -> str:
        return hashlib.sha256(base64.b64decode(resp.data[0].b64_json)).hexdigest()[:16]

    with tempfile.TemporaryDirectory() as d:
        dit = get_model_spec("tiny-flux2").build_pipeline(BuildOptions(device="meta")).transformer
        path = write_adapter(Path(d) / "style.safetensors", dit, rank=8, seed=7, layout="ai-toolkit-flux2")
        log["file_keys_sample"] = sorted(__import__("safetensors").safe_open(str(path), "pt").keys())[:3]
        try:
            client.images.generate(**gen, extra_body={"lora": [{"name": args.name}], "seed": 1})  # type: ignore[arg-type]
            log["before_add"] = "200 (unexpected)"
        except UnprocessableEntityError as e:
            log["before_add"] = f"422: {e.body['message'] if isinstance(e.body, dict) else e}"  # type: ignore[index]
        t0 = time.perf_counter()
        r = requests.post(f"{args.url}/v1/adapters", json={"name": args.name, "model": "tiny-flux2", "path": str(path)},
                          timeout=120)
        log["add"] = {"status": r.status_code, "body": r.json(), "seconds": round(time.perf_counter() - t0, 3)}
        with_lora = client.images.generate(**gen, extra_body={"lora": [{"name": args.name, "scale": 1.0}], "seed": 1})  # type: ignore[arg-type]
        plain = client.images.generate(**gen, extra_body={"seed": 1})  # type: ignore[arg-type]
        again = client.images.generate(**gen, extra_body={"lora": [{"name": args.name, "scale": 1.0}], "seed": 1})  # type: ignore[arg-type]
        log["images"] = {"with_lora": digest(with_lora), "plain": digest(plain), "with_lora_again": digest(again)}
        log["listed"] = [a["name"] for a in requests.get(f"{args.url}/v1/adapters", timeout=60).json()["data"]]
        log["stats_adapters"] = requests.get(f"{args.url}/v1/stats", timeout=60).json().get("adapters")
        r = requests.delete(f"{args.url}/v1/adapters/{args.name}", timeout=120)
        log["delete"] = {"status": r.status_code, "body": r.json()}
        try:
            client.images.generate(**gen, extra_body={"lora": [{"name": args.name}], "seed": 1})  # type: ignore[arg-type]
            log["after_delete"] = "200 (unexpected)"
        except UnprocessableEntityError as e:
            log["after_delete"] = f"422: {e.body['message'] if isinstance(e.body, dict) else e}"  # type: ignore[index]
    ok = (log["add"]["status"] == 201 and log["images"]["with_lora"] != log["images"]["plain"]
          and log["images"]["with_lora"] == log["images"]["with_lora_again"] and log["delete"]["status"] == 200
          and str(log["before_add"]).startswith("422") and str(log["after_delete"]).startswith("422"))
    log["ok"] = ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(log, indent=2))
    print(json.dumps(log, indent=2))
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
