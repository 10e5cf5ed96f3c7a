"""Per-step progress and cancellation of a running batch (the engine's only hook for jobs).

A ``StepObserver`` is told about every finished denoising step and the end of the VAE decode on
the batch's output rank (SP rank 0), and answers whether the batch should stop. The engine turns
it into diffusers' ``callback_on_step_end``. Every rank of an SP group must leave the denoising
loop at the same step (a rank that leaves early would strand the others in their next
collective), so with SP > 1 the ranks agree on the answer with one ``all_reduce(MAX)`` of a
one-element tensor per step; rank 0's vote is the only one that can be true.

A preemptible batch also gets a ``PauseControl`` (``xema_ray.runtime.pause``): its pause
vote rides the same collective (0 = go on, 1 = pause keeping the state on the device, 2 = pause
moving it to the host, 3 = stop; MAX wins, and any rank's pause request counts, since the
serving layer asks every rank the same), and a pause parks the run's thread
inside the callback until it is resumed.

Stopping raises ``BatchCancelled`` at the step boundary rather than only setting the pipeline's
``_interrupt`` flag: diffusers skips the remaining steps on that flag but still runs the VAE decode
(seconds at 720p), and the point of stopping is to give the worker back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from xema_ray.runtime.pause import PauseControl

_GO, _PAUSE, _PAUSE_OFFLOAD, _STOP = 0, 1, 2, 3
#: the votes ``step_vote`` returns, for other runners of the step protocol (the emulated worker)
VOTE_GO, VOTE_PAUSE, VOTE_PAUSE_OFFLOAD, VOTE_STOP = _GO, _PAUSE, _PAUSE_OFFLOAD, _STOP


class BatchCancelled(RuntimeError):
    """Every request of the batch was cancelled; the batch stopped after ``step`` steps."""

    def __init__(self, step: int) -> None:
        super().__init__(f"batch cancelled after {step} denoising step(s)", step)
        self.step = step

    def __str__(self) -> str:
        return str(self.args[0])


class StepObserver(Protocol):
    """What the engine reports to while a batch runs (implemented by the serving layer's jobs)."""

    def on_step(self, step: int, total: int) -> bool:
        """``step`` of ``total`` denoising steps finished; return True to stop the batch now."""
        ...

    def on_decoded(self) -> None:
        """The VAE decode (and any audio decode) finished; only encoding remains."""
        ...

    # optional: ``on_failed()`` — the batch ended without output (it raised, or was stopped); the
    # engine calls it where an observer has it (a job's observer stops watching its jobs there)


def step_vote(observer: StepObserver | None, control: PauseControl | None, step: int, total: int,
              sp_group: Any = None, output_rank: bool = True, device: torch.device | None = None) -> int:
    """What the SP group does after ``step`` of ``total``: go on (0), pause keeping the state (1),
    pause moving it to the host (2) or stop (3); the ranks agree with one ``all_reduce(MAX)``.
    Shared by the engine's step callback and the emulated worker (``xema_ray.runtime.emulated``)."""
    vote = _GO
    if observer is not None and output_rank and observer.on_step(step, total):
        vote = _STOP
    elif control is not None and control.wants_pause() and step < total:
        # never after the last step: nothing is left to run later
        vote = _PAUSE_OFFLOAD if control.offload_requested() else _PAUSE
    if sp_group is not None:
        flag = torch.tensor([vote], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=sp_group.group)
        vote = int(flag.item())
    return vote


def step_callback(pipe: Any, observer: StepObserver | None, total: int, sp_group: Any = None,
                  output_rank: bool = True, device: torch.device | None = None,
                  control: PauseControl | None = None,
                  env: tuple[Callable[[], None], Callable[[], None]] | None = None) -> dict[str, Any]:
    """Pipeline kwargs (``callback_on_step_end``) that report each step to ``observer``.

    Args:
        pipe: the diffusers pipeline being called (its ``_interrupt`` flag is set on a stop).
        observer: who hears about steps; None: no kwargs, the pipeline runs unobserved.
        total: denoising steps of the template.
        sp_group: the batch's SP group (an object with ``.group``, a ProcessGroup) or None.
        output_rank: whether this rank is the group's rank 0 (the only one that consults ``observer``).
        device: where the agreement tensor lives (the collective backend's device).
        control: a preemptible batch's pause control (None: the batch cannot be paused).
        env: (detach, attach) of the batch's mitigations / SP / layout, for a pause.

    Example:
        >>> step_callback(object(), None, 4)
        {}
    """
    if observer is None and control is None:
        return {}

    def callback(p: Any, i: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        vote = step_vote(observer, control, i + 1, total, sp_group, output_rank, device)
        if vote == _STOP:
            p._interrupt = True
            raise BatchCancelled(i + 1)
        if vote in (_PAUSE, _PAUSE_OFFLOAD) and control is not None and env is not None:
            frame = sys._getframe(1)  # the pipeline's __call__: its locals are the batch's state
            f_locals = frame.f_locals
            del frame
            control.park(p, f_locals, tensors, i + 1, total, *env, offload=vote == _PAUSE_OFFLOAD)
            if sys.version_info < (3, 13):
                f_locals.clear()  # a snapshot on these versions: it would pin this step's tensors
        return tensors

    cb: Callable[..., dict[str, Any]] = callback
    return {"callback_on_step_end": cb}
