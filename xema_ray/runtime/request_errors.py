"""A batch failure the worker can pin on some of its requests' own input (``RequestFailed``),
so that the serving layer answers those requests with a 4xx and re-runs the others without them,
instead of failing every request of the batch.

Two places attribute a failure:

- ``attributed(ids, param)``: a ``ValueError`` raised while turning the batch's shared options into
  the pipeline's arguments (e.g. a guidance scale the model refuses) is every request's of the
  sub-batch — they all asked for that value;
- ``encode_attributed``: when encoding the batch's prompts fails, each prompt is encoded alone; the
  requests whose prompt fails alone are the ones at fault (unless a plain reference prompt fails
  too: then it is the encoder's failure, raised as it was). Negative prompts are encoded the same way and replace the
  model's default negative prompt row by row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xema_ray.runtime.text import EncodedPrompts, PromptEncoder


#: a prompt every encoder takes: when it fails too, a failure is the encoder's, not a request's
REFERENCE_PROMPT = "a photo"


class RequestFailed(ValueError):
    """Some requests of a batch cannot run for their own input (HTTP 422 for them; the others of
    the batch are run again without them). Values in ``args``: it crosses Ray by pickle."""

    def __init__(self, message: str, request_ids: tuple[str, ...], param: str | None = None) -> None:
        super().__init__(message, tuple(request_ids), param)
        self.request_ids = tuple(request_ids)
        self.param = param

    def __str__(self) -> str:
        return str(self.args[0])


def failed_requests(e: BaseException) -> RequestFailed | None:
    """The ``RequestFailed`` behind ``e`` (a Ray actor's error wraps it as its ``cause``), or None."""
    for candidate in (e, getattr(e, "cause", None), e.__cause__):
        if isinstance(candidate, RequestFailed):
            # a Ray error made ``as_instanceof_cause`` keeps the values in the cause
            inner = getattr(candidate, "cause", None)
            return inner if isinstance(inner, RequestFailed) else candidate
    return None


@contextlib.contextmanager
def attributed(ids: list[str], param: str) -> Iterator[None]:
    """A ``ValueError`` inside becomes ``RequestFailed`` for all of ``ids`` (their shared option)."""
    try:
        yield
    except RequestFailed:
        raise
    except ValueError as e:
        raise RequestFailed(str(e), tuple(ids), param) from e


def _culprits(encode: object, texts: list[str], ids: list[str]) -> list[str]:
    bad = []
    for text, rid in zip(texts, ids, strict=True):
        try:
            encode([text])  # type: ignore[operator]
        except Exception:
            bad.append(rid)
    return bad


def _encode(encoder: PromptEncoder, texts: list[str], ids: list[str], what: str) -> EncodedPrompts:
    try:
        return encoder.encode(texts)
    except Exception as e:
        bad = _culprits(encoder.encode, texts, ids)
        if not bad or (len(bad) == len(ids) and _culprits(encoder.encode, [REFERENCE_PROMPT], ["reference"])):
            raise  # a plain prompt fails too: the encoder's fault, not a request's
        raise RequestFailed(f"the {what} could not be encoded ({type(e).__name__}: {e})", tuple(bad),
                            what.replace(" ", "_")) from e


@dataclass
class Negatives:
    """Requests' own negative prompts, encoded: ``rows`` of the batch, their encoded inputs."""

    rows: list[int]
    encoded: EncodedPrompts


def encode_negatives(encoder: PromptEncoder, negatives: list[str | None] | None, ids: list[str]) -> Negatives | None:
    """The batch's own negative prompts (None where a request has none), encoded as prompts are;
    None when no request has one. Run before the batch's static layout is armed: these
    allocations are not in the stream the layout was solved for (the default negative's are)."""
    rows = [i for i, n in enumerate(negatives or []) if n is not None]
    if not rows:
        return None
    assert negatives is not None
    return Negatives(rows, _encode(encoder, [negatives[i] or "" for i in rows], [ids[i] for i in rows], "negative prompt"))


def encode_attributed(encoder: PromptEncoder, prompts: list[str], ids: list[str],
                      negatives: Negatives | None = None) -> EncodedPrompts:
    """``encoder.encode(prompts)``, a failure pinned on its requests (``RequestFailed``), with
    each request's own negative prompt (``encode_negatives``) copied over the model's default
    row in place (views only: no allocation the layout did not plan)."""
    out = _encode(encoder, prompts, ids, "prompt")
    if negatives is None:
        return out
    pairs = {k: f"negative_{k}" for k in out.inputs if k.startswith("prompt_") and f"negative_{k}" in out.inputs}
    if not pairs:
        raise RequestFailed("negative_prompt: this model runs no classifier-free guidance pass",
                            tuple(ids[i] for i in negatives.rows), "negative_prompt")
    for pos_key, neg_key in pairs.items():
        dst, src = out.inputs[neg_key], negatives.encoded.inputs[pos_key]
        for j, i in enumerate(negatives.rows):
            dst[i].copy_(src[j])
    out.seconds += negatives.encoded.seconds
    return out
