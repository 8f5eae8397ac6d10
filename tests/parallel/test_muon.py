"""train.optimizer=muon on one rank against torch: the encoder of tests/parallel/encoder_model.py
through `build_data_parallel(optimizer="muon")` (ZeRO-0, split_fused=false so each parameter is
one matrix as torch sees it) against a copy stepped by torch.optim.Muon (match_rms_adamw) on
the matrices the spec gives Muon plus torch.optim.AdamW on the others (decay on matrices, none
on vectors), and with muon_ns_dtype=fp32 against a float64 Muon written from the published
algorithm (tests/unit/test_muon.py's muon64_step). Layouts against one rank: test_muon_parity.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.parallel import encoder_model as enc
from tests.parallel.parity import STEP1_GRAD_NORM, STEP1_LOSS
from tests.unit.test_muon import UPDATE_TOL, muon64_step

LR, MOMENTUM = 1e-2, 0.95
# what the spec's default muon_params (attention, mlp, experts, hidden) pick in the encoder:
# its blocks' matrices, the learned positions and the vocabulary head (named "head", not
# output_layer, so "hidden"); the word embedding and every vector go to AdamW
MUON_NAMES = {"positions", "head.weight"} | {
    f"blocks.{i}.{m}.weight" for i in range(enc.LAYERS) for m in ("qkv", "proj", "fc1", "fc2")
}


def _models():
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.parallel.params import init_parameters

    torch.manual_seed(0)
    mesh = ParallelMesh(RankLayout(1, tp=1))
    ours, ref = enc.Encoder(mesh), enc.Encoder(mesh)
    init_parameters(ours, seed=11)
    init_parameters(ref, seed=11)
    return mesh, ours, ref


def _clip(params) -> float:
    """The gradient norm, and the gradients clipped to MAX_NORM as the wrapper clips them."""
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in params])
    ).item()
    if norm > enc.MAX_NORM:
        for p in params:
            p.grad.mul_(enc.MAX_NORM / (norm + 1e-6))
    return norm


def _torch_step(named: dict, ns: str):
    """The reference's step function: torch.optim.Muon (ns "bf16") or muon64_step (ns "fp32",
    float64) on MUON_NAMES, torch AdamW on the rest."""
    muon = [p for n, p in named.items() if n in MUON_NAMES]
    rest = [p for n, p in named.items() if n not in MUON_NAMES]
    adamw = torch.optim.AdamW(
        [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": enc.WEIGHT_DECAY},
         {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
        lr=LR, betas=enc.BETAS, eps=enc.EPS, foreach=False,
    )  # fmt: skip
    if ns == "bf16":
        opt = torch.optim.Muon(muon, lr=LR, weight_decay=enc.WEIGHT_DECAY, momentum=MOMENTUM,
                               adjust_lr_fn="match_rms_adamw")  # fmt: skip
        return lambda: (opt.step(), adamw.step())
    bufs = {id(p): torch.zeros_like(p, dtype=torch.float64) for p in muon}

    @torch.no_grad()
    def step():
        for p in muon:
            w, bufs[id(p)] = muon64_step(p, bufs[id(p)], p.grad, LR, enc.WEIGHT_DECAY, MOMENTUM)
            p.copy_(w)
        adamw.step()

    return step


def run(rank: int, world: int, ns: str) -> dict:
    """Both models on the same batches for enc.STEPS steps: per step the (loss, grad norm) of
    each, and per Muon parameter ‖Δours − Δref‖ / ‖Δref‖ of that step's change."""

    from megatron_lite.parallel.data_parallel import build_data_parallel

    mesh, ours, ref = _models()
    dp = build_data_parallel(
        [ours], mesh, zero_stage=0, optimizer="muon", lr=LR, betas=enc.BETAS, eps=enc.EPS,
        weight_decay=enc.WEIGHT_DECAY, bucket_size=2000, layers_of=lambda chunk: chunk.blocks,
        optimizer_args={"split_fused": False, "momentum": MOMENTUM, "ns_dtype": ns},
    )  # fmt: skip
    muon_group = dp.optimizer.param_groups[0]
    muon_of_ours = {n for n, p in ours.named_parameters() for s in muon_group["sources"] if s is p}
    named_ours, named_ref = dict(ours.named_parameters()), dict(ref.named_parameters())
    torch_step = _torch_step(named_ref, ns)
    out = {"ours": [], "ref": [], "update": [], "muon": sorted(muon_of_ours)}
    for _ in range(enc.STEPS):
        before = {n: (named_ours[n].detach().clone(), named_ref[n].detach().clone())
                  for n in MUON_NAMES}  # fmt: skip
        out["ours"].append(enc.dp_step(mesh, ours, dp))  # one rank: mesh.dp.size is 1
        loss = enc._global_loss(mesh, enc._loss_sum(mesh, ref))
        out["ref"].append((loss, _clip(list(named_ref.values()))))
        torch_step()
        for p in ref.parameters():
            p.grad = None
        out["update"].append({
            n: ((named_ours[n] - a) - (named_ref[n] - b)).norm().item()
            / (named_ref[n] - b).norm().item()
            for n, (a, b) in before.items()
        })  # fmt: skip
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("ns", ["bf16", pytest.param("fp32", marks=pytest.mark.slow)])
def test_one_rank_muon_matches_torch(ns):
    """bf16 NS against torch.optim.Muon + AdamW: bitwise the same losses and updates
    (measured; the issue's allowance, a few percent of an update for bf16 NS flips, is not
    needed). fp32 NS against the float64 Muon: step 1's loss and grad norm to the suite's
    bounds (nothing stepped yet), each later loss within 1e-5 and each Muon tensor's change
    within 1e-4 of its update (measured 3.6e-8 and 1.3e-5)."""
    got = run_ranks(1, run, ns, timeout=120)[0]
    assert set(got["muon"]) == MUON_NAMES, got["muon"]
    ours, ref = got["ours"], got["ref"]
    assert ref[-1][0] < ref[0][0] - 0.1, f"the encoder does not learn with Muon: {ref}"
    d_loss, d_norm = _rel(ours[0][0], ref[0][0]), _rel(ours[0][1], ref[0][1])
    later = max(_rel(a[0], b[0]) for a, b in zip(ours[1:], ref[1:], strict=True))
    update = max(max(u.values()) for u in got["update"])
    print(f"MUON one rank {ns}: step 1 loss {d_loss:.1e} norm {d_norm:.1e}; later {later:.1e};"
          f" update {update:.1e}")  # fmt: skip
    assert d_loss < STEP1_LOSS and d_norm < STEP1_GRAD_NORM, (ours[0], ref[0])
    if ns == "bf16":
        # the grad norms differ by the order of their float64 sums (1 ulp measured)
        assert [a[0] for a in ours] == [b[0] for b in ref] and update == 0.0, (later, update)
        assert max(_rel(a[1], b[1]) for a, b in zip(ours, ref, strict=True)) < 1e-12
    else:
        assert later < 1e-5 and update < min(1e-4, UPDATE_TOL), (later, update)
