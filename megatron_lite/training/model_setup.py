"""What a rank sets up before it trains: its device, a check of its pipeline and ring links,
and its model chunks with their data-parallel wrapper and optimizer (Megatron's
`setup_model_and_optimizer`), weights not yet drawn."""

from __future__ import annotations

import torch

from megatron_lite import resolve
from megatron_lite.config import Config
from megatron_lite.models import build_model
from megatron_lite.parallel import fake
from megatron_lite.parallel.data_parallel import DataParallelWrapper
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.random import RNGStatesTracker
from megatron_lite.pipeline.p2p import warm_up
from megatron_lite.training.optimizer import build_data_parallel


def setup_model_and_optimizer(
    cfg: Config,
    mesh: ParallelMesh,
    tracker: RNGStatesTracker,
    vocab_size: int,
    device: torch.device,
) -> tuple[list[torch.nn.Module], DataParallelWrapper]:
    """This rank's model chunks and their DataParallelWrapper (with the optimizer), weights
    not drawn: built on the meta device and given uninitialized storage on `device` (ZeRO-3:
    only this rank's FSDP2 shards, so no rank holds its whole TP-local model), for a checkpoint
    or `parallel.params.init_parameters` to fill. train.precision=bf16 makes the trained
    weights bf16 (the fp32 masters live in the optimizer; untrained state such as the MoE expert
    bias stays fp32)."""
    zero3 = cfg.parallel.zero_stage == 3
    where = torch.device("meta") if zero3 else device
    chunks = build_model(cfg, mesh, tracker, vocab_size, init=False, device=where)
    if cfg.train.precision == "bf16":
        for c in chunks:
            for p in c.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
    # before the wrappers, so their hooks see the compiled regions; a dry run (fake tensors)
    # measures the eager step
    if cfg.model.compile and not fake.active():
        from megatron_lite.models.compile import compile_chunks
        from megatron_lite.pipeline.registry import splits_backward

        p = cfg.parallel
        split = p.pp > 1 and splits_backward(p.pipeline_schedule, p.vpp)
        compile_chunks(chunks, cfg.model.compile_mode, split_wgrad=split)
    dp = build_data_parallel(chunks, mesh, cfg, device)  # ZeRO-3: new parameters
    for c in chunks if zero3 else []:  # RoPE tables, vocabulary mask: built on meta
        c.init_buffers(device)
    return chunks, dp


def rank_device() -> torch.device:
    """This rank's GPU (train.py set it), or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_links(cfg: Config, mesh: ParallelMesh, device: torch.device) -> None:
    """Before anything else: a broken pipeline or ring link (NCCL/P2P set-up, a missing rank)
    fails here with a P2PError naming rank and peer, not in step 1; a mesh built for another
    CP type is refused."""
    p = cfg.parallel
    warm_up(mesh.pp.group, device, p.timeout_s)
    a2a = resolve.cp_a2a_size(p)
    if mesh.cp_a2a.size != a2a:
        raise ValueError(
            f"parallel.cp_comm_type={p.cp_comm_type}: the mesh's Ulysses groups have "
            f"{mesh.cp_a2a.size} ranks, the config needs {a2a}; "
            "build it with megatron_lite.resolve.rank_layout(cfg.parallel, world)"
        )
    warm_up(mesh.cp_ring.group, device, p.timeout_s, axis="cp")
