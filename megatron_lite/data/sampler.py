"""Which samples each data-parallel rank trains on at a given step.

The data position is the number of samples consumed so far (Megatron's
consumed_train_samples): a step with global batch G takes samples [c, c + G) of the (infinite,
seeded) dataset and moves c to c + G. The count stored in a checkpoint is all the training state
the data pipeline has, so a resume continues with exactly the samples an uninterrupted run would
have seen next, whatever the parallel layout and even with another global batch size.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_lite.parallel.cross_entropy import IGNORE_INDEX


def microbatches_for_step(
    dataset,
    step: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> list[torch.Tensor]:
    """This dp rank's microbatches of step `step` of a run whose global batch never changed:
    `microbatches_at(dataset, step · G, ...)`."""
    if step < 0:
        raise ValueError(f"need step >= 0, got step={step}")
    first = step * global_batch_size
    return microbatches_at(dataset, first, global_batch_size, micro_batch_size, dp_rank, dp_size)


def microbatches_at(
    dataset,
    consumed_samples: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> list[torch.Tensor]:
    """This dp rank's microbatches of the global batch [c, c + G), c = consumed_samples.

    Rank r takes the contiguous slice [c + r·G/dp, c + (r+1)·G/dp) and splits it into
    G/(dp·micro_batch_size) microbatches, each a torch.LongTensor [micro_batch_size,
    seq_length+1] (inputs and labels: `split_sample`). Concatenating every rank's microbatches
    in rank order gives the dp_size=1 result.
    """
    if consumed_samples < 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(
            f"need consumed_samples >= 0 and 0 <= dp_rank < dp_size, got "
            f"consumed_samples={consumed_samples}, dp_rank={dp_rank}, dp_size={dp_size}"
        )
    if micro_batch_size < 1 or global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"train.global_batch_size={global_batch_size} must be a positive "
            f"multiple of train.micro_batch_size·dp = {micro_batch_size}·{dp_size}"
        )
    per_rank = global_batch_size // dp_size
    first = consumed_samples + dp_rank * per_rank
    batches = []
    for m in range(per_rank // micro_batch_size):
        start = first + m * micro_batch_size
        samples = [dataset[i] for i in range(start, start + micro_batch_size)]
        batches.append(torch.from_numpy(np.stack(samples).astype(np.int64, copy=False)))
    return batches


def split_sample(
    sample: torch.Tensor, eod_mask_id: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sample contract: token ids [b, s + 1] -> (inputs [b, s], labels [b, s]), the labels
    being the inputs shifted by one token. With `eod_mask_id` (data.eod_mask_loss: resolve's
    eod_mask_id) the label after each EOD input, the next document's first token, is
    IGNORE_INDEX: no loss there, and the token count of the mean leaves it out."""
    inputs, labels = sample[:, :-1], sample[:, 1:]
    if eod_mask_id is not None:
        labels = labels.masked_fill(inputs == eod_mask_id, IGNORE_INDEX)
    return inputs, labels
