"""Model builders: one `ModelChunk` per virtual pipeline stage this rank owns."""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.models.gpt import GPT
from megatron_lite.models.llama import LLAMA
from megatron_lite.models.transformer import Context, ModelChunk
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import init_parameters
from megatron_lite.parallel.random import RNGStatesTracker

SPECS = {"llama": LLAMA, "gpt": GPT}


def chunk_layers(num_layers: int, pp: int, vpp: int, pp_rank: int, chunk: int) -> list[int]:
    """Global layer numbers of virtual stage chunk·pp + pp_rank (Megatron's interleaving)."""
    per_stage = num_layers // (pp * vpp)
    stage = chunk * pp + pp_rank
    return list(range(stage * per_stage, (stage + 1) * per_stage))


def build_model(
    cfg: Config, mesh: ParallelMesh, tracker: RNGStatesTracker, vocab_size: int
) -> list[ModelChunk]:
    """This rank's model chunks (vpp of them), initialized layout-independently from
    `train.seed`."""
    ctx = Context(cfg, mesh, tracker)
    pp, vpp = mesh.pp_size, cfg.parallel.vpp
    chunks = []
    for c in range(vpp):
        stage = c * pp + mesh.pp_rank
        chunk = ModelChunk(
            ctx,
            SPECS[cfg.model.arch],
            chunk_layers(cfg.model.num_layers, pp, vpp, mesh.pp_rank, c),
            vocab_size,
            pre_process=stage == 0,
            post_process=stage == pp * vpp - 1,
        )
        init_parameters(chunk, cfg.train.seed)
        chunks.append(chunk)
    return chunks
