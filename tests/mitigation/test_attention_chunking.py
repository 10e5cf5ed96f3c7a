"""Attention chunking (DiT chunking's ``attention`` part): exact on the three tiny models, really
chunks (query slices reach the attention kernel), and lowers the traced peak of a chunked block.

Tolerance: ``CHUNK_ATOL`` = 1e-4 on pixels in [0, 1] (observed ~1e-6): a query slice runs the
projections and the attention over fewer rows, which may pick a different kernel blocking than
the whole sequence, so the last bits can differ; each query row's softmax reads the same keys.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.mitigation.conftest import TINY_MODELS, run_pipeline, tiny_template
from xema_ray.memory.analysis import phase_peaks
from xema_ray.vocabulary import phase_of_trace
from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.mitigation.dit_chunking import DitChunkingConfig, QueryChunkedCogVideoXProcessor, apply_dit_chunking
from xema_ray.models import BuildOptions, get_model_spec

CHUNK_ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("no_onednn")  # same kernel per sample (tests/mitigation/conftest.py)


@pytest.mark.parametrize("model", TINY_MODELS)
@pytest.mark.parametrize("chunks", [3, 8])
def test_attention_chunking_is_lossless_and_cuts_the_queries(pipelines: dict[str, Any], model: str, chunks: int) -> None:
    pipe = pipelines[model]
    spec = get_model_spec(model)
    reference = run_pipeline(pipe, model)
    blocks = spec.dit_blocks(pipe.transformer)
    query_rows: list[int] = []
    original = F.scaled_dot_product_attention
    in_dit = [False]  # count the transformer's attention calls only (the VAE has its own)

    def counting(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if in_dit[0]:
            query_rows.append(query.shape[-2])
        return original(query, key, value, *args, **kwargs)

    hooks = [pipe.transformer.register_forward_pre_hook(lambda *_: in_dit.__setitem__(0, True)),
             pipe.transformer.register_forward_hook(lambda *_: in_dit.__setitem__(0, False))]
    F.scaled_dot_product_attention = counting  # type: ignore[assignment]
    try:
        unchunked_rows = (run_pipeline(pipe, model), list(query_rows))[1]
        query_rows.clear()
        handle = apply_dit_chunking(blocks, DitChunkingConfig(blocks=tuple(range(len(blocks))), chunks=chunks,
                                                              parts=("attention",)))
        try:
            chunked = run_pipeline(pipe, model)
        finally:
            handle.remove()
    finally:
        F.scaled_dot_product_attention = original  # type: ignore[assignment]
        for h in hooks:
            h.remove()
    assert (chunked - reference).abs().max().item() <= CHUNK_ATOL
    # every attention call of a chosen block ran on at most ceil(rows / chunks) query rows
    assert max(query_rows) <= -(-max(unchunked_rows) // chunks)
    assert len(query_rows) > len(unchunked_rows)
    # removing it restores the pipeline (processors and the attention function)
    assert F.scaled_dot_product_attention is original
    assert not any(isinstance(getattr(m, "processor", None), QueryChunkedCogVideoXProcessor) for m in pipe.transformer.modules())
    assert torch.equal(run_pipeline(pipe, model), reference)


def _traced_dit_peak(parts: tuple[str, ...]) -> int:
    """DiT peak of tiny CogVideoX traced on meta with every block chunked ×4 over ``parts``."""
    spec = get_model_spec("tiny-cogvideox")
    t = tiny_template("tiny-cogvideox")
    pipe = spec.build_pipeline(BuildOptions(device="meta", dtype=torch.float32))
    blocks = spec.dit_blocks(pipe.transformer)
    handle = apply_dit_chunking(blocks, DitChunkingConfig(blocks=tuple(range(len(blocks))), chunks=4, parts=parts))  # type: ignore[arg-type]
    try:
        trace = trace_template(t, TraceOptions(device="meta", dtype=torch.float32), pipeline=pipe)
    finally:
        handle.remove()
    return max(p.peak_bytes for p in phase_peaks(trace) if phase_of_trace(p.phase) == "denoise")


def test_attention_chunking_lowers_the_traced_dit_peak() -> None:
    # the query-chunked CogVideoX attention never holds the whole-sequence query and attention
    # output; everything else chunked the same, the DiT peak must fall
    without = _traced_dit_peak(("ff", "qk_norm", "rotary"))
    with_attention = _traced_dit_peak(("ff", "qk_norm", "rotary", "attention"))
    assert with_attention < without
