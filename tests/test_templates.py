from __future__ import annotations

import pytest
from pydantic import ValidationError

from xema_ray.templates import PAPER_RESOLUTION_MAP, RequestTemplate, named_templates, paper_templates


def test_paper_templates_are_those_enumerated_in_section_9() -> None:
    # §9.1 says "21 request templates" but enumerates 6 + 3x3 + 3x3 = 24; we serve all 24
    ts = paper_templates()
    assert len(ts) == 24
    by_model = {m: [t for t in ts if t.model == m] for m in ("flux2", "cogvideox-5b", "ltx2")}
    assert [t.width for t in by_model["flux2"]] == [256, 512, 768, 1024, 1280, 2048]
    assert len(by_model["cogvideox-5b"]) == 9 and len(by_model["ltx2"]) == 9
    assert {t.frames for t in by_model["ltx2"]} == {49, 65, 81}
    assert len({t.key for t in ts}) == 24


def test_paper_resolution_mapping_is_documented_and_valid() -> None:
    for r in PAPER_RESOLUTION_MAP:
        if (r.width, r.height) != (r.paper_width, r.paper_height):
            assert r.reason, f"{r.model} {r.name} changes size without a reason"
        frames = 1 if r.model == "flux2" else 49
        RequestTemplate(model=r.model, height=r.height, width=r.width, frames=frames)


def test_latent_shapes_and_tokens() -> None:
    cog = RequestTemplate(model="cogvideox-5b", height=720, width=1280, frames=49)
    assert cog.latent_shape() == (1, 13, 16, 90, 160)
    assert cog.token_counts() == {"video": 13 * 45 * 80, "text": 226}
    flux = RequestTemplate(model="flux2", height=1024, width=1024, batch=2)
    assert flux.latent_shape() == (2, 4096, 128)
    assert flux.token_counts()["image"] == 4096


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"model": "cogvideox-5b", "height": 1080, "width": 1920, "frames": 49}, "multiples of 16"),
        ({"model": "cogvideox-5b", "height": 720, "width": 1280, "frames": 50}, r"1 \+ a multiple of 4"),
        ({"model": "flux2", "height": 1000, "width": 1024}, "multiples of 16"),
        ({"model": "flux2", "height": 1024, "width": 1024, "frames": 5}, "image model"),
        ({"model": "nope", "height": 64, "width": 64}, "unknown model"),
    ],
)
def test_error_raised_if_template_is_invalid(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        RequestTemplate(**kwargs)


def test_error_raised_if_steps_or_batch_out_of_range() -> None:
    with pytest.raises(ValidationError):
        RequestTemplate(model="tiny-flux2", height=64, width=64, steps=0)
    with pytest.raises(ValidationError):
        RequestTemplate(model="tiny-flux2", height=64, width=64, batch=0)


def test_with_revalidates() -> None:
    t = RequestTemplate(model="tiny-flux2", height=64, width=64)
    assert t.with_(steps=3).steps == 3
    with pytest.raises(ValidationError):
        t.with_(height=65)


def test_named_sets() -> None:
    assert len(named_templates("paper")) == 24
    assert all(t.steps == 2 for t in named_templates("tiny", steps=2))
    with pytest.raises(ValueError, match="known"):
        named_templates("huge")


def test_latent_length_is_the_image_or_video_token_count() -> None:
    flux = RequestTemplate(model="flux2", height=1024, width=1024, batch=3)
    assert flux.latent_length == (1024 // 16) ** 2  # per request: the batch does not count
    cog = RequestTemplate(model="cogvideox-5b", height=480, width=720, frames=49)
    assert cog.latent_length == 13 * (480 // 16) * (720 // 16)  # 13 latent frames, 2×2 patches of /8
    ltx = RequestTemplate(model="ltx2", height=480, width=864, frames=49)
    assert ltx.latent_length == ltx.token_counts()["video"] < ltx.with_(height=704, width=1280).latent_length
