"""Memoised meta kernels are exact: a memoised trace equals an unmemoised one event for event,
and everything the memo cannot stand for (aliasing outputs, metadata-changing in-place ops,
scalar types) runs the real kernel."""

from __future__ import annotations

import pytest
import torch

from tests.analyzer.trace_equality import TEMPLATES, columns_equal
from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.analyzer.meta_memo import MetaKernelMemo
from xema_ray.templates import RequestTemplate


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.key)
def test_memoised_trace_equals_unmemoised(template: RequestTemplate) -> None:
    fast = trace_template(template)
    slow = trace_template(template, TraceOptions(memoise=False))
    columns_equal(fast, slow)
    hits, misses = (int(x.split()[0]) for x in fast.meta["meta_kernel_memo"].split(" / "))
    assert hits > misses  # repeated blocks and steps really reuse kernel results


def _call(memo: MetaKernelMemo, op: torch._ops.OpOverload, *args: object) -> torch.Tensor:
    return memo.call(op, args, {})


def test_outputs_sharing_an_input_storage_are_not_memoised() -> None:
    # _unsafe_view declares no alias yet returns the input's storage: a memoised call would
    # invent a fresh allocation
    memo = MetaKernelMemo()
    x = torch.empty(4, 6, device="meta")
    for _ in range(2):
        y = _call(memo, torch.ops.aten._unsafe_view.default, x, [24])
        assert y.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert memo.hits == 0


def test_in_place_ops_return_their_argument_and_resize_always_runs() -> None:
    memo = MetaKernelMemo()
    a, b = torch.empty(3, 5, device="meta"), torch.empty(5, device="meta")
    for _ in range(2):
        assert _call(memo, torch.ops.aten.add_.Tensor, a, b) is a
    assert memo.hits == 1
    with pytest.raises(RuntimeError):  # a memoised in-place op must still reject bad shapes
        _call(memo, torch.ops.aten.add_.Tensor, a, torch.empty(4, device="meta"))
    for n in (7, 9):  # resize_ changes its argument: never replayed
        r = torch.empty(2, device="meta")
        assert _call(memo, torch.ops.aten.resize_.default, r, [n]).shape == (n,)


def test_python_scalar_types_are_part_of_the_key() -> None:
    memo = MetaKernelMemo()
    x = torch.empty(3, dtype=torch.int64, device="meta")
    assert _call(memo, torch.ops.aten.mul.Scalar, x, 2).dtype == torch.int64
    assert _call(memo, torch.ops.aten.mul.Scalar, x, 2.0).dtype == torch.float32
    assert _call(memo, torch.ops.aten.mul.Scalar, x, True).dtype == torch.int64


def test_memoised_outputs_have_the_kernels_strides() -> None:
    memo = MetaKernelMemo()
    x = torch.empty(2, 3, 4, 5, device="meta").to(memory_format=torch.channels_last)
    first = _call(memo, torch.ops.aten.relu.default, x)
    again = _call(memo, torch.ops.aten.relu.default, x)
    assert memo.hits == 1
    assert again.stride() == first.stride() and again.shape == first.shape and again.dtype == first.dtype
    assert again.untyped_storage()._cdata != first.untyped_storage()._cdata  # a fresh allocation
