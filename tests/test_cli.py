from __future__ import annotations

import json

from xema_ray.cli import main


def test_analyze_writes_summary_json_and_plot(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out_json, out_png = tmp_path / "t.json", tmp_path / "t.png"
    rc = main(["analyze", "--model", "tiny-cogvideox", "--height", "64", "--width", "64", "--frames", "9",
               "--steps", "4", "--budget", "15MB", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "peak (active)" in text and "pressure interval" in text
    data = json.loads(out_json.read_text())
    assert data["summary"]["budget_bytes"] == 15 * 10**6
    assert data["summary"]["pressure_intervals"]
    assert data["trace"]["schema_version"] == 1
    assert out_png.stat().st_size > 10_000


def test_error_raised_if_analyze_gets_invalid_template(capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(["analyze", "--model", "tiny-flux2", "--height", "65", "--width", "64"])
    assert rc == 2
    assert "multiples of 16" in capsys.readouterr().err


def test_error_raised_if_budget_unreadable(capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(["analyze", "--model", "tiny-flux2", "--height", "64", "--width", "64", "--budget", "big"])
    assert rc == 2
    assert "48GB" in capsys.readouterr().err


def test_analyze_layout_compares_allocators(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    png = tmp_path / "t.png"
    rc = main(["analyze", "--model", "tiny-flux2", "--height", "64", "--width", "64", "--steps", "3",
               "--layout", "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "static layout" in text and "caching allocator" in text
    assert (tmp_path / "t.layout.png").stat().st_size > 10_000
