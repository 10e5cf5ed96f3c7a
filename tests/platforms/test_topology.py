from __future__ import annotations

import pytest

from xema_ray.platforms.topology import pair_order


def test_nvlink_pairs_become_aligned_ranks() -> None:
    # the A6000 box: bridges join GPUs (0,4), (1,5), (2,6), (3,7) in bundle order
    devs = [f"gpu{i}" for i in range(8)]
    links = {f"gpu{i}": {f"gpu{(i + 4) % 8}"} for i in range(8)}
    order = pair_order(devs, links)
    pairs = [(order[k], order[k + 1]) for k in range(0, 8, 2)]
    assert pairs == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_no_links_keep_bundle_order_and_odd_ones_go_last() -> None:
    assert pair_order(["a", "b", "c"], {}) == [0, 1, 2]
    assert pair_order(["a", "b", "c"], {"b": {"c"}, "c": {"b"}}) == [1, 2, 0]


def test_error_raised_if_device_ids_repeat() -> None:
    with pytest.raises(ValueError, match="distinct"):
        pair_order(["a", "a"], {})
