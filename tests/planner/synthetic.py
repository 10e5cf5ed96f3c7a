"""A synthetic planner model with closed-form memory and latency, for stage tests with known answers.

Memory per GPU: weights W (minus offloaded blocks) + a DiT interval (events 0..100) of
A·bs/sp and a VAE interval (events 100..110) of V·bs (divided by VAE chunks / serialization).
Latency: L·bs^0.7/sp + comm·(sp-1) + per-action overheads (batching is sublinear, as on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.model import MemoryView, MitigationOption
from xema_ray.memory.analysis import PressureInterval
from xema_ray.plan import ExecutionConfig, Mitigation

GB = 10**9


@dataclass
class Synthetic:
    W: int = 40 * GB
    block: int = 1 * GB
    n_blocks: int = 3  # tiny-flux2 has 3 DiT blocks
    A: int = 6 * GB
    V: int = 10 * GB
    L: float = 10.0
    comm: float = 1.0
    offload_free: int = 1  # blocks that offload with no overhead
    offload_cost: float = 2.0
    chunk_cost: float = 0.5
    serial_cost: float = 3.0

    def _parts(self, cfg: ExecutionConfig) -> tuple[int, int, int]:
        w, a, v = self.W, self.A * cfg.batch // cfg.sp, self.V * cfg.batch
        for m in cfg.mitigations:
            if m.kind == "block_offload":
                w -= m.intensity * self.block
            elif m.kind == "dit_chunking":
                a //= m.intensity
            elif m.kind in ("vae_chunking", "temporary_serialization"):
                v //= m.intensity
        return w, a, v

    def memory(self, cfg: ExecutionConfig, budget: int) -> MemoryView:
        w, a, v = self._parts(cfg)
        ivs = []
        if w + a > budget:
            ivs.append(PressureInterval(start=0, stop=100, peak_bytes=w + a, excess_bytes=w + a - budget,
                                        phases=["denoise.step0"], units=["transformer.transformer_blocks.0"], ops=["mm"]))
        if w + v > budget:
            ivs.append(PressureInterval(start=100, stop=110, peak_bytes=w + v, excess_bytes=w + v - budget,
                                        phases=["decode.vae"], units=["vae.decoder.up_blocks.3"], ops=["convolution"]))
        return MemoryView(peak_bytes=max(w + a, w + v), intervals=tuple(ivs))

    def latency(self, cfg: ExecutionConfig) -> float:
        lat = self.L * cfg.batch**0.7 / cfg.sp + self.comm * (cfg.sp - 1)
        for m in cfg.mitigations:
            if m.kind == "block_offload":
                lat += self.offload_cost * max(0, m.intensity - self.offload_free)
            elif m.kind == "dit_chunking":
                lat += self.chunk_cost * m.intensity
            elif m.kind == "vae_chunking":
                lat += self.chunk_cost * m.intensity
            elif m.kind == "temporary_serialization":
                lat += self.serial_cost * (m.intensity - 1)
        return lat

    def options(self, cfg: ExecutionConfig, interval: PressureInterval) -> list[MitigationOption]:
        opts = [
            MitigationOption((Mitigation(kind="block_offload", blocks=tuple(range(k)), intensity=k),),
                             zero_overhead=k <= self.offload_free)
            for k in range(1, self.n_blocks + 1)
        ]
        if interval.phases == ["decode.vae"]:
            opts += [MitigationOption((Mitigation(kind="vae_chunking", modules=("vae.decoder.up_blocks.3",), intensity=c),))
                     for c in (2, 4)]
            if cfg.batch > 1:
                opts += [MitigationOption((Mitigation(kind="temporary_serialization", modules=("vae.decoder",), intensity=cfg.batch),))]
        else:
            opts += [MitigationOption((Mitigation(kind="dit_chunking", blocks=(0,), intensity=c),)) for c in (2, 4)]
        return opts

    def full_mitigation(self, cfg: ExecutionConfig) -> tuple[Mitigation, ...]:
        full = [Mitigation(kind="block_offload", blocks=tuple(range(self.n_blocks)), intensity=self.n_blocks),
                Mitigation(kind="dit_chunking", blocks=(0,), intensity=4),
                Mitigation(kind="vae_chunking", modules=("vae.decoder.up_blocks.3",), intensity=4)]
        if cfg.batch > 1:
            full.append(Mitigation(kind="temporary_serialization", modules=("vae.decoder",), intensity=cfg.batch))
        return tuple(full)
