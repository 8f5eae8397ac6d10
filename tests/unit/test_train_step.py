"""TrainStep alone (no Trainer, no Config): a plain torch language model on one rank, stepped
through the pipeline engine and the data-parallel wrapper, against the same model trained by
hand with torch's mean cross-entropy, clip_grad_norm_ and torch.optim.AdamW; and the
non-finite guard's skip, which leaves the weights as they were."""

import math

import pytest
import torch

from tests.dist_harness import run_ranks

V, H, S, B, M = 32, 16, 12, 2, 3  # vocabulary, hidden, sequence, micro batch, microbatches
EOD = 5  # the label after an EOD input is masked (data.eod_mask_loss)
LR, BETAS, EPS, WD, CLIP = 1e-2, (0.9, 0.95), 1e-8, 0.1, 0.5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(V, H), torch.nn.LayerNorm(H),
                               torch.nn.Linear(H, V))  # fmt: skip


def _batches(step: int) -> list[torch.Tensor]:
    """M microbatches [B, S + 1] of token ids, with EOD tokens among them."""
    g = torch.Generator().manual_seed(100 + step)
    return list(torch.randint(0, V, (M * B, S + 1), generator=g).split(B))


def _forward_step(chunk, sample, _input):
    """The engine's forward step: the loss summed over the tokens that count."""
    from megatron_lite.data.sampler import split_sample
    from megatron_lite.parallel.cross_entropy import IGNORE_INDEX

    tokens, labels = split_sample(sample, EOD)
    logits = chunk(tokens)  # [b, s, V]
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _reference(steps: int) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """The same training written with torch alone: losses, norms, final weights."""
    model = _model()
    decay = [p for p in model.parameters() if p.dim() >= 2]  # AdamW's decay: matrices only
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)  # fmt: skip
    losses, norms = [], []
    for step in range(steps):
        batch = torch.cat(_batches(step))
        tokens, labels = batch[:, :-1], batch[:, 1:].clone()
        labels[tokens == EOD] = -100  # torch's default ignore_index
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, [p.detach().clone() for p in model.parameters()]


def _train_step(rank, world, steps, poison):
    from megatron_lite.parallel.data_parallel import build_data_parallel
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.training.nonfinite import NonFiniteGuard
    from megatron_lite.training.step import PipelineArgs, TrainStep

    mesh = ParallelMesh(RankLayout(world))
    model = _model()
    dp = build_data_parallel([model], mesh, zero_stage=0, lr=LR, betas=BETAS, eps=EPS,
                             weight_decay=WD)  # fmt: skip
    dp.optimizer.sync_masters_from_params()
    step_fn = TrainStep(
        [model], dp, mesh, _forward_step,
        PipelineArgs(tensor_shape=(S, B, H), dtype=torch.float32, schedule="1f1b", timeout_s=60),
        torch.device("cpu"), holds_loss=True, eod_mask_id=EOD, grad_clip=CLIP,
        guard=NonFiniteGuard(skip_limit=1), named_params=list(model.named_parameters()),
    )  # fmt: skip
    out, flags = [], []
    for step in range(steps):
        micro = _batches(step)
        if poison == step:
            with torch.no_grad():
                model[1].weight[0] = float("nan")  # the norm's weight: a NaN loss and gradient
            before = [p.detach().clone() for p in model.parameters()]
        result = step_fn.run(micro, LR, step, flags=lambda: [1.0, 0.0])
        out.append((result.loss, result.grad_norm, result.skipped))
        flags.append(result.flags)
        if poison == step:
            after = model.parameters()
            same = all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
                       for a, b in zip(before, after, strict=True))  # fmt: skip
            return out, flags, same
    return out, flags, [p.detach().clone() for p in model.parameters()]


def test_steps_match_torch_adamw_with_clipping():
    """Two steps: the token-weighted loss, the gradient norm before clipping, and the
    weights after clipping and AdamW, each as plain torch computes them."""
    ref_losses, ref_norms, ref_weights = _reference(2)
    out, flags, weights = run_ranks(1, _train_step, 2, None, timeout=90)[0]
    for step, ((loss, norm, skipped), rl, rn) in enumerate(
        zip(out, ref_losses, ref_norms, strict=True)
    ):
        assert skipped is None
        assert loss == pytest.approx(rl, rel=1e-6), (step, loss, rl)
        assert norm == pytest.approx(rn, rel=1e-5), (step, norm, rn)
        assert rn > CLIP, "the test should exercise clipping"
    assert flags == [[1.0, 0.0], [1.0, 0.0]], "flags are summed over the (one-rank) world"
    for got, want in zip(weights, ref_weights, strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()


def test_nonfinite_step_is_skipped_and_leaves_the_weights():
    out, _, same = run_ranks(1, _train_step, 2, 1, timeout=90)[0]
    assert out[0][2] is None and math.isfinite(out[0][0])
    loss, norm, skipped = out[1]
    assert not math.isfinite(loss) and not math.isfinite(norm)
    assert skipped is not None and "step 2" in skipped and "step skipped" in skipped, skipped
    # named by the parameters' names (the guard lists the first three, in backward order)
    assert "non-finite gradient in 2.bias on rank 0; 2.weight on rank 0" in skipped, skipped
    assert same, "a skipped step must not update the weights"
