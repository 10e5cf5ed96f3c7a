"""What a VAE chunking action names: module paths or chains ``PARENT[START:]``, and the band count."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

#: ``PARENT[START:]``: a chain from START to the end of PARENT's forward
CHAIN_RE = re.compile(r"^(?P<parent>[A-Za-z0-9_.]+)\[(?P<start>[A-Za-z0-9_.]+):\]$")


class VaeChunkingConfig(BaseModel):
    """Which decoder modules run in bands, and how many."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    modules: tuple[str, ...] = Field(
        description="pipeline paths: an up-block (its resnets and upsamplers are chunked one by one), any "
        "spatially local module (e.g. 'vae.decoder.conv_out'), or a chain 'PARENT[START:]' (e.g. "
        "'vae.decoder[up_blocks.2:]': START and everything PARENT runs after it, banded as one)"
    )
    chunks: int = Field(ge=1, description="horizontal bands")
    halo: int | None = Field(
        default=None, ge=0,
        description="context rows per side (input rows of the unit or chain); None = the receptive radius",
    )


def parse_chain(path: str) -> tuple[str, str] | None:
    """``(parent, start)`` for a chain path ``PARENT[START:]``, None for a plain module path."""
    m = CHAIN_RE.match(path)
    return (m.group("parent"), m.group("start")) if m else None
