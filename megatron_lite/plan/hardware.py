"""The planner's machines: GPUs (memory, peak dense bf16 and FP8 tensor FLOP/s, links) and the
node they sit in (NVLink/NVSwitch or PCIe with or without peer-to-peer, GPUs sharing a PCIe
switch, the NICs), as `Node`, which plan/comm.py turns into each group's bus bandwidth.

Sources (vendor datasheets; dense = without 2:4 sparsity; bf16 and FP8 with FP32 accumulation,
what training runs; the TFLOP/s table itself lives in training/flops.py):
- H100 SXM5: 80 GB HBM3 (nvidia-smi reports 81,559 MiB), 989.4 bf16 / 1,978.9 FP8 TFLOP/s,
  NVLink 4 900 GB/s total = 450 GB/s per direction, NVSwitch with NVLink SHARP (NVLS); one
  400 Gb/s ConnectX-7 NIC per GPU (DGX H100). https://glennklockwood.com/garden/processors/h100
- H100 PCIe: 80 GB HBM2e, 114 SMs, 756 bf16 / 1,513 FP8 (the datasheet's 1,513 / 3,026 are
  with sparsity), PCIe Gen5 x16 (128 GB/s both ways), NVLink bridge only between pairs.
  https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html
- H200 SXM: 141 GB HBM3e (143,771 MiB), the H100's compute and NVLink, 400 Gb/s per GPU.
- A100 SXM4 80 GB / A100 PCIe 80 GB: 312 bf16 (no FP8 tensor cores), NVLink 3 600 GB/s total
  on SXM; PCIe Gen4 x16; one 200 Gb/s HDR NIC per GPU (DGX A100).
- B200 (HGX/DGX B200): 180 GB HBM3e (183,359 MiB), 2,250 bf16 / 4,500 FP8, NVLink 5 1.8 TB/s
  total = 900 GB/s per direction; 400 Gb/s ConnectX-7 per GPU (DGX B200).
- L40S: 48 GB GDDR6 with ECC, 362.05 bf16 / 733 FP8 dense (733 / 1,466 with sparsity), PCIe
  Gen4 x16, no NVLink. https://www.mullet.se/product.html?product_id=355414 (NVIDIA's table)
- GeForce RTX 5090: 32 GB GDDR7, 170 SMs, PCIe Gen5 x16; FP16 tensor 838.4 and FP8 1,676.8
  TFLOP/s are sparse with FP16 accumulation (https://www.spheron.network/blog/nvidia-rtx-5090-specs/);
  GeForce runs FP32 accumulation at half that rate (measured on its sibling sm_120 RTX 5060 Ti:
  bf16/FP32-acc 47.0 vs FP16/FP16-acc 87.9 TFLOP/s, https://github.com/QuantumDrizzy/BLACKWALL),
  so dense bf16 = 838.4 / 2 / 2 = 209.5 and FP8 = 419. Peer-to-peer over PCIe is disabled
  on GeForce: NCCL moves intra-node traffic through host memory (SHM transport).
- RTX PRO 6000 Blackwell (Workstation Edition): 96 GB GDDR7 (3 GB chips in clamshell),
  188 SMs, 4,000 AI TOPS (FP4, sparse) = 1,007.6 FP8 / 503.8 bf16 dense with full-rate FP32
  accumulation, PCIe Gen5 x16, peer-to-peer supported.
  https://ferreiradozezere.net/entretenimento/a-mansao-na-qual-adele-viveu-nao-e-vendida-por-ser-assombrada/2388/?random-post=1
  (the GTC 2025 specification article), https://gpu.name/posts/nvidia-unveils-rtx-pro-6000-blackwell-gpu-with-24-064-cores-and-96gb-memory
GDDR cards' memory is the datasheet's GB taken as GiB less ~1.5% the driver keeps (nvidia-smi
reports 32,607 MiB on an RTX 5090 and ~97,900 MiB on an RTX PRO 6000; an approximation).

Assumptions (each overridable by a flag): PCIe per GPU per direction as a ring reaches it,
Gen4 x16 25 GB/s and Gen5 x16 50 GB/s (of 32 and 64 raw); without peer-to-peer the traffic is
staged through host memory at HOST_STAGING of that (NCCL's SHM transport: a copy each side and
the host's DRAM carrying every byte twice); GPUs behind one PCIe switch or root port share its
x16 uplink for traffic leaving the switch; a NIC delivers NIC_EFFICIENCY of its line rate to
NCCL (InfiniBand 0.90, RoCE 0.80: Ethernet's congestion control and PFC pauses).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megatron_lite.training.flops import peak_fp8_tflops, peak_tflops

MIB = 2**20
INTERCONNECTS = ("nvlink", "pcie", "pcie-p2p")  # NVLink/NVSwitch; PCIe via host; PCIe P2P
NIC_TYPES = ("ib", "roce")
NIC_EFFICIENCY = {"ib": 0.90, "roce": 0.80}
HOST_STAGING = 0.5  # PCIe without peer-to-peer: the share of the link NCCL's SHM reaches
PCIE_GBPS = {4: 25.0, 5: 50.0}  # x16, per direction, realistic (raw 32 / 64)


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int  # what the device reports as total memory
    peak_tflops: float  # dense bf16 tensor-core TFLOP/s (training/flops.py owns the figures)
    nvlink_gbps: float  # GB/s per GPU per direction inside a node (its default node's links)
    ib_gbps: float  # GB/s per GPU per direction between nodes in its default node
    fp8_tflops: float | None = None  # dense FP8 TFLOP/s (None: no FP8 tensor cores)
    pcie_gen: int = 5
    interconnect: str = "nvlink"  # its usual node: nvlink | pcie | pcie-p2p
    nvls: bool = False  # NVSwitch with NVLink SHARP (NCCL's NVLS all-reduce)
    nic_gbps: float = 400.0  # its usual node: line rate of one NIC, Gb/s
    nics: int = 0  # its usual node's NICs (0: one per GPU)
    nic_type: str = "ib"  # its usual node's network: ib | roce


def _gpu(key, name, mib, nvlink, ib, **kw) -> GPU:
    return GPU(name, int(mib * MIB), peak_tflops(key), nvlink, ib, peak_fp8_tflops(key), **kw)


GPUS = {
    "h100": _gpu("h100", "H100 SXM 80GB", 81_559, 450.0, 50.0, nvls=True),
    "h200": _gpu("h200", "H200 SXM 141GB", 143_771, 450.0, 50.0, nvls=True),
    "a100": _gpu("a100", "A100 SXM 80GB", 81_920, 300.0, 25.0, pcie_gen=4, nic_gbps=200.0),
    "b200": _gpu("b200", "B200 180GB", 183_359, 900.0, 50.0, nvls=True),
    "h100-pcie": _gpu("h100-pcie", "H100 PCIe 80GB", 81_559, 0.0, 3.125,
                      interconnect="pcie-p2p", nic_gbps=200.0, nics=1),
    "a100-pcie": _gpu("a100-pcie", "A100 PCIe 80GB", 81_920, 0.0, 3.125, pcie_gen=4,
                      interconnect="pcie-p2p", nic_gbps=200.0, nics=1),
    "l40s": _gpu("l40s", "L40S 48GB", 46_068, 0.0, 3.125, pcie_gen=4,
                 interconnect="pcie-p2p", nic_gbps=200.0, nics=1),
    "rtx-pro-6000": _gpu("rtx-pro-6000", "RTX PRO 6000 Blackwell 96GB", 97_887, 0.0, 3.125,
                         interconnect="pcie-p2p", nic_gbps=200.0, nics=1),
    "rtx5090": _gpu("rtx5090", "GeForce RTX 5090 32GB", 32_607, 0.0, 1.5625,
                    interconnect="pcie", nic_gbps=100.0, nics=1, nic_type="roce"),
}  # fmt: skip


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


@dataclass(frozen=True)
class Node:
    """A node of `gpus_per_node` GPUs and how they talk: `interconnect` inside (nvlink, pcie
    through host memory, pcie-p2p), `intra_gbps` GB/s per GPU per direction of that link,
    `gpus_per_switch` GPUs sharing one PCIe uplink, and `nics` NICs of `nic_gbps` Gb/s line
    rate of `nic_type` (ib | roce) between nodes; `inter_gbps` (--ib-gbps), when given, is
    each GPU's share of them in GB/s per direction, efficiency included. `fabric`: measured
    collective times (an object with `time(op, size_bytes, n, scope) -> float | None`, e.g.
    plan/fabric.py's) that replace the model's where it has a figure."""

    gpu: GPU
    gpus_per_node: int = 8
    interconnect: str = "nvlink"
    intra_gbps: float = 450.0
    gpus_per_switch: int = 1
    nic_gbps: float = 400.0
    nics: int = 8
    nic_type: str = "ib"
    inter_gbps: float | None = None
    nvls: bool = False
    fabric: object = field(default=None, compare=False)  # not part of the cached model's key

    # what the step-time model reads of a GPU
    @property
    def name(self) -> str:
        return self.gpu.name

    @property
    def peak_tflops(self) -> float:
        return self.gpu.peak_tflops

    @property
    def memory_bytes(self) -> int:
        return self.gpu.memory_bytes

    @property
    def node_nic_gbps(self) -> float:
        """GB/s per direction the node's NICs deliver to NCCL, all together."""
        if self.inter_gbps is not None:
            return self.inter_gbps * self.gpus_per_node
        return self.nics * self.nic_gbps / 8 * NIC_EFFICIENCY[self.nic_type]

    @property
    def nic_share_gbps(self) -> float:
        """Each GPU's share of the node's NICs, GB/s per direction (all GPUs sending)."""
        return self.node_nic_gbps / self.gpus_per_node

    def describe(self) -> str:
        """One line: the node's link and the network, as the planner prints it."""
        inside = {"nvlink": "NVLink" + ("/NVSwitch (NVLS)" if self.nvls else ""),
                  "pcie": "PCIe via host memory (no P2P)",
                  "pcie-p2p": "PCIe P2P"}[self.interconnect]  # fmt: skip
        switch = ""
        if self.gpus_per_switch > 1:
            switch = f", {self.gpus_per_switch} GPUs per PCIe switch"
        if self.inter_gbps is not None:
            nic = f"{self.inter_gbps:g} GB/s per GPU between nodes (--ib-gbps)"
        else:
            kind = "IB" if self.nic_type == "ib" else "RoCE"
            nic = (
                f"{self.nics}× {self.nic_gbps:g} Gb/s {kind} per node at "
                f"{NIC_EFFICIENCY[self.nic_type]:.0%} = {self.nic_share_gbps:.3g} GB/s per GPU"
            )
        return (
            f"{self.gpus_per_node} GPUs/node over {inside} {self.intra_gbps:g} GB/s per GPU per "
            f"direction{switch}; {nic}"
        )


def make_node(gpu: GPU, gpus_per_node: int = 8, interconnect: str | None = None,
              intra_gbps: float | None = None, pcie_gbps: float | None = None,
              gpus_per_switch: int = 1, nic_gbps: float | None = None, nics: int | None = None,
              nic_type: str | None = None, inter_gbps: float | None = None,
              fabric=None) -> Node:  # fmt: skip
    """The node of `gpu` with its usual topology (GPU table) where an argument is None:
    `intra_gbps` is NVLink's (--nvlink-gbps), `pcie_gbps` the PCIe link's (--pcie-gbps), the
    GB/s a ring over PCIe reaches being that, times HOST_STAGING without peer-to-peer.
    A GPU whose `ib_gbps` was overridden (get_gpu(..., ib_gbps=)) keeps it as `inter_gbps`."""
    kind = interconnect or gpu.interconnect
    if kind == "nvlink":
        bw = intra_gbps if intra_gbps is not None else gpu.nvlink_gbps
    else:
        link = pcie_gbps if pcie_gbps is not None else PCIE_GBPS[gpu.pcie_gen]
        bw = link * (HOST_STAGING if kind == "pcie" else 1.0)
    base = GPUS.get(_key(gpu))
    if inter_gbps is None and base is not None and gpu.ib_gbps != base.ib_gbps:
        inter_gbps = gpu.ib_gbps  # get_gpu(..., ib_gbps=...): the old per-GPU figure
    return Node(
        gpu, gpus_per_node, kind, bw, gpus_per_switch,
        nic_gbps if nic_gbps is not None else gpu.nic_gbps,
        nics if nics is not None else (gpu.nics if gpu.nics else gpus_per_node),
        nic_type or gpu.nic_type, inter_gbps, nvls=gpu.nvls and kind == "nvlink", fabric=fabric,
    )  # fmt: skip


def _key(gpu: GPU) -> str | None:
    return next((k for k, g in GPUS.items() if g.name == gpu.name), None)


def as_node(hw, gpus_per_node: int) -> Node:
    """`hw` as a Node: a Node as given, a GPU in its usual node of `gpus_per_node` GPUs."""
    return hw if isinstance(hw, Node) else make_node(hw, gpus_per_node)


def usable_bytes(gpu, reserve_fraction: float = 0.05, reserve_bytes: int = 3 * 2**30) -> float:
    """Memory the planner lets tensors fill: total minus a fixed reserve (CUDA context, cuBLAS
    workspaces, NCCL buffers: ~3 GiB) minus a fraction for caching-allocator fragmentation."""
    return (gpu.memory_bytes - reserve_bytes) * (1 - reserve_fraction)
