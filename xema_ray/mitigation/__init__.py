"""Fine-grained memory mitigation (paper §5): each primitive applied only where needed and
only as much as needed, as removable hooks on a diffusers pipeline.

One module per primitive, each with a ``Config``, hooks and the one entry point
``apply(pipe, spec, config, comm)`` returning its ``MitigationHandle`` (``comm``: the process group,
read by HSDP only). The lower-level ``apply_*`` functions stay where a caller hooks something that is
not a pipeline's DiT (``apply_block_offload`` on a text encoder) or tests and benchmarks drive them:

=====================  ===================================  ============================================
Mitigation.kind         module                              location / intensity
=====================  ===================================  ============================================
block_offload           ``block_offload``                   DiT blocks / how many (K)
hsdp                    ``hsdp``                            DiT blocks / how many
activation_offload      ``activation_offload``              module paths / tensors per module
dit_chunking            ``dit_chunking``                    DiT blocks / sequence chunks
vae_chunking            ``vae_chunking``                    decoder paths or chains PARENT[START:] / bands
temporary_serialization ``serialization``                   module paths or blocks / sub-batches
step_cache              ``step_cache``                      the denoisers / a fixed step mask (a quality
                                                            tier, not a memory knob: ``docs/quality.md``)
=====================  ===================================  ============================================

``registry`` maps a plan's ``Mitigation`` to a config (``primitive_for``), dispatches a config to its
module's ``apply`` through a table by config type (``PRIMITIVES``, ``apply_config``) and applies lists
(``apply_mitigations``); the planner's analytic estimates live in ``planner.estimates``;
the analyzer traces a mitigated pipeline at real size (``xema_ray.analyzer.mitigated``): mitigation
never imports the analyzer.
"""

from xema_ray.mitigation.activation_offload import ActivationOffloadConfig
from xema_ray.mitigation.block_offload import BlockOffloadConfig, apply_block_offload
from xema_ray.mitigation.dit_chunking import DitChunkingConfig, apply_dit_chunking
from xema_ray.mitigation.hooks import MitigationHandle
from xema_ray.mitigation.hsdp import HSDPConfig, ProcessGroupCollective, ShapeOnlyGroup, apply_hsdp
from xema_ray.mitigation.registry import apply_mitigations, primitive_for
from xema_ray.mitigation.serialization import SerializationConfig, apply_serialization
from xema_ray.mitigation.step_cache import StepCacheConfig, apply_step_cache
from xema_ray.mitigation.vae_chunking import VaeChunkingConfig, apply_vae_chunking

__all__ = [
    "ActivationOffloadConfig",
    "BlockOffloadConfig",
    "DitChunkingConfig",
    "HSDPConfig",
    "MitigationHandle",
    "ProcessGroupCollective",
    "SerializationConfig",
    "StepCacheConfig",
    "ShapeOnlyGroup",
    "VaeChunkingConfig",
    "apply_block_offload",
    "apply_dit_chunking",
    "apply_hsdp",
    "apply_mitigations",
    "apply_serialization",
    "apply_step_cache",
    "apply_vae_chunking",
    "primitive_for",
]
