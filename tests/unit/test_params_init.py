"""Shard-local initialization: each rank's shard equals the same slice of the layout-independent
full tensor, and drawing it touches only about a 1/tp share of the generator blocks; rows of
a shard (what FSDP2 keeps of it on one rank) are exactly those rows of the whole shard."""

import pytest
import torch

from megatron_lite.parallel import params
from megatron_lite.parallel.params import ParamMeta, full_tensor, init_shard, shard

CASES = {
    "qkv segments": ((32, 16), dict(tp_dim=0, segments=(16, 8, 8))),
    "gate/up bias": ((24,), dict(tp_dim=0, segments=(12, 12))),
    "row parallel": ((16, 12), dict(tp_dim=1)),
    "padded vocab": ((13, 16), dict(tp_dim=0, padded=16)),
    "experts": ((4, 6, 16), dict(tp_dim=0, is_expert=True)),
    "replicated": ((16,), dict()),
    "tall": ((5000, 64), dict(tp_dim=0)),
    "wide": ((64, 5000), dict(tp_dim=1)),
    "ones": ((64,), dict(init="ones", tp_dim=0)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_is_the_slice_of_the_full_tensor(case, tp):
    shape, kw = CASES[case]
    if any(s % tp for s in kw.get("segments", ())):
        pytest.skip("segments not divisible")
    for rank in range(tp):
        extra = {"tp_rank": rank, "tp_size": tp} if "tp_dim" in kw else {}
        meta = ParamMeta(shape, **kw, **extra)
        want = shard(full_tensor(meta, "w", 11), meta)
        assert torch.equal(init_shard(meta, "w", 11), want), (case, tp, rank)


@pytest.mark.parametrize("case", CASES)
def test_rows_of_a_shard_are_those_rows_of_it(case):
    shape, kw = CASES[case]
    extra = {"tp_rank": 1, "tp_size": 2} if "tp_dim" in kw else {}
    meta = ParamMeta(shape, **kw, **extra)
    whole = init_shard(meta, "w", 11)
    n = whole.shape[0]
    for rows in [(0, n), (0, 0), (n, n), (1, n - 1), (n // 3, n // 2), (n - 1, n)]:
        got = init_shard(meta, "w", 11, rows)
        assert torch.equal(got, whole[rows[0] : rows[1]]), (case, rows)


def test_a_shard_draws_only_its_blocks(monkeypatch):
    drawn = []
    real = torch.randn

    def counting(*shape, **kw):
        out = real(*shape, **kw)
        drawn.append(out.numel())
        return out

    monkeypatch.setattr(params.torch, "randn", counting)
    for dim, shape in ((0, (8192, 256)), (1, (256, 8192))):
        full = ParamMeta(shape, tp_dim=dim, tp_rank=0, tp_size=1)
        drawn.clear()
        init_shard(full, "w", 0)
        everything = sum(drawn)
        drawn.clear()
        init_shard(ParamMeta(shape, tp_dim=dim, tp_rank=3, tp_size=8), "w", 0)
        assert sum(drawn) <= everything / 8 + params.BLOCK_ELEMENTS, (dim, sum(drawn))


@pytest.mark.parametrize("case", ["padded vocab", "row parallel", "qkv segments", "tall"])
def test_drawing_into_a_parameter_writes_the_shard_block_by_block(case):
    """init_shard(out=...) gives the same values as the returned shard, in the parameter's
    own dtype, and init_parameters holds at most two generator blocks beyond the parameter
    (a returned fp32 shard and its cat would be two fp32 copies of it)."""
    from megatron_lite.training.memory_tracker import MemoryTracker

    shape, kw = CASES[case]
    for dtype in (torch.float32, torch.bfloat16):
        meta = ParamMeta(shape, tp_rank=1, tp_size=2, **kw) if "tp_dim" in kw else None
        meta = meta or ParamMeta(shape, **kw)
        want = init_shard(meta, "w", 3).to(dtype)
        with MemoryTracker() as tracker:  # the parameter made inside it: counted from the start
            module = torch.nn.Module()
            module.w = torch.nn.Parameter(torch.empty(want.shape, dtype=dtype))
            module.w.meta = meta
            before = tracker.total
            tracker.reset_peak()
            params.init_parameters(module, 3)
            extra = tracker.peak.total - before
        assert torch.equal(module.w.detach(), want), (case, dtype)
        step = params._block_length(meta.full_shape, meta.tp_dim or 0)
        block = (
            4 * step * (torch.Size(meta.full_shape).numel() // meta.full_shape[meta.tp_dim or 0])
        )
        assert extra <= 2 * block, f"{case} {dtype}: {extra} bytes beyond the parameter"
