"""FP8 all-gather of weights under ZeRO-3 (model.fp8=tensorwise, model.fp8_all_gather; the
FSDP2 extension in parallel/data_parallel/fsdp_fp8.py): the gathered E4M3 weight and its
scale are those of the whole (un-sharded over DP and TP) weight, the bytes on the wire are
one per element, and training equals the bf16-gather FP8 run bitwise."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks
from tests.parallel.parity import LATER, STEP1_LOSS, reference_losses, rel_diffs, train_records

pytest.importorskip("torchao.float8")

E4M3 = torch.float8_e4m3fn
IN, OUT = 64, 96  # dp2 shards 48 rows (tp1) or 24 rows of a column-parallel [48, 64]


def _gathered(rank, world, tp, reduce):
    """tp × dp=world/tp ranks: one column- and one row-parallel FP8 linear, their weights
    (seeded, an outlier in one block of each) fully_shard-ed over dp with the FP8 gather.
    Returns each gathered weight's E4M3 values (as float) and scale, and the full bf16 weight."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from megatron_lite.models.fp8 import apply_fp8
    from megatron_lite.parallel.data_parallel import fsdp_fp8
    from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron_lite.parallel.params import shard

    tp_groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]
    dp_groups = [dist.new_group(list(range(i, world, tp))) for i in range(tp)]
    tp_group, dp_group = tp_groups[rank // tp], dp_groups[rank % tp]
    if not reduce:  # the wrong scale: each shard's own amax (this forked rank's module only)
        fsdp_fp8.mappings = type("NoReduce", (), {"size": staticmethod(lambda g: 1)})
    torch.manual_seed(0)
    w1, w2 = torch.randn(OUT, IN) * 0.05, torch.randn(IN, OUT) * 0.05
    w1[5, 3] = w2[60, 90] = 1.0  # outliers in one dp and tp block each: the amaxes differ
    tpg = tp_group if tp > 1 else None
    fc1 = ColumnParallelLinear(IN, OUT, tpg, bias=False)
    fc2 = RowParallelLinear(OUT, IN, tpg, bias=False)
    layers = torch.nn.ModuleList([fc1, fc2])
    apply_fp8(layers, "tensorwise", [], all_gather=True)
    with torch.no_grad():
        fc1.weight.copy_(shard(w1, fc1.weight.meta))
        fc2.weight.copy_(shard(w2, fc2.weight.meta))
    metas = [fc1.weight.meta, fc2.weight.meta]
    assert fsdp_fp8.wrap_fp8_weights(layers) == 2
    mesh = DeviceMesh.from_group(dp_group, "cpu", mesh_dim_names=("shard",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for m in layers:
        fully_shard(m, mesh=mesh, mp_policy=policy)
        m.unshard()
    out = []
    for m, full, meta in zip((fc1, fc2), (w1, w2), metas, strict=True):
        w = m.weight
        assert type(w).__name__ == "Float8TrainingTensor", type(w)
        out.append((w._data.float(), float(w._scale), full.bfloat16(), meta))
    return out


def _whole_weight_cast(full: torch.Tensor, meta) -> tuple[torch.Tensor, float]:
    """The reference, in plain torch: the whole bf16 weight's E4M3 cast with scale 448/amax
    (torchao's tensorwise formula), then this rank's TP shard of it."""
    from megatron_lite.parallel.params import shard

    scale = torch.finfo(E4M3).max / full.float().abs().max()
    q = (full.float() * scale).clamp(-448, 448).to(E4M3).float()
    return shard(q, meta), float(scale)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_fp8_gathered_weight_is_the_whole_weights_cast(tp=2):
    """tp2 × dp2 (4 ranks): the gathered E4M3 bytes and the scale equal one cast of the
    whole weight (bitwise); with each shard's own amax (no reduction over DP and TP) they do
    not: the outlier sits in one dp×tp block, so every other block's amax is smaller."""
    world = 2 * tp
    for reduce in (True, False):
        results = run_ranks(world, _gathered, tp, reduce, timeout=100)
        for rank, per_layer in enumerate(results):
            for i, (data, scale, full, meta) in enumerate(per_layer):
                ref, ref_scale = _whole_weight_cast(full, meta)
                same = scale == ref_scale and torch.equal(data, ref)
                label = f"tp{tp} rank {rank} layer {i} reduce={reduce}: scale {scale}, {ref_scale}"
                assert same == reduce, label


# TINY: 4 layers of hidden 64, 4 heads of 16, 2 KV groups, a gated MLP of 128, vocab padded to
# 256, tied embeddings. Parameters P: qkv [128, 64], proj [64, 64], fc1 [256, 64], fc2 [64, 128]
# per layer (L, all FP8 and FP8-gathered), 2 norms of 64 per layer and the final one, the
# embedding [256, 64].
L = 4 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128)
P = L + 4 * 2 * 64 + 64 + 256 * 64
DP, MICRO = 2, 2  # global batch 8 = dp 2 × 2 microbatches × 2
GATHERS = 2 * MICRO  # every unit per microbatch: in its forward, and again in its backward
Z3_FP8 = ["parallel.zero_stage=3", "model.fp8=tensorwise", "train.precision=bf16"]
STEPS = 3


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.timeout(600)
def test_zero3_fp8_all_gather_halves_the_weight_bytes_and_keeps_the_losses():
    """dp2 ZeRO-3, tensorwise FP8: with the FP8 gather the FP8 linears' weights cross the
    wire in one byte per element (the comm counter's all_gather_fsdp payload, against the
    parameter-count formula), the losses equal the bf16-gather FP8 run bitwise (the same FP8
    values: one global scale, cast before or after the gather), and both stay near one rank's
    FP8 run (fp32 reduction order only)."""
    keys = ["loss", "comm_bytes/all_gather_fsdp", "comm_bytes/fp8_amax"]
    steps = [f"train.steps={STEPS}"]
    runs = {
        flag: train_records(2, [*Z3_FP8, *steps, f"model.fp8_all_gather={flag}"], keys, 400)
        for flag in ("true", "false")
    }
    shard = GATHERS / DP  # bytes per step per byte of element: each gather sends 1/DP of it
    expected = {"false": 2 * P * shard, "true": (L + 2 * (P - L)) * shard}
    for flag, records in runs.items():
        assert len(records) == STEPS, (flag, records)
        for r in records:
            assert r["comm_bytes/all_gather_fsdp"] == expected[flag], (flag, r, expected)
    # the FP8 linears' share: L bytes per element gathered, half of bf16's 2L
    saved = (
        runs["false"][0]["comm_bytes/all_gather_fsdp"]
        - runs["true"][0]["comm_bytes/all_gather_fsdp"]
    )
    assert saved == L * shard, (saved, L * shard)
    assert "comm_bytes/fp8_amax" in runs["true"][0], "no amax all-reduce over the shards"
    fp8_gather = [r["loss"] for r in runs["true"]]
    bf16_gather = [r["loss"] for r in runs["false"]]
    assert fp8_gather == bf16_gather, f"FP8 gather {fp8_gather} vs bf16 gather {bf16_gather}"
    # the loss-parity bounds (parity.py); measured 0 on all 3 steps (2026-12-05, AVX2)
    one = reference_losses((*Z3_FP8[1:], *steps))
    d = rel_diffs(fp8_gather, list(one))
    print(f"FP8 all-gather vs one rank FP8: relative loss differences {d}")
    assert d[0] < STEP1_LOSS and max(d[1:]) < LATER, f"{fp8_gather} vs one rank {list(one)}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero3_fp8_all_gather_resumes_from_a_checkpoint(tmp_path):
    """A checkpoint written under the FP8 gather (the fp32 shards inside Fp8GatherWeight) and
    resumed under it continues the straight run: the same weights and optimizer states."""
    from tests.parallel.test_checkpoint import AT, SAVE, STEPS, ckpt, losses, train

    straight = train(2, [*Z3_FP8, *SAVE], tmp_path / "straight", timeout=400)[0]
    resumed = [*Z3_FP8, f"train.steps={STEPS}", ckpt(tmp_path / "straight")]
    got = train(2, resumed, tmp_path / "resumed", timeout=400)[0]
    assert [s for s, _, _ in got] == list(range(AT, STEPS)), "the resume did not continue at AT"
    assert losses(got) == losses(straight[AT:]), f"{losses(got)} vs {losses(straight[AT:])}"
