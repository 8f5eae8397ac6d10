"""The architecture registry (models/registry.py) from the outside: architectures defined in this
file alone, with no edit under megatron_lite/, train with one rank's losses.

- `parallel_block`: GPT-J / PaLM's parallel block, x + attn(norm(x)) + mlp(norm(x)) with one
  shared RMSNorm, and a squared-ReLU MLP (Primer, So et al. 2021) built from the public
  ColumnParallelLinear / RowParallelLinear; its attention is the shipped RotaryAttention part.
  Trained on tp2+SP·pp2 (4 ranks) against one rank of the same seed.
- `wide_values`: Llama whose value heads are twice as wide as its query/key heads (the shape
  DeepSeek's multi-head latent attention gives them), declared by the attention part alone:
  RoPE's tables, Ulysses and the ring read the widths it declares. Trained under a2a+p2p
  context parallelism (Ulysses pairs inside a ring of 2) against one rank; and Ulysses and the
  ring on their own against float64 attention.

`plan` and `plan --dry-run` on `parallel_block` (tp2+SP·pp2, both pipeline ranks, in a child
process that imports this file): the model states, the saved activations and the peak agree
within 3%; the forward/backward working sets do not yet (see the xfail below).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.models.registry import (
    ArchitectureSpec,
    FlopsPerToken,
    HeadDims,
    architecture_names,
    register_architecture,
)
from megatron_lite.models.transformer import RotaryAttention
from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.parallel.norms import RMSNorm
from tests.dist_harness import run_ranks
from tests.parallel.parity import SHORT, TINY, _train, assert_parity, structured_dataset


class SquaredReLUMLP(nn.Module):
    """fc2(relu(fc1(x))²): [s(/tp), b, h] -> [s(/tp), b, h] (registry contract: config, mesh)."""

    def __init__(self, config, mesh):
        super().__init__()
        c, sp = config, config.sequence_parallel
        self.fc1 = ColumnParallelLinear(c.hidden_size, c.ffn_hidden_size, mesh.tp.group,
                                        bias=False, sequence_parallel=sp,
                                        init_std=c.init_method_std)  # fmt: skip
        self.fc2 = RowParallelLinear(c.ffn_hidden_size, c.hidden_size, mesh.tp.group,
                                     bias=False, sequence_parallel=sp,
                                     init_std=c.output_std)  # fmt: skip

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)).square())


class ParallelBlock(nn.Module):
    """x + attn(norm(x)) + mlp(norm(x)), one norm shared by both branches (registry contract:
    config, mesh, tracker, layer_number)."""

    def __init__(self, config, mesh, tracker, layer_number):
        super().__init__()
        c = config
        self.norm = c.spec.part("norm")(c.hidden_size, c.norm_eps, c.sequence_parallel)
        self.self_attention = c.spec.part("attention")(c, mesh, tracker)
        self.mlp = c.spec.part("mlp")(c, mesh)

    def forward(self, x, ctx):
        y = self.norm(x)
        return x + self.self_attention(y, ctx) + self.mlp(y)


def parallel_block_flops(m, vocab_size: int) -> FlopsPerToken:
    """Attention projections, the two MLP matrices and the output layer; causal attention."""
    h, d = m.hidden_size, m.kv_channels or m.hidden_size // m.num_attention_heads
    q, kv = m.num_attention_heads * d, (m.num_query_groups or m.num_attention_heads) * d
    ffn = m.ffn_hidden_size or 4 * h
    layer = h * (q + 2 * kv) + q * h + 2 * h * ffn
    return FlopsPerToken(
        m.num_layers * layer + h * vocab_size, 6.0 * m.num_layers * m.seq_length * q
    )


class WideValueAttention(RotaryAttention):
    """Llama's attention with value heads twice the query/key head width: only the declared
    head dims differ (the shipped Attention sizes its projections from them)."""

    @classmethod
    def head_dims(cls, config) -> HeadDims:
        d = config.head_dim
        return HeadDims(qk=d, v=2 * d, rotary=d)


def wide_values_flops(m, vocab_size: int) -> FlopsPerToken:
    """q, k of width d, v and the output projection's input of width 2d; SwiGLU MLP; scores
    Q·Kᵀ over d and A·V over 2d, causal."""
    h, n = m.hidden_size, m.num_attention_heads
    d, g, f = h // n, m.num_query_groups or n, m.ffn_hidden_size or 4 * h
    layer = h * (n * d + g * d + g * 2 * d) + n * 2 * d * h + 3 * h * f
    return FlopsPerToken(m.num_layers * layer + h * vocab_size,
                         3.0 * m.num_layers * m.seq_length * n * (d + 2 * d))  # fmt: skip


if "parallel_block" not in architecture_names():  # forked ranks import this module again
    register_architecture(
        ArchitectureSpec(
            name="parallel_block",
            attention="megatron_lite.models.transformer:RotaryAttention",
            mlp=SquaredReLUMLP,
            norm=RMSNorm,
            layer=ParallelBlock,
            ffn_hidden_size=lambda h: 4 * h,
            flops=parallel_block_flops,
        )
    )
    register_architecture(
        ArchitectureSpec(
            name="wide_values",
            attention=WideValueAttention,
            mlp="megatron_lite.models.transformer:build_dense_mlp",
            norm=RMSNorm,
            ffn_hidden_size=lambda h: 4 * h,
            flops=wide_values_flops,
        )
    )


def _train_here(rank, world, overrides, out_dir):
    """parity._train in a rank that imported this module (so the toys are registered there)."""
    return _train(rank, world, overrides, out_dir)


def _losses(world: int, overrides, tmp: str):
    """Rank 0's losses and grad norms (parity.train_losses' data and sizes)."""
    data = f"data.paths=[{structured_dataset()}]"
    return run_ranks(world, _train_here, [*TINY, data, *overrides], tmp, timeout=240)[0]


TOY = ("model.arch=parallel_block", *SHORT)
TP2_SP_PP2 = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2"]


def test_parallel_block_trains_on_tp2_sp_pp2_with_one_ranks_losses(tmp_path):
    ref = _losses(1, TOY, str(tmp_path / "one"))
    got = _losses(4, [*TOY, *TP2_SP_PP2], str(tmp_path / "four"))
    assert_parity(got, ref, "parallel_block tp2+SP pp2")


WIDE = ("model.arch=wide_values", *SHORT)
HYBRID_CP4 = ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", "parallel.cp_a2a_size=2"]


def test_wide_value_heads_under_a2a_p2p_context_parallelism(tmp_path):
    ref = _losses(1, WIDE, str(tmp_path / "one"))
    got = _losses(4, [*WIDE, *HYBRID_CP4], str(tmp_path / "four"))
    assert_parity(got, ref, "wide_values a2a+p2p cp4")


def _built(rank, world, arch):
    """Layer 0's parameter shapes by name, and RoPE's table shape, of `arch` built on one rank
    by build_model (h 64, 4 heads, seq_length 64: the defaults)."""
    from megatron_lite.models import build_model
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.train import prepare

    args = ["data.mock=true", "model.vocab_size=64", f"model.arch={arch}"]
    cfg, _, vocab = prepare(args, world_size=1)
    (chunk,) = build_model(cfg, ParallelMesh(RankLayout(1)), model_parallel_seed(1, 0, 0), vocab)
    layer = chunk.layers["0"]
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    return shapes, tuple(chunk.rope_cos.shape)


def test_the_entries_parts_are_what_build_model_builds():
    """parallel_block: one norm, the attention part, the squared-ReLU MLP (ffn 4h = 256);
    wide_values: q/k heads of 16, value heads of 32, RoPE's tables at the declared rotary
    width 16."""
    (toy, toy_rope), (wide, wide_rope) = (
        run_ranks(1, _built, arch, timeout=60)[0] for arch in ("parallel_block", "wide_values")
    )
    assert toy == {
        "norm.weight": (64,),
        "self_attention.linear_qkv.weight": (3 * 64, 64),
        "self_attention.linear_proj.weight": (64, 64),
        "mlp.fc1.weight": (256, 64),
        "mlp.fc2.weight": (64, 256),
    }, toy
    assert toy_rope == (64, 16), toy_rope
    assert wide["self_attention.linear_qkv.weight"] == (4 * 16 + 4 * 16 + 4 * 32, 64), wide
    assert wide["self_attention.linear_proj.weight"] == (64, 4 * 32), wide
    assert wide_rope == (64, 16), wide_rope


def _reference(q, k, v):
    """float64 causal attention over the whole sequence, KV heads shared by n/g query heads."""
    n, g = q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(n // g, dim=2) for t in (k, v))
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / q.shape[-1] ** 0.5
    mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)


def _cp_vs_reference(rank, world, kind):
    import torch.distributed as dist

    from megatron_lite.context.layout import positions, ring_ranges
    from megatron_lite.context.ring import ring_attention
    from megatron_lite.context.ulysses import ulysses_attention
    from megatron_lite.models.attention import sdpa_attention

    torch.manual_seed(0)
    s, b, n, g, dk, dv = 16, 2, 4, 2, 4, 6
    q, k, v = (torch.randn(s, b, h, d, dtype=torch.float64) for h, d in ((n, dk), (g, dk), (g, dv)))
    gout = torch.randn(s, b, n, dv, dtype=torch.float64)
    if kind == "ring":
        all_ranges = ring_ranges(s, world)
        mine = positions(all_ranges[rank])
        shard = [t[mine].clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*shard, dist.group.WORLD, all_ranges)
    else:
        mine = torch.arange(s).chunk(world)[rank]
        shard = [t[mine].clone().requires_grad_() for t in (q, k, v)]
        out = ulysses_attention(
            *shard, dist.group.WORLD, lambda a, b_, c: sdpa_attention(a, b_, c, 0.0)
        )
    out.backward(gout[mine])
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*full)
    ref.backward(gout)
    errs = [float((out - ref[mine]).detach().abs().max())]
    errs += [float((a.grad - r.grad[mine]).abs().max()) for a, r in zip(shard, full, strict=True)]
    return max(errs), tuple(out.shape)


def test_ring_and_ulysses_take_value_heads_wider_than_query_heads():
    for kind in ("ring", "ulysses"):
        for err, shape in run_ranks(2, _cp_vs_reference, kind, timeout=60):
            assert shape == (8, 2, 4, 6), f"{kind}: output {shape}, not [s/cp, b, n, dv]"
            assert err < 1e-10, f"{kind}: value heads of 6 vs q/k of 4: max error {err:.2e}"


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# quickstart's sizes (h 256, 8 heads, 4 groups, ffn 704, seq 128, fp32, 4 microbatches of 2) on
# the toy, tp2+SP·pp2, a vocabulary of 256 so the layers dominate the last stage too
PLAN_TOY = ["model.arch=parallel_block", "model.vocab_size=256", *TP2_SP_PP2, "parallel.dp=1"]
PLAN_CHILD = """
import json, sys
import tests.parallel.test_architecture_registry  # registers the toys
from megatron_lite.config import load_config
from megatron_lite.plan.__main__ import with_vocab
from megatron_lite.plan.activations import resolved
from megatron_lite.plan.dry_run import PLANNER_TERMS, dry_run, to_json
from megatron_lite.plan.peak import moments
from megatron_lite.validation import validate

cfg = validate(with_vocab(load_config("configs/quickstart.yaml", sys.argv[1:])), 4)
out = []
for j in to_json(dry_run(cfg, 4, None, "steady", workers=1, kernels="fused")):
    pp, kind = j["coords"]["pp"], j["peak_phase"].split()[0]
    same = [m for m in moments(resolved(cfg, 4), pp) if m.phase.endswith(kind)]
    at = max(same, key=lambda m: m.total)  # the planner's largest moment of the same kind
    terms = {k: sum(at.terms.get(t, 0.0) for t in v) for k, v in PLANNER_TERMS.items()}
    out.append(dict(j, at_phase=terms))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def toy_plan():
    """Each pipeline rank's dry run of the toy beside the planner's figures."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", PLAN_CHILD, *PLAN_TOY], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["coords"]["pp"] for r in results] == [0, 1]
    return results


def _close(got: float, want: float, what: str, tol: float = 0.03) -> None:
    assert abs(got - want) <= tol * want or got == want == 0, f"{what}: dry run {got}, plan {want}"


def test_plan_and_dry_run_agree_on_the_toys_states_activations_and_peak(toy_plan):
    """Model states per term at the peak, the activations at the dry run's peak vs the
    planner's largest moment of the same kind (forward/backward), and the peak: within 3%.
    The dry run's peak is inside a layer's forward or backward (attach_layers names the toy's
    layers, not only TransformerLayer's)."""
    for res in toy_plan:
        at = f"pp rank {res['coords']['pp']}"
        for term in ("weights", "grads", "master", "optimizer", "buffers"):
            _close(res["compared"][term], res["predicted"][term], f"{at} {term}")
        _close(res["compared"]["activations"], res["at_phase"]["activations"], f"{at} act")
        _close(res["peak_bytes"], res["predicted_peak_bytes"], f"{at} peak")
        assert any(k.startswith("forward layer ") for k in res["peaks_by_phase"]), res


def test_plan_and_dry_run_agree_on_the_toys_working_bytes(toy_plan):
    """The gathered+temporaries term at the peak, and the activations: plan/working.py
    measures the working sets on the real layer (plan/layer_trace.py), so the parallel block's
    (one fused projection in, attention and MLP side by side) is what the dry run holds; the
    former hand formulas of a sequential attention-then-gated-MLP layer were 25% under in the
    backward and 90% over in the forward."""
    for res in toy_plan:
        at = f"pp rank {res['coords']['pp']}"
        got, want = res["compared"]["gathered+temporaries"], res["at_phase"]["gathered+temporaries"]
        _close(got, want, f"{at} gathered+temporaries")
        _close(res["compared"]["activations"], res["predicted"]["activations"], f"{at} act")
