"""How to materialise a model (``BuildOptions``): device, dtypes, weights, where each weight and the
text encoder live. Read by every builder of ``xema_ray.models.base.ModelSpec``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from xema_ray.platforms.host_memory import SegmentHolder

#: where the text encoder runs: on the device for the whole request, streamed layer by layer
#: through the device during the set-up interval only, or on the host CPU; "none" = no encoder
#: (prompt embeddings are seeded stand-ins, docs/measured-facts.md, "Prompts")
TextEncoderPlacement = Literal["device", "streamed", "cpu"]


@dataclass(frozen=True)
class BuildOptions:
    """How to materialise a model.

    Attributes:
        device: "meta" for shape-only analysis, "cpu" or "cuda[:i]" for real execution.
        dtype: parameter dtype (bf16 for real models, fp32 for tiny CPU tests).
        weights_dir: a local diffusers directory to ``from_pretrained`` from; None = random weights
            (architecture, memory and latency are real, pictures are noise).
        seed: seed for random weights, so two workers build identical models (the values do
            not depend on placement: ``xema_ray.models.loading.SeededWeights``).
        host_modules: module paths (relative to the pipeline, e.g. ``transformer.transformer_blocks.3``)
            whose weights are homed on (pinned) host memory from the start: the device never
            holds them (the worker's residency, ``xema_ray.runtime.residency``).
    """

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    weights_dir: Path | None = None
    seed: int = 0
    host_modules: tuple[str, ...] = ()
    #: place weights tensor by tensor on meta too (the worker does, so ``xema verify`` counts each
    #: weight as it is placed); analysis registers a meta tree's weights itself and skips it
    place_on_meta: bool = False
    #: the text encoder: None = with real weights (a ``text_encoder`` folder in ``weights_dir``) on
    #: the device, else none; or a placement (random weights at the real config without a checkpoint)
    text_encoder: TextEncoderPlacement | Literal["none"] | None = None
    #: components kept in a dtype of their own, e.g. ``(("vae", torch.float32),)``: CogVideoX-5b's
    #: repository stores its VAE in fp32; kept so, it holds twice the bytes the trace must count.
    #: Every other component is built (and a checkpoint's tensors cast on load) in ``dtype``.
    component_dtypes: tuple[tuple[str, torch.dtype], ...] = ()
    #: keep host-homed weights in the node's shared segment for them (one copy for every worker of
    #: this model, weights and residency on the node: ``xema_ray.platforms.host_memory``); False:
    #: this worker's own exact-size buffer
    share_host: bool = False
    #: the Serve application the worker serves: its shared segments are that app's (two apps on a
    #: node never share or sweep each other's); ``host_memory.DEFAULT_APP`` outside Serve
    app: str = "default"
    #: keep every weight of the model in the node's shared segment (its *host copy*), device-homed
    #: ones too, copied to the device from it: a later worker of the node (a new replica, a group
    #: waking from zero) maps it instead of reading the checkpoint (implies ``share_host``)
    host_copy: bool = False
    #: the node-level process that keeps the host copy after the last worker (None: the workers)
    host_holder: SegmentHolder | None = None
    #: called with (component, module path, module) as soon as a module's own tensors are placed:
    #: the worker quantizes the transformer's layers as they arrive, so the device never holds
    #: more than one layer in the model's dtype beside the quantized ones (``runtime.worker``)
    placed: Callable[[str, str, nn.Module], None] | None = None

    def dtype_for(self, component: str) -> torch.dtype:
        """The dtype ``component`` (a pipeline attribute: "vae", "text_encoder", ...) is built in."""
        return dict(self.component_dtypes).get(component, self.dtype)

    def encoder_placement(self) -> TextEncoderPlacement | None:
        """The encoder placement these options ask for (None: no encoder)."""
        if self.text_encoder == "none":
            return None
        if self.text_encoder is not None:
            return self.text_encoder
        has = self.weights_dir is not None and (Path(self.weights_dir) / "text_encoder").is_dir()
        return "device" if has else None
