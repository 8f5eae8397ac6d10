"""Model builders: one `ModelChunk` per virtual pipeline stage this rank owns, each built from
the architecture registry's entry of `model.arch` (registry.py; llama.py and gpt.py register
the shipped ones when this package is imported).

The layers (chunk.py, transformer.py, transformer_config.py) load on first use, so that config
validation and the planner, which read the registry in every CLI process, do not load them (and
with them DTensor and the kernels).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

# the shipped architectures register in this order (validation's messages list them so)
# isort: off
from megatron_lite.models import llama  # noqa: F401
from megatron_lite.models import gpt  # noqa: F401

# isort: on
from megatron_lite.lazy import lazy_exports
from megatron_lite.models.registry import (
    ArchitectureSpec,
    architecture_names,
    get_architecture,
    register_architecture,
)

if TYPE_CHECKING:
    import torch

    from megatron_lite.config import Config
    from megatron_lite.models.chunk import ModelChunk
    from megatron_lite.models.transformer import build_layer
    from megatron_lite.models.transformer_config import TransformerConfig
    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.parallel.random import RNGStatesTracker

# name -> module: loaded on first use (module docstring)
_EXPORTS = {
    "ModelChunk": "chunk",
    "TransformerConfig": "transformer_config",
    "build_layer": "transformer",
}
__all__ = [
    "ArchitectureSpec", "ModelChunk", "TransformerConfig", "architecture_names", "build_layer",
    "build_model", "chunk_layers", "get_architecture", "init_parameters", "register_architecture",
]  # fmt: skip


__getattr__ = lazy_exports(__name__, _EXPORTS)


def init_parameters(module: torch.nn.Module, seed: int) -> None:
    """parallel.params.init_parameters, which build_model calls by this name."""
    from megatron_lite.parallel.params import init_parameters as draw

    draw(module, seed)


def chunk_layers(
    stage_layers: list[int], pp: int, pp_rank: int, chunk: int, placement: str = "loop"
) -> list[int]:
    """Global layer numbers of local `chunk` on `pp_rank`: virtual stage chunk·pp + pp_rank
    (Megatron's interleaving; under the V placement of zb-v, pp_rank or 2·pp − 1 − pp_rank)
    holds the next stage_layers[stage] layers."""
    from megatron_lite.pipeline.schedules import virtual_stage

    stage = virtual_stage(pp_rank, chunk, pp, placement)
    start = sum(stage_layers[:stage])
    return list(range(start, start + stage_layers[stage]))


def build_model(
    cfg: Config,
    mesh: ParallelMesh,
    tracker: RNGStatesTracker,
    vocab_size: int,
    init: bool = True,
    device: torch.device | str = "cpu",
) -> list[ModelChunk]:
    """This rank's model chunks (vpp of them) on `device`, initialized layout-independently
    from `train.seed`. init=False: built on the meta device, then given uninitialized storage
    on `device` (nothing drawn, nothing allocated elsewhere), for weights that a checkpoint or
    a later init_parameters fills; with device="meta" left without storage (ZeRO-3 shards it
    there first), buffers included (`ModelChunk.init_buffers(device)` recomputes them)."""
    import torch

    from megatron_lite.models.chunk import ModelChunk
    from megatron_lite.models.transformer_config import TransformerConfig
    from megatron_lite.parallel import fake
    from megatron_lite.parallel.params import materialize
    from megatron_lite.pipeline.schedules import schedule_placement, virtual_stage
    from megatron_lite.resolve import stage_layers

    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
    config = TransformerConfig.from_config(cfg, mesh.layout.world_size)
    pp, vpp = mesh.pp.size, cfg.parallel.vpp
    placement = schedule_placement(cfg.parallel.pipeline_schedule, vpp)
    split = stage_layers(cfg.model, cfg.parallel)
    chunks = []
    # init=False builds on meta and gives the parameters storage after; a dry run's fake
    # tensors have no storage to give, so they are built on `device` at once
    build_on = device if fake.active() else "meta"
    for c in range(vpp):
        stage = virtual_stage(mesh.pp.rank, c, pp, placement)
        with contextlib.nullcontext() if init else torch.device(build_on):
            chunk = ModelChunk(
                config,
                mesh,
                tracker,
                chunk_layers(split, pp, mesh.pp.rank, c, placement),
                pre_process=stage == 0,
                post_process=stage == pp * vpp - 1,
            )
        if init:
            chunk.to(device)
            init_parameters(chunk, cfg.train.seed)
        elif torch.device(device).type != "meta" and build_on == "meta":
            materialize(chunk, torch.device(device))
            chunk.init_buffers(torch.device(device))
        chunks.append(chunk)
    return chunks
