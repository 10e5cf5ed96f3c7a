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

import contextlib
import hashlib
import threading
from abc import ABC, abstractmethod
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xema_ray.models.base import default_dtype
from xema_ray.placement import COMPUTE_DEVICE_ATTR, PlacementReport, WeightHome, placeholder


class CheckpointError(ValueError):
    """A diffusers directory does not hold what the model's config needs."""


# ---------------------------------------------------------------------------- sources
class WeightSource(ABC):
    """Gives a module's own tensors their values (on the CPU)."""

    @abstractmethod
    def values(self, path: str, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``name -> CPU tensor`` for ``module``'s direct parameters and buffers (``path`` is
        the module's dotted path in its component)."""

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

    def placed_values(self, path: str, module: nn.Module, dtype: torch.dtype, device: torch.device,
                      pin: bool = False) -> dict[str, torch.Tensor]:
        """``values``, with the tiled (real-size) tensors allocated and filled at ``device``
        (pinned host memory with ``pin``) instead of on the CPU: the same bytes (the pattern is
        drawn on the CPU from the same generator), without writing 64 GB on the host and copying
        it over. Smaller tensors come back on the CPU; the caller moves them."""
        own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        if not any(t.is_meta for t in own.values()):
            return {}  # buffers computed by the constructor keep their values
        gen = torch.Generator(device="cpu").manual_seed(_seed_for(self.seed, self.component, path))
        if any(t.numel() > TILE_THRESHOLD for t in own.values()):
            tiled: dict[str, torch.Tensor] = {}
            for n, t in own.items():
                big = t.dim() > 1 and t.is_floating_point()
                tiled[n] = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                                       device=device if big else "cpu", pin_memory=pin and big)
                _tiled_init(n, tiled[n], gen)
            return {n: t for n, t in tiled.items() if own[n].is_meta}
        # a CPU twin of the module's own tensors, initialised by its own reset_parameters where it has one
        out = {n: torch.empty(t.shape, dtype=t.dtype if not t.is_floating_point() else dtype) for n, t in own.items()}
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            twin = _cpu_twin(module, out)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_seed_for(self.seed, self.component, path))
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
    """Tensors read one by one from a local diffusers component directory."""

    directory: Path
    files: dict[str, Path] = field(default_factory=dict)
    _used: set[str] = field(default_factory=set)
    _handles: dict[Path, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: missing component directory")
        self.files = _safetensors_files(self.directory)

    def _open(self, f: Path) -> Any:
        h = self._handles.get(f)
        if h is None:
            from safetensors import safe_open

            h = self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return h

    def values(self, path: str, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        out = {}
        for n, meta in own.items():
            key = f"{path}.{n}" if path else n
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
            out[n] = t.to(dtype) if t.is_floating_point() else t
            self._used.add(key)
        return out

    def finish(self) -> None:
        self._handles.clear()
        unused = sorted(set(self.files) - self._used)
        if unused:
            raise CheckpointError(
                f"{self.directory}: {len(unused)} tensor(s) the model's config does not have, e.g. {unused[:3]} "
                "(a checkpoint of another model or config?)")


@dataclass
class LoadedWeights(WeightSource):
    """Values from a module already loaded on the CPU (a transformers checkpoint, read with its
    own key conventions); each is handed out once and then dropped, so the CPU copy shrinks as
    the placed model grows."""

    module: nn.Module
    origin: str

    def values(self, path: str, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        try:
            src = self.module.get_submodule(path) if path else self.module
        except AttributeError:
            raise CheckpointError(f"{self.origin}: the checkpoint has no module {path!r}") from None
        out = {}
        for n, meta in (dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))).items():
            t = src._parameters.get(n) if n in src._parameters else src._buffers.get(n)
            if t is None:
                raise CheckpointError(f"{self.origin}: tensor {path + '.' + n if path else n!r} is missing")
            if tuple(t.shape) != tuple(meta.shape):
                raise CheckpointError(f"{self.origin}: tensor {path}.{n} has shape {tuple(t.shape)}, expected {tuple(meta.shape)}")
            out[n] = t.detach().to(dtype) if t.is_floating_point() else t.detach()
        return out

    def finish(self) -> None:
        self.module = nn.Module()


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
                   home: WeightHome, pin: bool) -> dict[str, torch.Tensor]:
    """The source's values for one module; seeded real-size tensors are filled at their home."""
    if isinstance(source, SeededWeights):
        if home is WeightHome.DEVICE:
            return source.placed_values(path, sub, dtype, device)
        return source.placed_values(path, sub, dtype, torch.device("cpu"), pin=pin)
    return source.values(path, sub, dtype)


def _modules_in_order(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    yield from root.named_modules(remove_duplicate=True)


class _ProcessPatch:
    """A process-wide patch installed while any thread needs it, active only in those threads.

    Patching a class attribute per call and restoring it after is not thread-safe: two loads that
    overlap (in-process workers are threads) restore each other's patch, and one stays installed
    for good (every later module, a transformers checkpoint's too, then got meta parameters).
    Here the patch goes in at the first user and out at the last, under a lock; what it does is
    gated per thread."""

    def __init__(self, install: Callable[[], None], uninstall: Callable[[], None]) -> None:
        self._install, self._uninstall = install, uninstall
        self._lock = threading.Lock()
        self._users = 0
        self._local = threading.local()

    @property
    def active(self) -> bool:
        """The calling thread is inside the patch's context."""
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._install()
            self._users += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._uninstall()


_REGISTER_PARAMETER = nn.Module.register_parameter


def _register_parameter_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
    _REGISTER_PARAMETER(self, name, param)
    if _META_PARAMETERS.active and param is not None and param.device.type != "meta":
        self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)


def _set_register_parameter(fn: Callable[..., None]) -> Callable[[], None]:
    def set_it() -> None:
        nn.Module.register_parameter = fn  # type: ignore[method-assign]
    return set_it


_META_PARAMETERS = _ProcessPatch(_set_register_parameter(_register_parameter_on_meta),
                                 _set_register_parameter(_REGISTER_PARAMETER))


def parameters_on_meta() -> contextlib.AbstractContextManager[None]:
    """Construct modules with every parameter on the meta device (moved there as it is
    registered, before any constructor initialises it) and every buffer real on the CPU: buffers
    are small values computed by constructors (rotary frequencies, normalisation statistics)
    that no checkpoint or seed could supply. accelerate's ``init_empty_weights`` does the same.
    Only the calling thread's modules: another thread loading a checkpoint meanwhile is untouched."""
    return _META_PARAMETERS()


#: ``torch.nn.init`` functions constructors call on their parameters (Linear, Conv, Embedding,
#: norms): on a meta parameter they compute nothing, at ~0.1 ms a call (LTX-2's 3,267 linear
#: layers: 0.3 s of its transformer's 0.47 s build)
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                   "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_")
_INIT_ORIGINALS: dict[str, Callable[..., Any]] = {n: getattr(nn.init, n) for n in _INIT_FUNCTIONS if hasattr(nn.init, n)}


def _skipping(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor if isinstance(tensor, torch.Tensor) and tensor.is_meta else fn(tensor, *args, **kwargs)
    return call


def _set_init(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    def set_them() -> None:
        for name, fn in _INIT_ORIGINALS.items():
            setattr(nn.init, name, wrap(fn))
    return set_them


_NO_INIT_ON_META = _ProcessPatch(_set_init(_skipping), _set_init(lambda fn: fn))


def no_init_on_meta() -> contextlib.AbstractContextManager[None]:
    """``torch.nn.init``'s initialisers return a meta tensor as it is (it has no values to set);
    every other tensor (a buffer a constructor computes on the CPU) is initialised as usual."""
    return _NO_INIT_ON_META()


def build_on_meta(cls: type[Any], config: dict[str, Any], dtype: torch.dtype, real_buffers: bool = True) -> nn.Module:
    """The component's module tree with its parameters on the meta device (no memory, seconds
    for 32 B parameters) and its buffers computed on the CPU (``real_buffers``; else on meta too).

    Built outside any active dispatch mode: the tree is only shapes, not an allocation of any
    device, so an allocation tracer around a worker's load (``xema verify``) counts each weight
    once, when ``materialize`` places it."""
    from torch.utils._python_dispatch import _disable_current_modes

    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    where = parameters_on_meta() if real_buffers else torch.device("meta")
    with _disable_current_modes(), default_dtype(dtype), where, no_init_on_meta():
        model = cls.from_config(cfg)
    return model.eval().requires_grad_(False)


def materialize(
    module: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    source: WeightSource,
    home_of: Callable[[str], WeightHome] = lambda _path: WeightHome.DEVICE,
) -> PlacementReport:
    """Give every tensor of a meta-built ``module`` its value at its home, one module at a time.

    Args:
        module: built on meta (``build_on_meta``).
        device: the compute device ("meta" = shape-only: nothing is read or generated).
        dtype: floating dtype of the weights.
        source: where values come from.
        home_of: module path -> home; a module's home covers its own tensors (children ask for theirs).

    Returns:
        Bytes placed on the device and on the host.
    """
    report = PlacementReport()
    pin = device.type == "cuda"
    placed: dict[int, nn.Parameter] = {}  # tied parameters (one object in two modules) stay one
    for path, sub in _modules_in_order(module):
        own = dict(sub.named_parameters(recurse=False)) | dict(sub.named_buffers(recurse=False))
        if not own:
            continue
        home = home_of(path)
        for name in [n for n, p in sub._parameters.items() if p is not None and id(p) in placed]:
            sub._parameters[name] = placed[id(own.pop(name))]
        if not own:
            continue
        values = {} if device.type == "meta" else _source_values(source, path, sub, dtype, device, home, pin)
        for name, meta in own.items():
            as_dtype = meta.is_floating_point() and name in sub._parameters
            nbytes = meta.numel() * (dtype.itemsize if as_dtype else meta.element_size())
            if device.type == "meta":
                t_dtype = dtype if meta.is_floating_point() and name in sub._parameters else meta.dtype
                t = (torch.empty(meta.shape, dtype=t_dtype, device="meta") if home is WeightHome.DEVICE
                     else placeholder(meta.shape, t_dtype, torch.device("meta")))
            else:
                v = values.get(name)
                if v is None and not meta.is_meta:
                    v = meta  # a buffer the constructor computed (not in a checkpoint, not seeded)
                if v is None:
                    continue
                if home is WeightHome.DEVICE:
                    t = v.to(device)
                else:
                    t = v.pin_memory() if pin and not v.is_pinned() else v
            if name in sub._parameters:
                placed[id(meta)] = sub._parameters[name] = nn.Parameter(t, requires_grad=False)
            else:
                sub._buffers[name] = t
            report.tensors += 1
            if home is WeightHome.DEVICE:
                report.device_bytes += nbytes
            else:
                report.host_bytes += nbytes
    if device.type != "meta":
        source.finish()
    setattr(module, COMPUTE_DEVICE_ATTR, device)
    return report
