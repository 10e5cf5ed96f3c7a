"""``worker_trace`` in a child process started with the fixed string-hash seed
(``xema_ray.hash_seed``), for callers whose own interpreter is salted: the stream a
layout is solved from and verified against is then the one a seeded serving worker allocates.

Run as ``python -m xema_ray.measure.seeded_trace REQUEST.json FOLDER``: the request is a
``SeededTraceRequest``, the answer one ``MemoryTrace`` file per step count (``FOLDER/trace-<i>.json``).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from xema_ray.memory.trace import MemoryTrace
from xema_ray.plan import ExecutionConfig
from xema_ray.hash_seed import seeded, seeded_env


class SeededTraceRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    config: ExecutionConfig
    steps: list[int]
    layouts_dir: str | None = None
    replay_blocks: bool = True


def trace_in_child(config: ExecutionConfig, steps: tuple[int, ...], layouts_dir: Path | None,
                   replay_blocks: bool) -> list[MemoryTrace]:
    """``worker_streams(config, steps, layouts_dir, replay_blocks)`` computed by a seeded child process."""
    with tempfile.TemporaryDirectory(prefix="xema-trace-") as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp)
        req.write_text(SeededTraceRequest(config=config, steps=list(steps), replay_blocks=replay_blocks,
                                          layouts_dir=None if layouts_dir is None else str(layouts_dir)).model_dump_json())
        done = subprocess.run([sys.executable, "-m", __name__, str(req), str(out)], env=seeded_env(),
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            raise RuntimeError(f"{config.template.shape_key}: the seeded trace process failed: {tail[0]}")
        return [MemoryTrace.load(out / f"trace-{i}.json") for i in range(len(steps))]


def main(argv: list[str]) -> int:
    from xema_ray.measure.verify import trace_here

    if not seeded():
        print("seeded_trace: started without PYTHONHASHSEED=0", file=sys.stderr)
        return 2
    req = SeededTraceRequest.model_validate_json(Path(argv[0]).read_text())
    folder = None if req.layouts_dir is None else Path(req.layouts_dir)
    for i, trace in enumerate(trace_here(req.config, tuple(req.steps), folder, req.replay_blocks)):
        trace.save(Path(argv[1]) / f"trace-{i}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
