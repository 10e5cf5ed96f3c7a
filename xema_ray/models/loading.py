"""Placing weights where the plan says, one module at a time (never whole-then-move).

A component (transformer, VAE, ...) is first built on the meta device from its config: that
costs no memory and gives every parameter's name, shape and dtype. Then each module's own
parameters and buffers are materialised straight at their *home*:

- ``device``: on the compute device (what a model loaded whole would hold);
- ``host``: off the device, on (pinned, on CUDA) host memory: blocks that block offload
  streams through the device during the DiT;

so the device never holds a weight the residency keeps off it, not even while loading. On
the meta device (``xema verify``) nothing is allocated for host homes and device homes are
meta tensors, which the allocation tracer counts exactly as a GPU would allocate them.

Values come from a ``WeightSource``:

- ``SeededWeights(seed)``: random weights, generated per module on the CPU from a generator
  seeded by (seed, module path), so they do not depend on where the module is placed or on the
  order modules are loaded in: two workers, or one worker under two residencies, hold the same
  weights bit for bit. Modules with ``reset_parameters`` use it (the library's own init); other
  tensors get a documented fallback (1-D ``*weight``/``*scale``/``*std`` ones, other 1-D
  zeros, matrices N(0, 1/fan_in)); modules with a tensor over 2^24 elements (real sizes only) get
  a seeded 2^20-element uniform pattern repeated, so building 55 B random parameters takes
  seconds, not minutes; that pattern is drawn on the CPU and repeated where the tensor lives
  (on the GPU for device homes: the same bytes, no host copy, no host-to-device transfer).
- ``CheckpointWeights(dir, subfolder)``: a local diffusers directory
  (``diffusion_pytorch_model*.safetensors``, sharded or not), read tensor by tensor with
  ``safetensors.safe_open``; a missing tensor, an unexpected one or a shape mismatch is an
  error naming the file and what was expected.
"""

from __future__ import annotations

import hashlib
import time
from abc import ABC, abstractmethod
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from xema_ray.models.meta_build import build_on_meta, no_init_on_meta, parameters_on_meta  # noqa: F401 (read from here too)
from xema_ray.placement import COMPUTE_DEVICE_ATTR, PlacementReport, WeightHome, placeholder
from xema_ray.platforms.host_memory import DEFAULT_APP

if TYPE_CHECKING:
    from xema_ray.models.host_pack import HostSlot
    from xema_ray.platforms.host_memory import HostBuffer, SegmentHolder


class CheckpointError(ValueError):
    """A diffusers directory does not hold what the model's config needs."""


# ---------------------------------------------------------------------------- sources
class WeightSource(ABC):
    """Gives a module's own tensors their values (on the CPU)."""

    #: anonymous host bytes the last ``values`` call allocated (values read from a memory-mapped
    #: file are page cache, not counted); the loader keeps the largest as the load's transient
    transient_bytes: int = 0

    @abstractmethod
    def values(self, path: str, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``name -> CPU tensor`` for ``module``'s direct parameters and buffers (``path`` is
        the module's dotted path in its component)."""

    def identity(self) -> str:
        """What names these values (a shared host segment's key includes it)."""
        return f"{type(self).__name__}:{id(self)}"  # unshareable unless a source says more

    def mark_used(self, path: str, names: list[str]) -> None:
        """``module``'s tensors were placed without reading them (a shared host segment another
        worker filled already holds them)."""

    def finish(self) -> None:
        """Called once every module was placed (checks nothing was left unused)."""


def _seed_for(seed: int, component: str, path: str) -> int:
    digest = hashlib.sha256(f"{seed}\x00{component}\x00{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


#: tensors above this many elements get a tiled random pattern (see ``_tiled_init``)
TILE_THRESHOLD = 2**24
_TILE = 2**20


def _tiled_init(name: str, t: torch.Tensor, gen: torch.Generator) -> None:
    """A real-size tensor (a 131072 x 5120 embedding, a 5120 x 32768 MLP) filled with a seeded
    2^20-element pattern repeated: as deterministic and placement-independent as the rest, at
    memory speed instead of the CPU generator's (minutes for 55 B parameters). The pattern is
    always drawn on the CPU (same bytes on every device); ``t`` may live anywhere (a CUDA
    tensor is filled there: no host copy of the whole tensor, no host-to-device transfer)."""
    if t.dim() <= 1 or not t.is_floating_point():
        _fallback_init(name, t, gen)
        return
    bound = t.shape[-1] ** -0.5
    base = torch.empty(_TILE, dtype=t.dtype).uniform_(-bound, bound, generator=gen)
    _fill_tiled(t, base.to(t.device))


def _fill_tiled(t: torch.Tensor, base: torch.Tensor) -> None:
    """``t`` (contiguous) = ``base`` repeated, the last repeat cut short: one copy kernel."""
    flat = t.view(-1)
    whole = flat.numel() // _TILE
    if whole:
        flat[: whole * _TILE].view(whole, _TILE).copy_(base.expand(whole, _TILE))
    rest = flat.numel() - whole * _TILE
    if rest:
        flat[whole * _TILE :].copy_(base[:rest])


def _fallback_init(name: str, t: torch.Tensor, gen: torch.Generator) -> None:
    if t.dim() <= 1:
        leaf = name.rsplit(".", 1)[-1].lower()
        t.fill_(1.0 if any(k in leaf for k in ("weight", "scale", "std")) else 0.0)
    elif t.is_floating_point():
        fan_in = t.shape[-1]
        t.normal_(0.0, fan_in ** -0.5, generator=gen)
    else:
        t.zero_()


@dataclass
class SeededWeights(WeightSource):
    """Random weights that do not depend on placement or load order (see the module docstring)."""

    seed: int
    component: str

    def values(self, path: str, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return self.placed_values(path, module, dtype, torch.device("cpu"))

    def identity(self) -> str:
        return f"seeded:{self.seed}:{self.component}"

    def placed_values(self, path: str, module: nn.Module, dtype: torch.dtype, device: torch.device,
                      pin: bool = False, dest: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """``values``, with the tiled (real-size) tensors allocated and filled at ``device``
        (pinned host memory with ``pin``), or filled in place in ``dest`` (their slots in a
        host buffer), instead of on the CPU: the same bytes (the pattern is drawn on the CPU from
        the same generator), without writing 64 GB on the host and copying it over. Smaller
        tensors come back on the CPU; the caller moves them."""
        self.transient_bytes = 0
        own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        if not any(t.is_meta for t in own.values()):
            return {}  # buffers computed by the constructor keep their values
        gen = torch.Generator(device="cpu").manual_seed(_seed_for(self.seed, self.component, path))
        if any(t.numel() > TILE_THRESHOLD for t in own.values()):
            tiled: dict[str, torch.Tensor] = {}
            for n, t in own.items():
                big = t.dim() > 1 and t.is_floating_point()
                if big and dest is not None and n in dest:
                    tiled[n] = dest[n]
                else:
                    tiled[n] = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                                           device=device if big else "cpu", pin_memory=pin and big)
                    if tiled[n].device.type == "cpu":
                        self.transient_bytes += tiled[n].numel() * tiled[n].element_size()
                _tiled_init(n, tiled[n], gen)
            return {n: t for n, t in tiled.items() if own[n].is_meta}
        # a CPU twin of the module's own tensors, initialised by its own reset_parameters where it has one
        out = {n: torch.empty(t.shape, dtype=t.dtype if not t.is_floating_point() else dtype) for n, t in own.items()}
        self.transient_bytes = sum(t.numel() * t.element_size() for t in out.values())
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            twin = _cpu_twin(module, out)
            with torch.random.fork_rng(devices=[]):
                # the CPU generator alone (what the twin's reset draws from): ``torch.manual_seed`` also
                # seeds every lazily initialised accelerator, each call recording a stack trace
                # (a third of a tiny model's load)
                torch.default_generator.manual_seed(_seed_for(self.seed, self.component, path))
                try:
                    with torch.no_grad():
                        reset_fn = getattr(twin, "reset_parameters")
                        reset_fn()
                    return {n: _own_tensor(twin, n) for n in out if own[n].is_meta}
                except Exception:  # noqa: BLE001 — a reset that reaches into children: use the fallback
                    pass
        for n, t in out.items():
            _fallback_init(n, t, gen)
        return {n: t for n, t in out.items() if own[n].is_meta}


def _own_tensor(module: nn.Module, name: str) -> torch.Tensor:
    t = module._parameters.get(name)
    if t is None:
        t = module._buffers[name]
    return t.detach()


def _cpu_twin(module: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of ``module`` whose own tensors are ``tensors`` (children left out, so a
    ``reset_parameters`` touches only this module)."""
    twin = module.__class__.__new__(module.__class__)
    state = dict(module.__dict__)
    state["_parameters"] = {n: nn.Parameter(t, requires_grad=False) for n, t in tensors.items() if n in module._parameters}
    state["_buffers"] = {n: t for n, t in tensors.items() if n in module._buffers}
    state["_modules"] = {}
    object.__setattr__(twin, "__dict__", state)
    return twin


def _safetensors_files(directory: Path) -> dict[str, Path]:
    """``tensor name -> file`` for a diffusers component folder."""
    index = sorted(directory.glob("*.safetensors.index.json"))
    if index:
        weight_map = json.loads(index[0].read_text())["weight_map"]
        return {k: directory / v for k, v in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{directory}: no *.safetensors weights (expected diffusion_pytorch_model.safetensors or a sharded "
            "index, as save_pretrained writes)")
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for k in fh.keys():  # noqa: SIM118 — safe_open has no __iter__
                out[k] = f
    return out


@dataclass
class CheckpointWeights(WeightSource):
    """Tensors read one by one from a local component directory (diffusers or transformers),
    memory-mapped by safetensors: a tensor's pages are read as it is copied to its home, and no
    whole model is ever held on the CPU.

    Args:
        directory: the component folder.
        keys: the model's tensor name -> its name in the checkpoint, where they differ (a
            transformers checkpoint in its saved layout: ``checkpoint_keys``); a name not in it
            is its own.
        tied: the model's tensor name -> the tensor it is tied to (read from there when the
            checkpoint leaves it out, as transformers saves tied weights once).
    """

    directory: Path
    keys: dict[str, str] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    _used: set[str] = field(default_factory=set)
    _handles: dict[Path, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: missing component directory")
        self.files = _safetensors_files(self.directory)

    def identity(self) -> str:
        """The folder and its files' sizes and modification times (a rewritten checkpoint is another)."""
        stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(set(self.files.values()))]
        return f"checkpoint:{self.directory.resolve()}:{stats}"

    def _key(self, name: str) -> str:
        key = self.keys.get(name, name)
        if key not in self.files and name in self.tied:
            return self.keys.get(self.tied[name], self.tied[name])
        return key

    def mark_used(self, path: str, names: list[str]) -> None:
        for n in names:
            key = self._key(f"{path}.{n}" if path else n)
            if key in self.files:
                self._used.add(key)

    def _open(self, f: Path) -> Any:
        h = self._handles.get(f)
        if h is None:
            from safetensors import safe_open

            h = self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return h

    def values(self, path: str, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        out = {}
        self.transient_bytes = 0
        for n, meta in own.items():
            key = self._key(f"{path}.{n}" if path else n)
            f = self.files.get(key)
            if f is None:
                if n in module._buffers and n in getattr(module, "_non_persistent_buffers_set", set()):
                    continue  # not saved by save_pretrained; keeps its constructor value (none on meta)
                raise CheckpointError(
                    f"{self.directory}: tensor {key!r} {tuple(meta.shape)} is missing from the checkpoint")
            t = self._open(f).get_tensor(key)
            if tuple(t.shape) != tuple(meta.shape):
                raise CheckpointError(
                    f"{f}: tensor {key!r} has shape {tuple(t.shape)}, the model's config expects {tuple(meta.shape)}")
            if t.is_floating_point() != meta.is_floating_point():
                raise CheckpointError(f"{f}: tensor {key!r} is {t.dtype}, expected a {'floating' if meta.is_floating_point() else 'integer'} tensor")
            if t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)  # a copy (the mapped file's pages are not): the load's transient
                self.transient_bytes += t.numel() * t.element_size()
            out[n] = t
            self._used.add(key)
        return out

    def finish(self) -> None:
        self._handles.clear()
        unused = sorted(set(self.files) - self._used)
        if unused:
            raise CheckpointError(
                f"{self.directory}: {len(unused)} tensor(s) the model's config does not have, e.g. {unused[:3]} "
                "(a checkpoint of another model or config?)")


def checkpoint_dtype(directory: Path) -> torch.dtype | None:
    """The floating dtype most tensors of a component directory are stored in (None if empty)."""
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for f in sorted(set(_safetensors_files(directory).values())):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for k in fh.keys():  # noqa: SIM118
                dt = str(fh.get_slice(k).get_dtype())
                counts[dt] = counts.get(dt, 0) + 1
    if not counts:
        return None
    name = max(counts, key=counts.__getitem__)
    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(name)


# ---------------------------------------------------------------------------- placement
def _source_values(source: WeightSource, path: str, sub: nn.Module, dtype: torch.dtype, device: torch.device,
                   home: WeightHome, dest: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The source's values for one module; seeded real-size tensors are filled at their home
    (on the device, or in place in ``dest``: their slots in the host buffer)."""
    if isinstance(source, SeededWeights):
        if home is WeightHome.DEVICE:
            return source.placed_values(path, sub, dtype, device)
        return source.placed_values(path, sub, dtype, torch.device("cpu"), dest=dest)
    return source.values(path, sub, dtype)


def _modules_in_order(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    yield from root.named_modules(remove_duplicate=True)


@dataclass(frozen=True)
class HostShare:
    """What a component's host-homed weights are shared as: ``name`` (model and component; the
    segment's key adds the source's identity and the dtype) among the workers of the Serve
    application ``app`` on the node (``xema_ray.platforms.host_memory.SharedSegments``: two apps
    never share or sweep each other's segments)."""

    name: str
    app: str = DEFAULT_APP


def materialize(
    module: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    source: WeightSource,
    home_of: Callable[[str], WeightHome] = lambda _path: WeightHome.DEVICE,
    share: HostShare | None = None,
    pinned: bool | None = None,
    host_copy: bool = False,
    holder: SegmentHolder | None = None,
    placed: Callable[[str, nn.Module], None] | None = None,
) -> PlacementReport:
    """Give every tensor of a meta-built ``module`` its value at its home, one module at a time
    (``placed(path, module)`` told as each module's own tensors are placed).

    Host-homed tensors are views into one exact-size buffer (``xema_ray.models.host_pack``),
    page-locked on CUDA; with ``share`` it is the node's shared segment for these weights.

    Args:
        module: built on meta (``build_on_meta``).
        device: the compute device ("meta" = shape-only: nothing is read or generated).
        dtype: floating dtype of the weights.
        source: where values come from.
        home_of: module path -> home; a module's home covers its own tensors (children ask for theirs).
        share: what names these weights (model, component; the source adds its own identity and
            the dtype) and the Serve application whose workers on the node share their host copy
            (``HostShare``); None: this worker's own buffer.
        pinned: whether the host buffer is page-locked (default: on CUDA, and on meta, which
            stands for a GPU worker); False for a component that computes on the host CPU.
        host_copy: keep the whole component in the node's shared segment (the *host copy*, needs
            ``share``): device-homed tensors get slots in it too and reach the device by a copy
            from it (page-locked on CUDA). The first worker of the node fills it from ``source``;
            a later one (a new replica, a group waking from zero) maps it and reads nothing.
        holder: the node-level process a new shared segment belongs to: it stays after its last
            worker closes it, while the holder lives (None: this worker owns it, the last one out
            removes it).

    Returns:
        Bytes placed on the device and on the host (``PlacementReport``).
    """
    from xema_ray.models.host_pack import open_host_buffer, plan_pack, release_host_buffer

    if host_copy and share is None:
        raise ValueError("host_copy: the node's host copy is a shared segment; give the weights a share key")
    copy = host_copy and device.type != "meta"  # meta: the residency's own buffer stands for the worker
    pack = plan_pack(module, dtype, (lambda _path: WeightHome.HOST) if copy else home_of)
    pinned = device.type in ("cuda", "meta") if pinned is None else pinned
    key = None if share is None else pack.key(f"{share.name}|{'copy|' if copy else ''}{source.identity()}|{dtype}")
    buf = open_host_buffer(pack, device, key, share.app if share is not None else DEFAULT_APP, holder)
    if copy and buf is not None and pinned and device.type == "cuda":
        from xema_ray.platforms import get_platform

        buf.register(get_platform("cuda"))  # device-homed tensors are copied from it during the load
    placer = _Placer(device, dtype, source, buf, {(s.path, s.name): s for s in pack.slots}, copy)
    report = placer.report
    report.host_buffer_bytes = pack.nbytes
    report.host_pinned_bytes = pack.nbytes if pinned else 0
    report.host_pow2_bytes = pack.pow2_bytes if pinned else 0
    report.host_shared_bytes = pack.nbytes if key is not None else 0  # on meta too: it stands for a GPU worker
    report.host_attached_bytes = pack.nbytes if buf is not None and buf.filled else 0
    try:
        for path, sub in _modules_in_order(module):
            placer.place(path, sub, home_of)
            if placed is not None:
                placed(path, sub)
                placer.refresh(sub)  # a tensor ``placed`` replaced (quantized) is not kept alive here
    except BaseException:
        if buf is not None:
            release_host_buffer(buf, failed=True)
        raise
    if buf is not None:
        from xema_ray.models.host_pack import finish_host_buffer

        finish_host_buffer(module, buf, device, pinned)
    if device.type != "meta":
        source.finish()
    setattr(module, COMPUTE_DEVICE_ATTR, device)
    return report


class _Placer:
    """Places one module's own tensors at a time at their home, counting them in ``report``;
    host-homed ones go into their slots of ``buf`` (None: no host buffer)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, source: WeightSource, buf: HostBuffer | None,
                 slots: dict[tuple[str, str], HostSlot], host_copy: bool = False) -> None:
        self.device, self.dtype, self.source, self.buf, self.slots = device, dtype, source, buf, slots
        #: device-homed tensors have slots in ``buf`` too (the node's host copy) and are copied from them
        self.host_copy = host_copy
        self.report = PlacementReport()
        self.placed: dict[int, nn.Parameter] = {}  # tied parameters (one object in two modules) stay one
        self._names: dict[int, list[tuple[int, str]]] = {}  # id(module) -> (id(meta), name) of what it placed

    def refresh(self, sub: nn.Module) -> None:
        """Point the tied-parameter table at ``sub``'s parameters as they are now."""
        for key, name in self._names.pop(id(sub), []):
            if sub._parameters.get(name) is not None:
                self.placed[key] = sub._parameters[name]  # type: ignore[assignment]

    def place(self, path: str, sub: nn.Module, home_of: Callable[[str], WeightHome]) -> None:
        """Give ``sub``'s own parameters and buffers (not its children's) their values at ``home_of(path)``."""
        own = dict(sub.named_parameters(recurse=False)) | dict(sub.named_buffers(recurse=False))
        if not own:
            return
        home = home_of(path)
        for name in [n for n, p in sub._parameters.items() if p is not None and id(p) in self.placed]:
            sub._parameters[name] = self.placed[id(own.pop(name))]
        if not own:
            return
        buf = self.buf
        views = ({n: buf.view(s.offset, s.shape, s.dtype) for n in own if (s := self.slots.get((path, n))) is not None}
                 if buf is not None and (home is WeightHome.HOST or self.host_copy) else {})
        start, copied = time.perf_counter(), self.report.device_copy_s
        values = self._values(path, sub, own, home, views)
        for name, meta in own.items():
            t = self._tensor(name, meta, sub, home, views, values)
            if t is None:
                continue
            if home is WeightHome.DEVICE and name in views:
                t = self._to_device(t)
            if name in sub._parameters:
                self.placed[id(meta)] = sub._parameters[name] = nn.Parameter(t, requires_grad=False)
                self._names.setdefault(id(sub), []).append((id(meta), name))
            else:
                sub._buffers[name] = t
            self.report.tensors += 1
            as_dtype = meta.is_floating_point() and name in sub._parameters
            nbytes = meta.numel() * (self.dtype.itemsize if as_dtype else meta.element_size())
            if home is WeightHome.DEVICE:
                self.report.device_bytes += nbytes
            else:
                self.report.host_bytes += nbytes
        # values read or generated and copied into their host slot or home: all but the device copies
        self.report.source_s += (time.perf_counter() - start) - (self.report.device_copy_s - copied)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A device-homed tensor's copy from its slot in the host copy (a CPU device gets its own
        copy too: the worker's weights never alias the node's segment)."""
        start = time.perf_counter()
        out = t.clone() if self.device.type == "cpu" else t.to(self.device)
        self.report.device_copy_s += time.perf_counter() - start
        self.report.host_copy_bytes += t.numel() * t.element_size()
        return out

    def _values(self, path: str, sub: nn.Module, own: dict[str, torch.Tensor], home: WeightHome,
                views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The source's values for ``sub``'s tensors (none on meta, or where another worker of this
        node filled the shared segment already)."""
        if self.device.type == "meta":
            # at most one module's values are held outside their home at once (any source)
            self.report.transient_bytes = max(self.report.transient_bytes, sum(
                t.numel() * (self.dtype.itemsize if t.is_floating_point() else t.element_size()) for t in own.values()))
            return {}
        if views and self.buf is not None and self.buf.filled:
            self.source.mark_used(path, list(own))  # another worker of this node filled the segment
            return {}
        filled_at = WeightHome.HOST if views else home  # a host copy's slots are filled on the host
        values = _source_values(self.source, path, sub, self.dtype, self.device, filled_at, views or None)
        self.report.transient_bytes = max(self.report.transient_bytes, self.source.transient_bytes)
        return values

    def _tensor(self, name: str, meta: torch.Tensor, sub: nn.Module, home: WeightHome,
                views: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The tensor ``name`` becomes at its home (None: the source has no value for it; it stays as built)."""
        if self.device.type == "meta":
            t_dtype = self.dtype if meta.is_floating_point() and name in sub._parameters else meta.dtype
            return (torch.empty(meta.shape, dtype=t_dtype, device="meta") if home is WeightHome.DEVICE
                    else placeholder(meta.shape, t_dtype, torch.device("meta")))
        v = values.get(name)
        if v is None and not meta.is_meta:
            v = meta  # a buffer the constructor computed (not in a checkpoint, not seeded)
        if name in views:
            t = views[name]
            if not self.buf.filled:  # type: ignore[union-attr]
                if v is None:
                    return None
                if v.data_ptr() != t.data_ptr():
                    t.copy_(v)  # into its slot (a source casting a stored dtype made one copy first)
            return t
        if v is None:
            return None
        return v.to(self.device) if home is WeightHome.DEVICE else v
