"""GPU table for the planner: memory, peak dense bf16 tensor FLOP/s and per-GPU link bandwidths.

Sources (vendor datasheets; dense = without 2:4 sparsity):
- H100 SXM5: 80 GB HBM3 (nvidia-smi reports 81,559 MiB), 989.4 TFLOP/s bf16 dense, NVLink 4
  900 GB/s total = 450 GB/s per direction; one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100) =
  50 GB/s.
- H200 SXM: 141 GB HBM3e (143,771 MiB), same compute and NVLink as H100, 400 Gb/s per GPU.
- A100 SXM4 80 GB: 312 TFLOP/s bf16 dense, NVLink 3 600 GB/s total = 300 GB/s per direction;
  one 200 Gb/s HDR NIC per GPU (DGX A100) = 25 GB/s.
- B200 (HGX/DGX B200): 180 GB HBM3e (183,359 MiB), 2,250 TFLOP/s bf16 dense, NVLink 5 1.8 TB/s
  total = 900 GB/s per direction; 400 Gb/s ConnectX-7 per GPU (DGX B200) = 50 GB/s.
Bandwidths are per GPU and per direction, the figure a ring collective's bus bandwidth is
bounded by; NCCL typically reaches 70-85% of it (fold that into --nvlink-gbps / --ib-gbps).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_lite.training.flops import peak_tflops

MIB = 2**20


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int  # what the device reports as total memory
    peak_tflops: float  # dense bf16 tensor-core TFLOP/s (training/flops.py owns the figures)
    nvlink_gbps: float  # GB/s per GPU per direction inside a node
    ib_gbps: float  # GB/s per GPU per direction between nodes (IB/RoCE NIC)


GPUS = {
    "h100": GPU("H100 SXM 80GB", 81_559 * MIB, peak_tflops("h100"), 450.0, 50.0),
    "h200": GPU("H200 SXM 141GB", 143_771 * MIB, peak_tflops("h200"), 450.0, 50.0),
    "a100": GPU("A100 SXM 80GB", 81_920 * MIB, peak_tflops("a100"), 300.0, 25.0),
    "b200": GPU("B200 180GB", 183_359 * MIB, peak_tflops("b200"), 900.0, 50.0),
}


def get_gpu(name: str, nvlink_gbps: float | None = None, ib_gbps: float | None = None) -> GPU:
    """The table's entry for `name`, with the bandwidths overridden where given."""
    if name not in GPUS:
        raise ValueError(f"--gpu {name!r} is not one of {', '.join(GPUS)}")
    gpu = GPUS[name]
    if nvlink_gbps is not None:
        gpu = replace(gpu, nvlink_gbps=nvlink_gbps)
    if ib_gbps is not None:
        gpu = replace(gpu, ib_gbps=ib_gbps)
    return gpu


def usable_bytes(gpu: GPU, reserve_fraction: float = 0.05, reserve_bytes: int = 3 * 2**30) -> float:
    """Memory the planner lets tensors fill: total minus a fixed reserve (CUDA context, cuBLAS
    workspaces, NCCL buffers: ~3 GiB) minus a fraction for caching-allocator fragmentation."""
    return (gpu.memory_bytes - reserve_bytes) * (1 - reserve_fraction)
