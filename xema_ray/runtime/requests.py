"""What one request is on its way into a batch and out of it: the typed request a worker
executes (``GenerationRequest``) and its encoded result (``RequestOutput``).

Pydantic only, no torch: the Router, the model group and the messages between them
(``xema_ray.serving.messages``) speak these in processes that never run a model, so importing
them costs a fraction of a second (``xema_ray.runtime.engine`` re-exports both).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.lora_pool import LoraUse

#: CogVideoX's published sampling frame rate (the diffusers examples export at 8 fps); models
#: that know their own rate (LTX-2's ``frame_rate``) use that.
DEFAULT_VIDEO_FPS = 8.0


class GenerationRequest(BaseModel):
    """One client request inside a batch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str = Field(min_length=1, description="caller's id, echoed in the output")
    prompt: str = Field(description="text prompt")
    seed: int = Field(ge=0, lt=2**63, description="noise seed; same seed, same bytes")
    references: tuple[bytes, ...] = Field(default=(), repr=False, description="its own reference images (PNG)")
    lora: tuple[LoraUse, ...] = Field(default=(), description="LoRA adapters stacked on it, with scales (xema_ray.lora)")
    negative_prompt: str | None = Field(default=None, description="None: the model's default negative prompt "
                                        "(only models that run classifier-free guidance are sent one)")


class RequestOutput(BaseModel):
    """The encoded result of one request."""

    model_config = ConfigDict(frozen=True, ser_json_bytes="base64", val_json_bytes="base64")

    request_id: str
    seed: int
    media_type: Literal["image/png", "video/mp4"]
    data: bytes = Field(repr=False)
    width: int
    height: int
    frames: int
    audio_wav: bytes | None = Field(default=None, repr=False, description="LTX-2's sound track")
    prompt_tokens: int | None = Field(default=None, description="tokens of the prompt (None: no text encoder)")
    prompt_truncated: bool = Field(default=False, description="the prompt was cut to the encoder's token limit")
    emulated: bool = Field(default=False, description="made by an emulated worker: no model ran (xema_ray.runtime.emulated)")
