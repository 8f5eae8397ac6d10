"""Cross-entropy (single rank and vocab-parallel on 2 ranks) vs F.cross_entropy on the full
vocabulary: per-token loss, grad logits, ignore_index, -inf padded columns."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.kernels import cross_entropy
from tests.dist_harness import run_ranks
from tests.kernels.helpers import DEVICE, check_close, dtype_params
from tests.kernels.vocab_parallel_worker import IGNORE, vocab_parallel_rank

# the package exports the function `cross_entropy`, which shadows the submodule's attribute name
ce_module = importlib.import_module("megatron_lite.kernels.cross_entropy")


def make_problem(n, vocab, n_pad=0, dtype=torch.float32, seed=None):
    """Random logits [n, vocab] whose last n_pad columns are -inf, and targets [n] that hit the
    first and last real column and include two ignored tokens."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    logits = torch.randn(n, vocab, generator=gen) * 3.0
    logits[:, vocab - n_pad :] = float("-inf")
    target = torch.randint(0, vocab - n_pad, (n,), generator=gen)
    target[0], target[-1] = 0, vocab - n_pad - 1
    if n >= 4:
        target[1], target[n // 2] = IGNORE, IGNORE
    return logits.to(dtype), target


def full_vocab_reference(logits, target, dloss):
    """F.cross_entropy in fp32 on the whole vocabulary: (loss [n], dlogits [n, V])."""
    x = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(x, target, ignore_index=IGNORE, reduction="none")
    (dlogits,) = torch.autograd.grad(loss, x, dloss)
    return loss.detach(), dlogits


@pytest.fixture
def small_blocks(monkeypatch):
    """16-wide vocab chunks, so every row spans several online-softmax steps plus a tail."""
    monkeypatch.setattr(ce_module, "BLOCK_V", 16)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("n,vocab,n_pad", [(1, 5, 0), (6, 37, 3), (9, 130, 0), (5, 64, 20)])
def test_cross_entropy(triton_backend, poisoned_empty, small_blocks, n, vocab, n_pad, dtype):
    logits, target = make_problem(n, vocab, n_pad, dtype)
    logits, target = logits.to(DEVICE).requires_grad_(), target.to(DEVICE)
    dloss = torch.randn(n, device=DEVICE)
    loss = cross_entropy(logits, target, ignore_index=IGNORE)
    (dlogits,) = torch.autograd.grad(loss, logits, dloss)
    want_loss, want_dlogits = full_vocab_reference(logits, target, dloss)
    assert loss.dtype == torch.float32 and dlogits.dtype == dtype
    check_close("loss", loss, want_loss, torch.float32)  # fp32 math on the same inputs
    check_close("dlogits", dlogits, want_dlogits, dtype)
    ignored = target == IGNORE
    assert (loss[ignored] == 0).all() and (dlogits[ignored] == 0).all()


def test_cross_entropy_leading_dims_and_sum_backward(triton_backend, small_blocks):
    """[b, s, V] logits, [b, s] targets; loss.sum().backward() hands in a stride-0 dloss."""
    logits, target = make_problem(2 * 7, 40, n_pad=4)
    logits = logits.to(DEVICE).view(2, 7, 40).requires_grad_()
    target = target.to(DEVICE).view(2, 7)
    loss = cross_entropy(logits, target, ignore_index=IGNORE)
    assert loss.shape == (2, 7)
    loss.sum().backward()
    want_loss, want_dlogits = full_vocab_reference(
        logits.view(14, 40), target.view(14), torch.ones(14, device=DEVICE)
    )
    check_close("loss", loss.view(14), want_loss, torch.float32)
    check_close("dlogits", logits.grad.view(14, 40), want_dlogits, torch.float32)


def test_cross_entropy_strided_logits(triton_backend, poisoned_empty, small_blocks):
    """Logits sliced out of a wider buffer (row stride != V) are read in place."""
    wide, target = make_problem(5, 50)
    logits = wide.to(DEVICE)[:, 7:44].requires_grad_()  # 37 columns, row stride 50
    target = target.clamp(max=36).to(DEVICE)
    dloss = torch.randn(5, device=DEVICE)
    loss = cross_entropy(logits, target, ignore_index=IGNORE)
    (dlogits,) = torch.autograd.grad(loss, logits, dloss)
    want_loss, want_dlogits = full_vocab_reference(logits, target, dloss)
    check_close("loss", loss, want_loss, torch.float32)
    check_close("dlogits", dlogits, want_dlogits, torch.float32)


def test_cross_entropy_shard_entirely_padding(triton_backend, small_blocks):
    """A row whose first blocks are all -inf must not produce NaN (guarded online max)."""
    logits, target = make_problem(4, 50, n_pad=0)
    logits[:, :33] = float("-inf")  # the first two 16-wide blocks and one more column
    target[:] = torch.tensor([33, 49, 40, IGNORE])
    logits, target = logits.to(DEVICE).requires_grad_(), target.to(DEVICE)
    loss = cross_entropy(logits, target, ignore_index=IGNORE)
    (dlogits,) = torch.autograd.grad(loss.sum(), logits)
    want_loss, want_dlogits = full_vocab_reference(logits, target, torch.ones(4, device=DEVICE))
    check_close("loss", loss, want_loss, torch.float32)
    check_close("dlogits", dlogits, want_dlogits, torch.float32)


def test_torch_path_matches_full_vocab(monkeypatch):
    monkeypatch.setenv("MEGATRON_LITE_KERNELS", "torch")
    logits, target = make_problem(8, 33, n_pad=5)
    logits.requires_grad_()
    dloss = torch.randn(8)
    loss = cross_entropy(logits, target, ignore_index=IGNORE)
    (dlogits,) = torch.autograd.grad(loss, logits, dloss)
    want_loss, want_dlogits = full_vocab_reference(logits, target, dloss)
    check_close("loss", loss, want_loss, torch.float32)
    check_close("dlogits", dlogits, want_dlogits, torch.float32)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_vocab_parallel_two_ranks(backend):
    """2 ranks, vocab 2·13 with the last 3 columns -inf padding and ignored tokens: per-token
    loss equals the full-vocab loss on both ranks, the gradient shards concatenate to the full
    gradient, and only 3 floats per token cross ranks (max, sum-exp, target logit)."""
    n, world = 7, 2
    logits, target = make_problem(n, 2 * 13, n_pad=3, seed=7)
    dloss = torch.randn(n)
    results = run_ranks(world, vocab_parallel_rank, backend, logits, target, dloss, timeout=60)
    want_loss, want_dlogits = full_vocab_reference(logits, target, dloss)
    for rank, (loss, _, fwd_elems, bwd_elems) in enumerate(results):
        check_close(f"loss on rank {rank}", torch.tensor(loss), want_loss, torch.float32)
        assert fwd_elems == 3 * n, f"rank {rank} all-reduced {fwd_elems} elements, want {3 * n}"
        assert bwd_elems == 0, f"rank {rank}: the backward must not communicate"
    dlogits = torch.cat([torch.tensor(r[1]) for r in results], dim=1)
    check_close("dlogits (shards concatenated)", dlogits, want_dlogits, torch.float32)


def test_fp64_logits_give_fp64_loss(monkeypatch):
    """fp64 (parity tests) goes through the torch path at full precision."""
    monkeypatch.delenv("MEGATRON_LITE_KERNELS", raising=False)
    logits, target = make_problem(6, 29, n_pad=2)
    logits = logits.double().requires_grad_()
    loss = cross_entropy(logits, target, ignore_index=IGNORE)
    want = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="none")
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, want, atol=1e-13, rtol=1e-13)
