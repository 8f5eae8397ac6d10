"""Evaluator alone (no Trainer, no Config): a plain torch language model's validation loss on
one rank, against torch's mean cross-entropy over the same samples in one batch."""

import pytest
import torch

from tests.dist_harness import run_ranks

V, H, S = 32, 16, 10  # vocabulary, hidden, sequence
EOD = 4  # data.eod_mask_loss: the label after an EOD input does not count
GBS, MBS, ITERS = 6, 2, 3


class _Samples:
    """A validation set: sample i is token ids [S + 1] (what the sampler indexes)."""

    def __init__(self, n: int):
        self.data = torch.randint(0, V, (n, S + 1), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(V, H), torch.nn.Linear(H, V))


def _evaluate(rank, world):
    from megatron_lite.data.sampler import split_sample
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.training.evaluation import Evaluator

    model, calls = _model(), []

    def forward(micro):  # the loss summed over the microbatches' tokens that count
        calls.append(len(micro))
        total = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for mb in micro:
                tokens, labels = split_sample(mb, EOD)
                logits = model(tokens).flatten(0, 1)
                total += torch.nn.functional.cross_entropy(
                    logits, labels.flatten(), ignore_index=-100, reduction="sum"
                )
        return total

    after = []
    dataset = _Samples(GBS * ITERS + 5)  # more samples than evaluated: only the first are read
    evaluator = Evaluator(
        dataset, forward, ParallelMesh(RankLayout(world)), iters=ITERS, global_batch_size=GBS,
        micro_batch_size=MBS, holds_loss=True, device=torch.device("cpu"), eod_mask_id=EOD,
        after=lambda: after.append(True),
    )  # fmt: skip
    first, second = evaluator(), evaluator()
    return first, second, calls, after, dataset.data


def test_validation_loss_is_the_token_weighted_mean_of_the_first_batches():
    first, second, calls, after, data = run_ranks(1, _evaluate, timeout=60)[0]
    assert calls == [GBS // MBS] * ITERS * 2, "one forward per global batch, its microbatches"
    assert after == [True, True], "after() runs at the end of each evaluation"
    assert first == second, "the same batches every time"
    batch = data[: GBS * ITERS]  # the first ITERS global batches, in one batch
    tokens, labels = batch[:, :-1], batch[:, 1:].clone()
    labels[tokens == EOD] = -100
    assert (labels == -100).any(), "the test should mask some labels"
    with torch.no_grad():
        logits = _model()(tokens).flatten(0, 1)
        want = torch.nn.functional.cross_entropy(logits, labels.flatten()).item()  # the mean
    assert first == pytest.approx(want, rel=1e-6)
