"""Model builders: one `ModelChunk` per virtual pipeline stage this rank owns."""

from __future__ import annotations

import dataclasses

from megatron_lite.config import Config
from megatron_lite.models.chunk import ModelChunk
from megatron_lite.models.transformer_config import SPECS, TransformerConfig
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import init_parameters
from megatron_lite.parallel.random import RNGStatesTracker
from megatron_lite.pipeline.schedules import virtual_stage

__all__ = ["SPECS", "ModelChunk", "TransformerConfig", "build_model", "chunk_layers"]


def chunk_layers(num_layers: int, pp: int, vpp: int, pp_rank: int, chunk: int) -> list[int]:
    """Global layer numbers of local `chunk` on `pp_rank` (Megatron's interleaving: virtual
    stage chunk·pp + pp_rank holds the stage-th block of num_layers/(pp·vpp) layers)."""
    per_stage = num_layers // (pp * vpp)
    stage = virtual_stage(pp_rank, chunk, pp)
    return list(range(stage * per_stage, (stage + 1) * per_stage))


def build_model(
    cfg: Config, mesh: ParallelMesh, tracker: RNGStatesTracker, vocab_size: int
) -> list[ModelChunk]:
    """This rank's model chunks (vpp of them), initialized layout-independently from
    `train.seed`."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
    config = TransformerConfig.from_config(cfg, mesh.layout.world_size)
    pp, vpp = mesh.pp.size, cfg.parallel.vpp
    chunks = []
    for c in range(vpp):
        stage = virtual_stage(mesh.pp.rank, c, pp)
        chunk = ModelChunk(
            config,
            mesh,
            tracker,
            chunk_layers(config.num_layers, pp, vpp, mesh.pp.rank, c),
            pre_process=stage == 0,
            post_process=stage == pp * vpp - 1,
        )
        init_parameters(chunk, cfg.train.seed)
        chunks.append(chunk)
    return chunks
