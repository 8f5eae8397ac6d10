"""A model the project never saw (tests/parallel/encoder_model.py: a bidirectional encoder with
learned positions and a masked-token objective) trains through the public
`build_data_parallel` with ZeRO-1 and ZeRO-3 on tp2+SP × dp2 and matches one single-rank run
with plain torch AdamW.

Tolerances: at step 1 the weights are identical, so the loss and the grad norm differ only by
the order of a few sums (measured: loss 0, norm <= 4e-8 relative, under ATEN_CPU_CAPABILITY
default, avx2 and avx512); a missing reduction or a miscounted replica is off by 1e-1 (no SP
sum of the positions: norm 1.5e-1; TP replicas counted once each: 2.5e-1). Later steps carry
rounding that AdamW amplifies: measured <= 8e-8 (loss) and <= 3.3e-7 (norm) over the 10
steps on those three; the bounds leave over 100x for that growth on other CPUs.
"""

import os
import subprocess
import sys

import pytest

from tests.dist_harness import run_ranks
from tests.parallel import encoder_model

STEP1_TOL, LATER_LOSS_TOL, LATER_NORM_TOL = 1e-6, 1e-5, 1e-4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_public_wrapper_needs_no_config_or_trainer():
    """Importing the encoder (blocks, wrapper, engine) imports neither megatron_lite.config nor
    megatron_lite.training (a fresh interpreter: the fork server preloads the trainer)."""
    check = (
        "import sys, tests.parallel.encoder_model; "
        "bad = [m for m in sys.modules if m.startswith(('megatron_lite.config', "
        "'megatron_lite.training'))]; assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.fixture(scope="module")
def single_rank():
    return run_ranks(1, encoder_model.reference, timeout=60)[0]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_encoder_trains_through_the_public_wrapper(single_rank, zero_stage):
    ref = single_rank
    assert ref[-1][0] < ref[0][0] - 0.3, f"the encoder does not learn: {ref}"
    got = run_ranks(4, encoder_model.train, 2, zero_stage, timeout=120)[0]
    (loss1, norm1), (ref_loss1, ref_norm1) = got[0], ref[0]
    later_loss = max(_rel(g[0], r[0]) for g, r in zip(got[1:], ref[1:], strict=True))
    later_norm = max(_rel(g[1], r[1]) for g, r in zip(got[1:], ref[1:], strict=True))
    print(
        f"ZeRO-{zero_stage} tp2+SP dp2 vs one rank: step 1 loss {_rel(loss1, ref_loss1):.1e} "
        f"norm {_rel(norm1, ref_norm1):.1e}; later loss {later_loss:.1e} norm {later_norm:.1e}"
    )
    assert _rel(loss1, ref_loss1) < STEP1_TOL, f"step 1 loss {loss1} vs {ref_loss1}"
    assert _rel(norm1, ref_norm1) < STEP1_TOL, f"step 1 grad norm {norm1} vs {ref_norm1}"
    assert later_loss < LATER_LOSS_TOL, f"ZeRO-{zero_stage} losses diverge: {got} vs {ref}"
    assert later_norm < LATER_NORM_TOL, f"ZeRO-{zero_stage} grad norms diverge: {got} vs {ref}"


def _stage(first: bool, copies: int = 1, embedding: str = "embedding"):
    """A pipeline stage of a tied model: the first holds the input embedding (its parameter
    named `<embedding>.weight`), the last `copies` output weights marked as its tied copy."""
    import torch

    from megatron_lite.parallel.params import set_meta

    stage = torch.nn.Module()
    if first:
        stage.add_module(embedding, torch.nn.Embedding(8, 4))
    for i in range(0 if first else copies):
        head = torch.nn.Linear(4, 8, bias=False)
        set_meta(head.weight, full_shape=(8, 4), tied_copy=True)
        stage.add_module(f"head{i}", head)
    stage.add_module("norm", torch.nn.LayerNorm(4))
    return stage


def _refusals_on_a_mesh(rank: int, world: int) -> dict[str, str]:
    """The rules that read the mesh, on pp=2 (one data-parallel rank): each case's message on
    this rank, or "built" where the wrapper was built."""
    import torch

    from megatron_lite.parallel.data_parallel import build_data_parallel
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout

    mesh = ParallelMesh(RankLayout(world, pp=2))
    first = mesh.pp.rank == 0
    cases = {
        "tied": ([_stage(first)], dict(tie_embeddings=True)),
        "tied-unusual-values": (
            [_stage(first)],
            dict(tie_embeddings=True, zero_stage=1, betas=[0.9, 0.95], lr=1, bucket_size=7),
        ),
        "no-embedding": ([_stage(first, embedding="wte")], dict(tie_embeddings=True)),
        "copy-untied": ([_stage(first)], dict(tie_embeddings=False)),
        "two-copies": ([_stage(first, copies=2)], dict(tie_embeddings=True)),
        "shard-divides": ([_stage(first)], dict(zero_stage=1, dp_shard=2)),
    }
    # ZeRO-3's units, from layers_of (checked before any DeviceMesh is built)
    for case, layers_of in {
        "layers-ok": lambda c: [c.norm],
        "layers-not-iterable": lambda c: 5,
        "layers-strings": lambda c: {"norm": c.norm},
        "layers-foreign": lambda c: [torch.nn.Linear(2, 2)],
        "layers-chunk-itself": lambda c: [c],
        "layers-twice": lambda c: [c.norm, c.norm],
        "layers-default": None,  # chunk.layers.values(), which these chunks lack
    }.items():
        cases[case] = ([_stage(first, copies=0)], dict(zero_stage=3, layers_of=layers_of))
    out = {}
    for case, (chunks, kwargs) in cases.items():
        try:
            build_data_parallel(chunks, mesh, **kwargs)
            out[case] = "built"
        except ValueError as e:  # DataParallelArgumentError, or the default layers_of's
            out[case] = f"{type(e).__name__}: {e}"
    return out


def test_rules_that_read_the_mesh():
    """Tied embeddings over pp=2 and hybrid sharding's divisor, checked against the mesh on
    each rank; valid layouts (with unusual but valid values) still build."""
    first, last = run_ranks(2, _refusals_on_a_mesh, timeout=120)
    assert first["tied"] == last["tied"] == "built", (first, last)
    assert first["tied-unusual-values"] == last["tied-unusual-values"] == "built"
    assert "tie_embeddings=True: with pp=2 the first stage's chunk needs" in first["no-embedding"]
    assert last["no-embedding"] == "built", "the last stage holds no input embedding"
    assert first["copy-untied"] == "built", "the first stage holds no copy"
    assert (
        "tie_embeddings=False: parameter 'head0.weight' is marked tied_copy" in last["copy-untied"]
    )
    assert "holds 0 'embedding.weight' and 2 tied_copy parameters" in last["two-copies"]
    layers = {
        "layers-not-iterable": "layers_of(chunks[0])=5: must return an iterable of modules",
        "layers-strings": "layers_of(chunks[0])=['norm']: element 0 is of type str, not a Module",
        "layers-foreign": "layers_of(chunks[0])=[<Linear>]: element 0 (Linear) is not a submodule",
        "layers-chunk-itself": "layers_of(chunks[0])=[<Module>]: element 0 is the chunk itself",
        "layers-twice": "layers_of(chunks[0])=[<LayerNorm>, <LayerNorm>]: element 1 is listed",
        "layers-default": "ValueError: ZeRO-3 shards each transformer layer as one FSDP2 unit",
    }
    for got in (first, last):
        assert "DataParallelArgumentError: build_data_parallel: dp_shard=2: must divide the dp_cp "
        "group (1 ranks)" in got["shard-divides"], got
        assert got["layers-ok"] == "built", got
        for case, needle in layers.items():
            assert needle in got[case], (case, got[case])
