"""A layout solved for a template's first steps and repeated for the rest is the full stream's
layout: the same allocations, valid, replayed with no miss; smaller on disk; version-checked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from xema_ray.allocator import step_repeat
from xema_ray.allocator.layout_replay import replay
from xema_ray.allocator.solver import StaticLayout
from xema_ray.plan import ExecutionConfig, Mitigation
from xema_ray.allocator.artifact import LayoutMismatch, load_artifact, save_artifact
from xema_ray.measure.layout_solve import solve_entry_layout
from xema_ray.measure.verify import worker_trace
from xema_ray.templates import RequestTemplate

# LTX-2's latents outlive their step by two events: the layout repeats every two steps
CFG = ExecutionConfig(template=RequestTemplate(model="tiny-ltx2", height=64, width=64, frames=9, steps=13),
                      text_encoder="streamed", mitigations=(
                          Mitigation(kind="temporary_serialization", modules=("transformer",), intensity=2),
                          Mitigation(kind="block_offload", blocks=(0, 1), intensity=2)))


@pytest.fixture(scope="module")
def solved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    folder = tmp_path_factory.mktemp("layouts")
    art = solve_entry_layout(CFG, gpu="NVIDIA RTX A6000")
    save_artifact(art, folder)
    return folder, art.layout_id


def test_repeated_layout_is_the_full_streams_and_replays_with_no_miss(solved: tuple[Path, str]) -> None:
    folder, ref = solved
    art = load_artifact(folder, ref, gpu="NVIDIA RTX A6000")  # hash, version, validity checked
    assert art.step_repeat is not None and art.repeat_note == ""
    assert art.step_repeat.solved_steps == 7  # odd template: one step more than the two windows
    full = art.solved()
    stream = worker_trace(CFG)
    order = np.argsort(stream.begin, kind="stable")
    assert np.array_equal(full.size, stream.size[order]) and np.array_equal(full.begin, stream.begin[order])
    assert np.array_equal(full.end, stream.end[order])
    full.verify()  # the whole layout, not only the window the loader checks
    report = replay(full, stream)
    assert report.misses == 0 and report.hits == len(stream)
    assert art.reserved_bytes <= 1.02 * art.lower_bound_bytes
    assert len(art.layout.size) < 0.7 * len(stream)


def test_a_window_overlap_is_found_and_a_version_1_file_is_refused(solved: tuple[Path, str], tmp_path: Path) -> None:
    folder, ref = solved
    doc = json.loads((folder / f"{ref}.json").read_text())
    art = load_artifact(folder, ref)
    short = StaticLayout.from_file(art.layout)
    assert art.step_repeat is not None
    # every offset of the repeated window at 0: its rows then overlap each other
    rep = art.step_repeat
    inside = (short.begin >= rep.pattern_begin) & (short.begin < rep.pattern_begin + rep.pattern_events)
    short.offset[inside] = 0
    with pytest.raises(ValueError, match="overlap"):
        step_repeat.verify(short, rep)
    doc["version"] = 1
    (tmp_path / f"{ref}.json").write_text(json.dumps(doc))
    with pytest.raises(LayoutMismatch, match="layout file version 1, this build reads 2"):
        load_artifact(tmp_path, ref)
