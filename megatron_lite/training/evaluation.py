"""Evaluation (Megatron's `evaluate`): the validation loss, forward only.

`Evaluator` is built from the validation dataset, a `forward(microbatches) -> loss sum`
callable (the trainer's: the pipeline engine with forward_only=True; any model's will do), the
mesh and the batch sizes: no Config, no Trainer. It reads the first `iters` global batches of
the validation set (the same batches every time, so evaluations compare), each dp rank its
slice (data.sampler.microbatches_at), and returns the token-weighted mean of the loss over all
of them: Σ loss / Σ labels that count (not IGNORE_INDEX), one all-reduce of the two sums at the
end. The training samples and RNG states are not touched; `after()` runs last (the trainer
drops the MoE layers' routing statistics there). tests/unit/test_evaluation.py checks it against
plain torch's mean cross-entropy over the same samples.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_lite.data.sampler import microbatches_at, split_sample
from megatron_lite.parallel import mappings
from megatron_lite.parallel.cross_entropy import IGNORE_INDEX
from megatron_lite.parallel.mesh import ParallelMesh


class Evaluator:
    """forward(microbatches [b, s + 1] each) -> this rank's loss summed over their tokens (on
    the loss stage; ignored elsewhere); holds_loss: this rank runs the last virtual stage;
    eod_mask_id: split_sample's (data.eod_mask_loss)."""

    def __init__(
        self,
        dataset,
        forward: Callable[[list[torch.Tensor]], torch.Tensor],
        mesh: ParallelMesh,
        *,
        iters: int,
        global_batch_size: int,
        micro_batch_size: int,
        holds_loss: bool,
        device: torch.device,
        eod_mask_id: int | None = None,
        after: Callable[[], None] | None = None,
    ):
        self.dataset, self.forward, self.mesh, self.device = dataset, forward, mesh, device
        self.iters, self.holds_loss, self.eod_mask_id = iters, holds_loss, eod_mask_id
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.after = after

    def __call__(self) -> float:
        """The validation loss (module docstring); a collective over the world."""
        mesh, gbs = self.mesh, self.global_batch_size
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss sum, tokens]
        owner = self.holds_loss and mesh.tp.rank == 0
        for it in range(self.iters):
            batches = microbatches_at(
                self.dataset, it * gbs, gbs, self.micro_batch_size, mesh.dp.rank, mesh.dp.size
            )
            micro = [mb.to(self.device) for mb in batches]
            loss = self.forward(micro)
            if owner:
                sums[0] += loss.double().reshape(())
            if mesh.tp.rank == 0 and mesh.cp.rank == 0 and self.holds_loss:
                for mb in micro:  # each dp rank's tokens once; summed on the device
                    sums[1] += (split_sample(mb, self.eod_mask_id)[1] != IGNORE_INDEX).sum()
        mappings.all_reduce(sums, dist.group.WORLD, kind="all_reduce_eval")
        if self.after is not None:
            self.after()
        return sums[0].item() / sums[1].item()
