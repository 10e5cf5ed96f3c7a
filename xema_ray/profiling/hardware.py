"""Hardware profiles for the roofline cost model: peak rates and interconnect of a GPU box.

Numbers are vendor peaks (dense, no sparsity) except where a measurement exists
(docs/measured-facts.md, "Calibration points"): the H200's pinned host->device copy is the measured
55 GB/s. Efficiencies
turn peaks into achievable rates; they are the cost model's only fitted constants and are
documented next to the calibration points in ``costmodel``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class HardwareProfile(BaseModel):
    """One GPU model and how a box of them is wired.

    Example:
        >>> H200.link_gbps(2), A6000_8X.link_gbps(2), A6000_8X.link_gbps(4)
        (450.0, 56.25, 25.0)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    gpu_model: str = Field(default="any", description="the GPU's model name as NVML reports it (keys static layouts)")
    gpus: int = Field(ge=1, description="GPUs in the box")
    memory_gb: float = Field(gt=0, description="memory per GPU, GB (10^9)")
    bf16_tflops: float = Field(gt=0, description="dense bf16 tensor-core peak, TFLOP/s")
    mem_gbps: float = Field(gt=0, description="device memory bandwidth, GB/s")
    h2d_gbps: float = Field(gt=0, description="pinned host->device copy bandwidth, GB/s")
    nvlink_gbps: float = Field(ge=0, description="NVLink bandwidth per direction per GPU, GB/s (0: none)")
    nvlink_domain: int = Field(ge=1, description="GPUs that reach each other over NVLink (8 on HGX, 2 for bridged pairs)")
    pcie_gbps: float = Field(gt=0, description="achievable GPU<->GPU bandwidth over PCIe, GB/s per direction")
    collective_latency_s: float = Field(default=20e-6, ge=0, description="fixed cost of one collective call")
    matmul_efficiency: float = Field(default=0.6, gt=0, le=1, description="achieved / peak for large GEMMs")
    attention_efficiency: float = Field(default=0.45, gt=0, le=1, description="achieved / peak for flash attention")
    conv_efficiency: float = Field(default=0.15, gt=0, le=1, description="achieved / peak for VAE convolutions (cuDNN 3D convs, group norms)")
    copy_interference: float = Field(
        default=0.3, ge=0, description="compute slow-down while a host->device copy runs (H200: 2-block forward 20.9 ms alone, 27.1 ms under a 17.7 ms copy)"
    )
    host_tflops: float = Field(
        default=1.5, gt=0,
        description="achieved bf16 TFLOP/s of the host CPUs for a text encoder placed there (an estimate for a "
                    "2-socket server with AMX; the CPU profile measures its own)")
    fingerprint: str | None = Field(default=None, description="platform fingerprint of this hardware, to match profile-store records")
    stored_formats: tuple[Literal["fp8", "int8"], ...] = Field(
        default=("fp8", "int8"), description="quantized weight formats its kernels take (weight-only: dequantized in "
                                             "the matmul where not computed natively)")
    computed_formats: tuple[Literal["fp8", "int8"], ...] = Field(
        default=(), description="quantized formats its tensor cores compute natively (the weight read is the "
                                "stored bytes, no dequantization pass); the others are storage only")

    def weight_format(self, asked: str) -> str:
        """The format a tier asking for ``asked`` stores here: itself where the hardware takes it,
        else int8, else the model's own dtype.

        Example:
            >>> A6000_8X.weight_format("fp8"), A6000_8X.weight_format("model")
            ('fp8', 'model')
        """
        if asked == "model" or asked in self.stored_formats:
            return asked
        return "int8" if "int8" in self.stored_formats else "model"

    def link_gbps(self, group_size: int) -> float:
        """Per-GPU bandwidth of collectives within a group of ``group_size`` GPUs: NVLink when the
        group fits one NVLink domain, else PCIe (the slowest hop bounds a ring or an all-to-all)."""
        if group_size <= 1:
            return float("inf")
        if self.nvlink_gbps > 0 and group_size <= self.nvlink_domain:
            return self.nvlink_gbps
        return self.pcie_gbps


#: NVIDIA H200 SXM (HGX): 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e, 141 GB, NVLink 4 (900 GB/s
#: bidirectional); host copies measured at 55 GB/s (docs/measured-facts.md, "Calibration points").
H200 = HardwareProfile(
    name="NVIDIA H200", gpu_model="NVIDIA H200", gpus=8, memory_gb=141, bf16_tflops=989, mem_gbps=4800, h2d_gbps=55,
    nvlink_gbps=450, nvlink_domain=8, pcie_gbps=50, computed_formats=("fp8", "int8"),
)

#: The paper's box (§9.1): 8x RTX A6000 48 GB (154.8 TFLOP/s bf16 dense, 768 GB/s GDDR6), PCIe 4.0
#: x16 (~25 GB/s achievable), two NUMA domains, NVLink bridges joining GPU pairs (112.5 GB/s
#: bidirectional).
A6000_8X = HardwareProfile(
    name="8x NVIDIA RTX A6000 48GB", gpu_model="NVIDIA RTX A6000", gpus=8, memory_gb=48, bf16_tflops=154.8, mem_gbps=768, h2d_gbps=25,
    nvlink_gbps=56.25, nvlink_domain=2, pcie_gbps=25, computed_formats=("int8",),  # Ampere: no fp8 tensor cores
)

HARDWARE: dict[str, HardwareProfile] = {"h200": H200, "a6000x8": A6000_8X}


def get_hardware(name: str) -> HardwareProfile:
    """A preset by key ("h200", "a6000x8"); ValueError listing them otherwise."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known: {sorted(HARDWARE)}") from None
