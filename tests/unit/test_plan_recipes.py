"""The published recipes (configs/recipes/): each one's `# plan:` command prints fit, tokens/s
and the communication budget; the 70B hybrid-sharding recipe's cross-node bytes are the bf16
gradients of a hand-counted Llama-3 70B, shard by shard, all-reduced over the replica pair;
a fabric's measured time replaces the model's in the step."""

import glob
import os
import shlex

import pytest

from megatron_lite.config import load_config
from megatron_lite.plan.__main__ import main, node, parse_args, with_vocab
from megatron_lite.plan.step_time import step_time
from megatron_lite.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "configs", "recipes", "*.yaml")))
HSDP = os.path.join(ROOT, "configs", "recipes", "llama3_70b_rtxpro6000_hsdp_ib200.yaml")
PREFIX = "python -m megatron_lite.plan "


def plan_argv(path: str) -> list[str]:
    """The recipe's machine: the flags of its `# plan: python -m megatron_lite.plan ...` line."""
    with open(path) as f:
        lines = [x[len("# plan: ") :] for x in f.read().splitlines() if x.startswith("# plan: ")]
    assert len(lines) == 1 and lines[0].startswith(PREFIX), (path, lines)
    argv = shlex.split(lines[0][len(PREFIX) :])
    assert argv[:2] == ["--config", os.path.relpath(path, ROOT)], argv
    return ["--config", path, *argv[2:]]


def test_there_are_the_three_recipes_and_the_70b_twice():
    names = {os.path.basename(p) for p in RECIPES}
    assert names == {
        "llama3_8b_rtx5090_pcie.yaml", "llama31_405b_tp8pp8.yaml",
        "llama3_70b_rtxpro6000_hsdp_ib200.yaml", "llama3_70b_rtxpro6000_hsdp_roce100.yaml",
    }  # fmt: skip


@pytest.mark.parametrize("path", RECIPES, ids=[os.path.basename(p) for p in RECIPES])
def test_plan_prints_fit_tokens_per_second_and_the_budget(path, capsys):
    assert main(plan_argv(path)) == 0
    out = capsys.readouterr().out
    fits = [x for x in out.splitlines() if x.rstrip().endswith((" yes", " NO"))]
    assert fits, out
    assert "tokens/s" in out and "communication per step" in out and "across nodes:" in out


def _hsdp_step(fabric=None):
    args = parse_args(plan_argv(HSDP))
    cfg = validate(with_vocab(load_config(args.config)), 16)
    hw = node(args, fabric)
    return cfg, step_time(cfg, 16, hw, args.mfu, args.gpus_per_node, simulate=False)


def llama3_70b_params() -> int:
    """Meta's Llama-3 70B by hand: untied embedding and output (V·h each), per layer q and o
    (h·h each), k and v (h·g·d each, d = h/n), SwiGLU (3·h·f), two RMSNorms (h); final norm."""
    v, h, layers, heads, groups, f = 128256, 8192, 80, 64, 8, 28672
    d = h // heads
    per_layer = 2 * h * h + 2 * h * groups * d + 3 * h * f + 2 * h
    return 2 * v * h + layers * per_layer + h


def test_hsdp_cross_node_bytes_are_the_bf16_gradients_over_the_replica_pair():
    """Each GPU holds 1/8 of the bf16 gradients (2·N/8 bytes) and all-reduces it with its
    replica on the other node: bus bytes 2(2−1)/2 · 2N/8 = 2N/8 (≈17.6 GB, ≈141 GB leaving each
    node). Nothing else crosses nodes (one pipeline stage, no TP/CP/EP)."""
    n_params = llama3_70b_params()
    assert n_params == pytest.approx(70.55e9, rel=1e-3)  # Meta's "70B"
    _, t = _hsdp_step()
    cross_bytes, cross_s = t.budget.cross_node()
    assert cross_bytes == pytest.approx(2 * n_params / 8, rel=1e-9)
    line = next(v for v in t.budget.table() if v.scope == "inter")
    assert (line.group, line.n, line.ops) == ("DP", 2, {"all_reduce": 1.0})
    # one 200 Gb/s IB NIC at 90% shared by the node's 8 GPUs: 2N/8 / (25e9·0.9/8) + latency
    assert cross_s == pytest.approx(2 * n_params / 8 / (25e9 * 0.9 / 8), rel=1e-4)


class FakeFabric:
    """plan/fabric.py's shape: a measured inter-node all-reduce, nothing else."""

    def time(self, op, size_bytes, n, scope):
        return 10.0 if (op, scope) == ("all_reduce", "inter") else None


def test_a_fabric_changes_the_predicted_step():
    _, model = _hsdp_step()
    _, measured = _hsdp_step(FakeFabric())
    line = next(v for v in measured.budget.table() if v.scope == "inter")
    assert line.seconds == 10.0
    before = next(v for v in model.budget.table() if v.scope == "inter").seconds
    assert before == pytest.approx(6.27, rel=0.01)  # the model's, test above
    # the replica all-reduce follows the last microbatch's backward: what it adds is exposed
    assert measured.total > model.total


def test_per_microbatch_zero3_reduces_and_all_reduces_across_nodes_every_microbatch():
    """parallel.zero3_grad_reduce=microbatch on the 70B HSDP recipe (32 microbatches): FSDP2
    reduce-scatters inside the node and all-reduces the shards across the replica pair after
    every microbatch's backward: 32 of each per step, 32× the hand-counted cross-node bytes."""
    args = parse_args(plan_argv(HSDP))
    cfg = load_config(args.config, ["parallel.zero3_grad_reduce=microbatch"])
    cfg = validate(with_vocab(cfg), 16)
    t = step_time(cfg, 16, node(args, None), args.mfu, args.gpus_per_node, simulate=False)
    cross_bytes, _ = t.budget.cross_node()
    assert cross_bytes == pytest.approx(32 * 2 * llama3_70b_params() / 8, rel=1e-9)
    ops = {v.scope: v.ops for v in t.budget.table() if v.group == "DP"}
    assert ops == {"intra": {"reduce_scatter": 32.0, "all_gather": 64.0},
                   "inter": {"all_reduce": 32.0}}  # fmt: skip
