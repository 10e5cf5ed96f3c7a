"""The official openai client against ``make serve-emulated`` (docs/emulated.md): CogVideoX-5B's two
emulated A6000s both busy with a 1920x1088 job, a 1280x720 job created behind them preempts one
(``/v1/stats``), every job shows per-step progress and completes.

    make serve-emulated PORT=8250 &
    PYTHONPATH=. python bench/emulated_client_demo.py --url http://127.0.0.1:8250 --out bench/results/emulated-client.json
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
import warnings
from pathlib import Path


def main() -> None:
    import openai

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", type=Path, default=None, help="write the transcript here (JSON)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # openai marks its video API deprecated
    client = openai.OpenAI(base_url=f"{a.url}/v1", api_key="emulated")
    t0 = time.monotonic()
    jobs = {}
    for name, size in (("1080p-a", "1920x1088"), ("1080p-b", "1920x1088")):
        jobs[name] = client.videos.create(model="cogvideox-5b", prompt=f"a long one ({name})", size=size, seconds="6")
    time.sleep(3.0)  # both 1080p jobs are running, one per emulated GPU
    jobs["720p"] = client.videos.create(model="cogvideox-5b", prompt="a short one", size="1280x720", seconds="6")
    seen: dict[str, list[tuple[float, str, int]]] = {k: [] for k in jobs}
    done: dict[str, float] = {}
    while len(done) < len(jobs):
        for name, v in jobs.items():
            if name in done:
                continue
            v = jobs[name] = client.videos.retrieve(v.id)
            t = round(time.monotonic() - t0, 1)
            if not seen[name] or seen[name][-1][1:] != (v.status, v.progress):
                seen[name].append((t, v.status, v.progress))
            if v.status not in ("queued", "in_progress"):
                done[name] = t
        time.sleep(0.5)
    with urllib.request.urlopen(f"{a.url}/v1/stats", timeout=30) as r:
        stats = json.loads(r.read())["preemption"]["cogvideox-5b"]
    content = client.videos.download_content(jobs["720p"].id).read()
    out = {
        "jobs": {k: {"id": v.id, "size": v.size, "status": v.status, "emulated": (v.model_extra or {}).get("emulated"),
                     "done_after_s": done[k], "progress": seen[k]} for k, v in jobs.items()},
        "preemption": stats, "mp4_bytes_720p": len(content),
    }
    for k, v in out["jobs"].items():
        steps = sorted({p for _, s, p in v["progress"] if s == "in_progress"})
        print(f"{k}: {v['status']} after {v['done_after_s']} s, emulated={v['emulated']}, "
              f"{len(steps)} distinct progress values {steps[:4]}...{steps[-3:]}")
    print(f"/v1/stats preemption (cogvideox-5b): decisions {stats['decisions']}, "
          f"{[(d['kind'], d['template']) for d in stats['recent']]}")
    if a.out is not None:
        a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
