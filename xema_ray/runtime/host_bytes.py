"""What one worker's weights hold on the host for a plan, from the loader's own packing.

``worker_host_bytes`` lays out the host-homed tensors the way the loader will
(``xema_ray.models.host_pack.plan_pack`` over the meta-built components: the same slots, the same
exact buffer sizes), so the planner and serving's start-up check count what a worker then holds
(the tests compare it with a load on meta). ``before_host_bytes`` is the same residency as the
loader before exact buffers held it: every pinned tensor rounded up to a power of two by torch's
pinned allocator, nothing shared, and a checkpoint's text encoder read whole onto the CPU first.

Example:
    >>> from xema_ray.models import get_model_spec
    >>> spec = get_model_spec("tiny-flux2")
    >>> h = worker_host_bytes(spec, Residency(host_blocks=(0,)), "device", share=True)
    >>> h.resident_bytes == h.shared_bytes == h.pinned_bytes > 0
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

import torch
from torch import nn

from xema_ray.host_budget import GroupHost, HostBytes, host_basis
from xema_ray.models import ModelSpec, get_model_spec
from xema_ray.models.host_pack import HostPack, plan_pack
from xema_ray.placement import WeightHome
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime.residency import Residency, block_paths


def _dtype(spec: ModelSpec) -> torch.dtype:
    return torch.bfloat16 if spec.size == "real" else torch.float32


@cache
def _transformer(model: str) -> nn.Module:
    from xema_ray.models.loading import build_on_meta

    spec = get_model_spec(model)
    return build_on_meta(spec.transformer_class(), spec.transformer_config, _dtype(spec), real_buffers=False)


@cache
def _encoder(model: str) -> nn.Module | None:
    from xema_ray.models.text_encoders import build_encoder_on_meta

    spec = get_model_spec(model)
    return None if spec.text_encoder is None else build_encoder_on_meta(spec.text_encoder, _dtype(spec), real_buffers=False)


def _under(prefixes: tuple[str, ...]):  # type: ignore[no-untyped-def]
    def home_of(path: str) -> WeightHome:
        host = any(p == "" or path == p or path.startswith(p + ".") for p in prefixes)
        return WeightHome.HOST if host else WeightHome.DEVICE
    return home_of


@cache
def _packs(model: str, host_blocks: tuple[int, ...], encoder: str | None,
           expert_blocks: int = 0) -> tuple[HostPack, HostPack, HostPack, int]:
    """(the DiT's host pack, the second expert's, the encoder's, the largest module's own bytes:
    the load's transient bound). A two-expert model's experts share one architecture, so the
    second expert's pack is the first's laid out for its ``expert_blocks`` leading blocks."""
    spec = get_model_spec(model)
    paths = block_paths(spec)
    homed = sorted({*host_blocks, *range(expert_blocks)})
    dit = plan_pack(_transformer(model), _dtype(spec), _under(tuple(paths[i] for i in homed)))
    second = (plan_pack(_transformer(model), _dtype(spec), _under(tuple(paths[:expert_blocks])))
              if expert_blocks else HostPack())
    enc_tree = _encoder(model)
    enc = HostPack()
    if enc_tree is not None and encoder in ("streamed", "cpu") and spec.text_encoder is not None:
        prefixes = spec.text_encoder.streamed_host_modules() if encoder == "streamed" else ("",)
        enc = plan_pack(enc_tree, _dtype(spec), _under(prefixes))
    trees = [_transformer(model)] + ([enc_tree] if enc_tree is not None and encoder is not None else [])
    largest = max(sum(t.numel() * t.element_size() for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
                  for tree in trees for m in tree.modules())
    return dit, second, enc, largest


def worker_host_bytes(spec: ModelSpec, residency: Residency, encoder: str | None, share: bool = True) -> HostBytes:
    """One worker's host memory with ``residency``'s DiT blocks (and both experts' switch blocks)
    and its text encoder placed at ``encoder`` (device, streamed, cpu, or None for none);
    ``share``: in the node's segments."""
    dit_pack, second, enc, largest = _packs(spec.name, residency.host_blocks, encoder, residency.expert_blocks)
    dit = dit_pack.nbytes + second.nbytes
    pinned_enc = enc.nbytes if encoder == "streamed" else 0
    resident = dit + enc.nbytes
    return HostBytes(resident_bytes=resident, pinned_bytes=dit + pinned_enc,
                     shared_bytes=resident if share else 0, shared_pinned_bytes=dit + pinned_enc if share else 0,
                     transient_bytes=largest if resident or encoder else 0)


def before_host_bytes(spec: ModelSpec, residency: Residency, encoder: str | None, from_checkpoint: bool = True) -> HostBytes:
    """The same residency as the loader held it before exact buffers (for comparison): pinned
    tensors one by one (power-of-two blocks), nothing shared, and with a checkpoint the whole
    text encoder read onto the CPU by ``from_pretrained`` before it was placed on the device or
    pinned (the CPU copy was dropped only once every tensor was placed)."""
    dit_pack, second, enc, largest = _packs(spec.name, residency.host_blocks, encoder, residency.expert_blocks)
    dit_pow2 = dit_pack.pow2_bytes + second.pow2_bytes
    enc_pinned = enc.pow2_bytes if encoder == "streamed" else 0
    enc_resident = enc_pinned if encoder == "streamed" else enc.tensor_bytes
    whole_encoder = 0  # a CPU-placed encoder computed on from_pretrained's own tensors: no second copy
    if from_checkpoint and encoder in ("device", "streamed") and _encoder(spec.name) is not None:
        whole_encoder = sum(t.numel() * t.element_size() for t in _encoder(spec.name).parameters())  # type: ignore[union-attr]
    return HostBytes(resident_bytes=dit_pow2 + enc_resident, pinned_bytes=dit_pow2 + enc_pinned,
                     transient_bytes=whole_encoder + largest)


def config_host_bytes(config: ExecutionConfig, share: bool = True, residency: Residency | None = None) -> HostBytes:
    """The host memory of one worker serving a plan entry: every pass that pins counted (its
    offloaded / HSDP blocks, both experts' switch blocks, its text encoder streamed or on the CPU).
    ``residency``: the group's shared one in place of the entry's own. The planner's host pass,
    its table, ``xema serve``'s start-up check and ``xema verify``'s planned figure all count it
    here, as the worker's loader will place it."""
    return worker_host_bytes(config.template.spec, residency or Residency.of_config(config), config.text_encoder, share)


def group_worker_host_bytes(configs: Iterable[ExecutionConfig], shared: bool, share: bool = True) -> HostBytes | None:
    """One worker of a model group serving ``configs``: the largest ``config_host_bytes`` of any of
    their residencies (the union of them where the group's residency is ``shared``) with any of
    their encoder placements (the worker loads one encoder placement for all of them); None for
    no config."""
    configs = list(configs)
    residencies = [Residency.of_config(c) for c in configs]
    if shared:
        residencies = [Residency.union(residencies)]
    worker: HostBytes | None = None
    for r in residencies:
        for c in configs:
            h = config_host_bytes(c, share, r)
            worker = h if worker is None else worker.max(h)
    return worker


def group_host(model: str, configs: Iterable[ExecutionConfig], workers: int, shared: bool,
               share: bool = True) -> GroupHost:
    """A model group's workers on the node (``group_worker_host_bytes``), with the basis of its
    figure (``host_basis``) recorded beside it."""
    configs = list(configs)
    worker = group_worker_host_bytes(configs, shared, share)
    if worker is None:
        raise ValueError(f"{model}: no plan to count host memory for")
    return GroupHost(model=model, workers=workers, worker=worker,
                     basis=host_basis((c.config_hash() for c in configs), shared, share))


@cache
def model_weight_bytes(model: str) -> int:
    """Every weight of ``model`` (its transformer, VAE and text encoder) in the dtype a worker loads
    it in: the size of its host copy (``xema_ray.models.loading.materialize(host_copy=True)``)."""
    from xema_ray.models.loading import build_on_meta

    spec = get_model_spec(model)
    vae = build_on_meta(spec.vae_class(), spec.vae_config, _dtype(spec), real_buffers=False)
    trees = [t for t in (_transformer(model), vae, _encoder(model)) if t is not None]
    return sum(t.numel() * (_dtype(spec).itemsize if t.is_floating_point() else t.element_size())
               for tree in trees for t in [*tree.parameters(), *tree.buffers()])
