"""Which samples each data-parallel rank trains on at a given step.

The data position is the step number alone: the global batch of step k is samples
[k·G, (k+1)·G) of the (infinite, seeded) dataset, so the step stored in a checkpoint is all
the training state the data pipeline has, and resuming at step k continues with exactly the
batches an uninterrupted run would have seen, whatever the parallel layout.
"""

from __future__ import annotations

import numpy as np
import torch


def microbatches_for_step(
    dataset,
    step: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> list[torch.Tensor]:
    """This dp rank's microbatches of step `step`, in order.

    Rank r takes the contiguous slice [r·G/dp, (r+1)·G/dp) of the step's global batch
    [step·G, (step+1)·G) and splits it into G/(dp·micro_batch_size) microbatches, each a
    torch.LongTensor [micro_batch_size, seq_length+1] (inputs are [:, :-1], labels [:, 1:]).
    Concatenating every rank's microbatches in rank order gives the dp_size=1 result.
    """
    if step < 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(
            f"need step >= 0 and 0 <= dp_rank < dp_size, got step={step}, "
            f"dp_rank={dp_rank}, dp_size={dp_size}"
        )
    if micro_batch_size < 1 or global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"train.global_batch_size={global_batch_size} must be a positive "
            f"multiple of train.micro_batch_size·dp = {micro_batch_size}·{dp_size}"
        )
    per_rank = global_batch_size // dp_size
    first = step * global_batch_size + dp_rank * per_rank
    batches = []
    for m in range(per_rank // micro_batch_size):
        start = first + m * micro_batch_size
        samples = [dataset[i] for i in range(start, start + micro_batch_size)]
        batches.append(torch.from_numpy(np.stack(samples).astype(np.int64, copy=False)))
    return batches


def split_sample(sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sample contract: token ids [b, s + 1] -> (inputs [b, s], labels [b, s]), the labels
    being the inputs shifted by one token."""
    return sample[:, :-1], sample[:, 1:]
