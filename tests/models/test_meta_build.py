"""``build_on_meta`` skips ``torch.nn.init`` on meta parameters (nothing to set) and nothing else."""

from __future__ import annotations

import torch
from torch import nn

from xema_ray.models.loading import build_on_meta, no_init_on_meta


def test_initialisers_skip_meta_tensors_only() -> None:
    meta, real = torch.empty(4, 4, device="meta"), torch.zeros(4, 4)
    with no_init_on_meta():
        assert nn.init.kaiming_uniform_(meta) is meta
        nn.init.ones_(real)
    assert bool((real == 1).all())
    nn.init.zeros_(real)  # restored afterwards
    assert bool((real == 0).all()) and nn.init.ones_ is not None


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("scale", torch.arange(4.0))  # computed by the constructor, kept real


class _Model(_Block):
    @classmethod
    def from_config(cls, _config: dict) -> _Model:  # the diffusers interface build_on_meta calls
        return cls()


def test_meta_build_keeps_shapes_and_real_buffers() -> None:
    model = build_on_meta(_Model, {}, torch.float32)
    assert model.proj.weight.is_meta and tuple(model.proj.weight.shape) == (8, 8)
    assert model.scale.device.type == "cpu" and model.scale.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_parameters_on_meta_touches_only_its_own_thread_and_never_stays_installed() -> None:
    """Two loads overlapping in one process (in-process workers are threads): the one building on
    meta does not put the other's parameters there, and once both are done nothing stays patched
    (a patch restored out of order once stayed, and every later checkpoint load got meta tensors)."""
    import threading

    from torch import nn

    from xema_ray.models.loading import no_init_on_meta, parameters_on_meta

    original_register, original_init = nn.Module.register_parameter, nn.init.kaiming_uniform_
    inside, release = threading.Event(), threading.Event()
    built: dict[str, nn.Module] = {}

    def on_meta() -> None:
        with parameters_on_meta(), no_init_on_meta():
            built["meta"] = nn.Linear(4, 4)
            inside.set()
            release.wait(10)  # the other thread builds while this one is inside

    t = threading.Thread(target=on_meta)
    t.start()
    assert inside.wait(10)
    built["real"] = nn.Linear(4, 4)  # this thread is not inside: its parameters are real, initialised
    with parameters_on_meta():  # a second, overlapping user; the first leaves before it
        release.set()
        t.join(10)
        built["also_meta"] = nn.Linear(4, 4)
    assert built["meta"].weight.is_meta and built["also_meta"].weight.is_meta
    assert not built["real"].weight.is_meta and built["real"].weight.abs().sum() > 0
    assert nn.Module.register_parameter is original_register and nn.init.kaiming_uniform_ is original_init
    assert not nn.Linear(2, 2).weight.is_meta
