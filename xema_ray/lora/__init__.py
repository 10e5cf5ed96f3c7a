"""LoRA adapters served per sample: many adapters in one batch, hot-added, planned into memory.

- ``adapter.py``: an adapter file (safetensors, diffusers/PEFT names or a community layout that
  diffusers converts) read and checked against the model it is for (``read_adapter``).
- ``pool.py``: the adapter pool: every known adapter on the host, ``slots`` of them resident on
  the device in stacked, rank-padded tensors, least recently used moved out.
- ``layers.py``: the primitive (``Config`` + ``Hook`` + ``apply``): on each target linear layer,
  each sample's own low-rank delta from gathered A/B (one batched matmul pair, not a loop over
  requests); the base weights are never touched.
- ``memory.py``: the pool's and the intermediates' bytes for the planner and ``xema verify``.
"""

from xema_ray.lora_pool import LoraPoolConfig
from xema_ray.lora.adapter import AdapterPathRefused, AdapterRejected, AdapterSource, LoraAdapter, LoraUse, read_adapter
from xema_ray.lora.layers import MultiLoraConfig, apply_multi_lora
from xema_ray.lora.pool import AdapterInfo, AdapterPool, PoolStats

__all__ = [
    "AdapterInfo", "AdapterPathRefused", "AdapterPool", "AdapterRejected", "AdapterSource", "LoraAdapter", "LoraPoolConfig", "LoraUse",
    "MultiLoraConfig", "PoolStats", "apply_multi_lora", "read_adapter",
]
