"""The string-hash seed a request's allocation stream depends on, fixed for every process that
solves, verifies or serves a static layout.

Python salts ``str`` hashes per process (``PYTHONHASHSEED``), so iterating a set of strings runs
in a per-process order, and model code does that on the request path: Gemma-3 (LTX-2's text
encoder) builds its attention masks and rotary embeddings ``for layer_type in
set(config.layer_types)`` ("full_attention", "sliding_attention"). Where the encoder runs on the
device (``text_encoder`` "device" or "streamed") the two orders make two different allocation
streams, and a layout solved from one misses on the other from the mask allocations on (measured:
LTX-2 1920x1088x49 solved in a planning task, replayed in ``xema verify``'s process: 27 hits,
2,443,580 misses). A fixed seed makes the stream one stream: layouts are solved, verified and
served under ``PYTHONHASHSEED=0``, which the interpreter only reads when it starts:

- ``xema`` (verify, layouts, plan) and ``python -m planner`` re-start themselves with it
  (``reexec_seeded``); a Ray cluster they start inherits it, and ``ray.init``'s runtime env sets it
  for the workers of a cluster they join (``RUNTIME_ENV``);
- ``xema serve`` starts Ray with it (``xema_ray.serving.ray_env``), and the deployment YAMLs set it
  in the application's runtime env, so the serving workers run with it;
- ``worker_trace`` run in any other process traces in a child process that has it
  (``xema_ray.measure.seeded_trace``), and a serving worker in such a process loads and validates
  its layouts but does not arm them (``Worker.layout_status`` says why).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

HASH_SEED_ENV = "PYTHONHASHSEED"
#: "0" switches the salt off: the same order in every process, on every machine of the same build
HASH_SEED = "0"
#: for ``ray.init`` / a Serve application: every worker process of the job starts with the seed
RUNTIME_ENV: dict[str, dict[str, str]] = {"env_vars": {HASH_SEED_ENV: HASH_SEED}}
#: set by ``reexec_seeded`` in the re-started process (a second exec would loop)
_REEXEC_GUARD = "XEMA_SEEDED_REEXEC"


def seeded() -> bool:
    """Whether this interpreter started with ``PYTHONHASHSEED=0`` (string hashing unsalted):
    ``sys.flags.hash_randomization`` is 0 exactly then."""
    return sys.flags.hash_randomization == 0


def seeded_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the seed set."""
    env = dict(os.environ if base is None else base)
    env[HASH_SEED_ENV] = HASH_SEED
    return env


def reexec_seeded(argv: Sequence[str] | None = None) -> None:
    """Replace this process with itself started under the seed, unless it already runs under it
    (or is the re-started one). Call before any work: the command runs again from the start.

    Args:
        argv: the command line to re-run; default ``sys.orig_argv`` (interpreter and its options
            included, as this process was started).
    """
    if seeded() or os.environ.get(_REEXEC_GUARD) == "1":
        return
    args = list(sys.orig_argv if argv is None else argv)
    env = seeded_env()
    env[_REEXEC_GUARD] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args[1:]], env)


def unseeded_reason() -> str:
    return (f"this process's string hashing is salted ({HASH_SEED_ENV} is not {HASH_SEED}): the model code iterates "
            "sets of strings, so its allocation stream is not the one the layouts were solved from; start the "
            f"workers with {HASH_SEED_ENV}={HASH_SEED} (xema serve and the deployment YAMLs' runtime_env do)")
