"""Multi-token prediction (models/mtp.py) against independent references:

- with mtp_loss_scaling_factor=0 the training losses and gradient norms are bitwise those of
  the model without MTP (same seed: the MTP parameters do not move the main model's init);
- the per-token MTP losses, the objective λ/D · Σ_k Σ_i loss_k(i) / N and its gradient equal
  a plain-torch float64 computation of DeepSeek-V3's formula on the module's weights (RMSNorm,
  the concatenation [embedding; hidden], the projection, a GQA llama layer with RoPE, the shared
  head and cross-entropy, written out here);
- on packed documents no MTP target crosses a document (the positions that would are exactly
  0, every other one is not), and the shifted targets equal a per-position loop;
- loss parity with one rank (the suite's bounds) on tp2+SP with full recompute; pp2 under
  1F1B and ZeRO-3 (untied: the last stage's embedding copy), ZB-V (the loss chunk is rank 0's
  second) and DualPipeV (tied: the output layer's copy is the lookup); MoE MTP layers on
  tp2+SP·ep2; cp2 p2p with document masking and selective recompute, cp2 a2a with document
  masking (both fail when the targets are shifted after the CP cut);
- a pp2 checkpoint resumes bitwise and on one rank;
- mtp_loss is in metrics.jsonl of a CLI run.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.dist_harness import run_ranks
from tests.parallel.parity import SHORT, TINY, assert_parity, reference_losses, train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOD, SEQ, LAMBDA = 249, 32, 0.3
MTP = ("model.arch=llama", "model.num_layers=2", "model.mtp_num_layers=2", *SHORT)
UNTIED = (*MTP, "model.tie_embeddings=false")
V4 = (*MTP, "model.num_layers=4")  # V schedules: pp·vpp = 4 stages
# the MTP layers MoE (the last layer is), with an aux loss and the expert bias
MOE = (*MTP, "model.num_experts=4", "model.moe_router_topk=2", "model.moe_aux_loss_coeff=0.01",
       "model.moe_router_enable_expert_bias=true")  # fmt: skip
DOCS = ("data.eod_token_id=249", "data.reset_attention_mask=true", "data.reset_position_ids=true")


# ------------------------------------------------------------------ λ = 0: bitwise the same
def test_zero_factor_is_bitwise_the_model_without_mtp(tmp_path):
    base = ("model.arch=llama", "model.num_layers=2", "train.steps=2")
    plain = train_losses(1, list(base), str(tmp_path / "a"))
    off = train_losses(
        1, [*base, "model.mtp_num_layers=1", "model.mtp_loss_scaling_factor=0"], str(tmp_path / "b")
    )
    on = train_losses(1, [*base, "model.mtp_num_layers=1"], str(tmp_path / "c"))
    assert list(off) == list(plain), f"{list(off)} != {list(plain)}"
    assert off.grad_norms == plain.grad_norms, f"{off.grad_norms} != {plain.grad_norms}"
    # λ > 0 trains the MTP objective too: step 1's loss is the same, the next ones are not
    assert on[0] == plain[0] and on[1] != plain[1], f"{list(on)} vs {list(plain)}"


# ------------------------------------------------------------- the formula in plain torch
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """x [b, s, n, d], half rotation at positions pos [s] (float64)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv  # [s, d/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def _llama_layer(x, layer, n, g, eps, theta):
    """One pre-norm llama layer on x [b, s, h] from the layer's weights (GQA, causal)."""
    b, s, h = x.shape
    att = layer.self_attention
    d = att.linear_qkv.weight.shape[0] // (n + 2 * g)
    qkv = _rms(x, layer.input_norm.weight, eps) @ att.linear_qkv.weight.t()
    q, k, v = qkv.split([n * d, g * d, g * d], -1)
    pos = torch.arange(s)
    q = _rope(q.view(b, s, n, d), pos, theta).transpose(1, 2)  # [b, n, s, d]
    k = _rope(k.view(b, s, g, d), pos, theta).transpose(1, 2).repeat_interleave(n // g, 1)
    v = v.view(b, s, g, d).transpose(1, 2).repeat_interleave(n // g, 1)
    scores = q @ k.transpose(-1, -2) / d**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, n * d)
    x = x + out @ att.linear_proj.weight.t()
    gate, up = (_rms(x, layer.pre_mlp_norm.weight, eps) @ layer.mlp.linear_fc1.weight.t()).chunk(
        2, -1
    )
    return x + (F.silu(gate) * up) @ layer.mlp.linear_fc2.weight.t()


def _reference_mtp(chunk, h0, tokens, labels, n, g, eps, theta, vocab):
    """DeepSeek-V3 §2.2 on the chunk's weights: per module k the per-token CE [b, s - k]
    against t_{i+k+1} (labels[i + k]), from h0 [b, s, h]."""
    emb_w = chunk.embedding.weight
    out_w = chunk.output_weight()
    h, losses = h0, []
    for k, m in enumerate(chunk.mtp.layers, start=1):
        s = tokens.shape[1] - k
        e = emb_w[tokens[:, k:]]  # emb(t_{i+k}) [b, s - k, h]
        cat = torch.cat([_rms(e, m.enorm.weight, eps), _rms(h[:, :s], m.hnorm.weight, eps)], -1)
        x = cat @ m.eh_proj.weight.t()
        # the layer sees positions 0..s-k-1 only: causal attention never looks ahead, so the
        # module's outputs there do not depend on the positions it has no target for
        h = _llama_layer(x, m.layer, n, g, eps, theta)
        logits = _rms(h, m.final_norm.weight, eps) @ out_w.t()
        losses.append(
            F.cross_entropy(logits[..., :vocab].transpose(1, 2), labels[:, k:], reduction="none")
        )
    return losses


def _formula(rank, world):
    from megatron_lite.models import build_model
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.train import prepare
    from megatron_lite.training.lm_step import with_mtp_objective

    over = [*TINY, "data.mock=true", "model.num_layers=2", "model.mtp_num_layers=2",
            f"model.mtp_loss_scaling_factor={LAMBDA}", "model.init_method_std=0.2"]  # fmt: skip
    cfg, _, vocab = prepare(over, world_size=1)
    m = cfg.model
    mesh = ParallelMesh(RankLayout(1))
    (chunk,) = build_model(cfg, mesh, model_parallel_seed(1, 0, 0), vocab)
    chunk.double()
    g = torch.Generator().manual_seed(0)
    sample = torch.randint(0, vocab, (2, SEQ + 1), generator=g)
    tokens, labels = sample[:, :-1], sample[:, 1:]
    seen = []
    hook = chunk.final_norm.register_forward_pre_hook(lambda mod, a: seen.append(a[0]))
    loss, mtp = chunk(tokens, labels, tokens=tokens)  # [s, b], [D, s, b]
    hook.remove()
    h0 = seen[0].detach().transpose(0, 1)  # [b, s, h]: the main model's, before its norm
    n_tok = labels.numel()
    value = with_mtp_objective(loss, mtp, chunk.mtp.loss_scale)
    value.backward()  # the engine scales it by 1/N: here by hand
    got_grad = chunk.mtp.layers[0].eh_proj.weight.grad.clone() / n_tok
    chunk.zero_grad()
    ref = _reference_mtp(chunk, h0, tokens, labels, m.num_attention_heads,
                         m.num_query_groups, m.norm_eps, m.rope_theta, vocab)  # fmt: skip
    objective_ref = LAMBDA / 2 * sum(r.sum() for r in ref) / n_tok
    objective_ref.backward()
    want_grad = chunk.mtp.layers[0].eh_proj.weight.grad
    per_token = max(
        float(((mtp[k, : SEQ - k - 1].t() - r).abs() / r.abs()).max()) for k, r in enumerate(ref)
    )
    tails = [float(mtp[k, SEQ - k - 1 :].abs().max()) for k in range(2)]
    objective = float(LAMBDA / 2 * mtp.sum() / n_tok)
    return {
        "per_token": per_token,
        "tails": tails,
        "objective": (objective, float(objective_ref)),
        "value_is_main": float(value) == float(loss.sum()),
        "grad": float((got_grad - want_grad).norm() / want_grad.norm()),
        "ref_mean": float(sum(r.mean() for r in ref) / 2),
    }


def test_mtp_loss_is_deepseek_formula_in_plain_torch():
    (r,) = run_ranks(1, _formula, timeout=120)
    print(f"MTP formula: {r}")
    got, want = r["objective"]
    assert r["ref_mean"] > 1.0, "losses too small to test anything"
    # float64 weights; the cross-entropy runs in fp32 (the model's logits.float()), ~1e-7
    assert r["per_token"] < 1e-6, f"per-token MTP losses differ by {r['per_token']:.1e}"
    assert r["tails"] == [0.0, 0.0], f"positions past the window have a loss: {r['tails']}"
    assert abs(got - want) / want < 1e-6, f"objective {got} vs DeepSeek's {want}"
    assert r["grad"] < 1e-6, f"the objective's gradient differs by {r['grad']:.1e}"
    assert r["value_is_main"], "the step's value must be the main loss's sum, bitwise"


# ------------------------------------------------------------ documents: no crossing target
def _documents(rank, world):
    from megatron_lite.context.documents import document_ids
    from megatron_lite.models import build_model
    from megatron_lite.models.mtp import mtp_targets
    from megatron_lite.parallel.cross_entropy import IGNORE_INDEX
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.train import prepare

    over = [*TINY, "data.mock=true", "model.num_layers=2", "model.mtp_num_layers=2",
            f"data.eod_token_id={EOD}", "data.reset_attention_mask=true"]  # fmt: skip
    cfg, _, vocab = prepare(over, world_size=1)
    (chunk,) = build_model(cfg, ParallelMesh(RankLayout(1)), model_parallel_seed(1, 0, 0), vocab)
    g = torch.Generator().manual_seed(3)
    sample = torch.randint(0, EOD, (2, SEQ + 1), generator=g)
    sample[0, [0, 9, 10, 20]] = EOD  # one at the start, two in a row
    sample[1, [13, SEQ - 1]] = EOD  # one just before the window's last label
    tokens, labels = sample[:, :-1], sample[:, 1:]
    with torch.no_grad():
        _, mtp = chunk(tokens, labels, tokens=tokens)  # [D, s, b]
    docs = document_ids(sample, EOD)  # [b, s + 1]: the document of every position
    crossing, kept, loop_ok = [], [], True
    for k in (1, 2):
        ids, targets = mtp_targets(tokens, labels, k, EOD)
        for b in range(2):
            for i in range(SEQ):
                has = i + k < SEQ
                same = has and docs[b, i + k + 1] == docs[b, i]
                want = int(labels[b, i + k]) if same else IGNORE_INDEX
                loop_ok &= int(targets[b, i]) == want
                loop_ok &= int(ids[b, i]) == (int(tokens[b, i + k]) if has else 0)
                value = float(mtp[k - 1, i, b])
                (kept if same else crossing).append(value)
    return {"crossing": max(map(abs, crossing)), "n_crossing": len(crossing),
            "kept_min": min(kept), "loop_ok": bool(loop_ok)}  # fmt: skip


def test_no_mtp_target_crosses_a_document():
    (r,) = run_ranks(1, _documents, timeout=120)
    print(f"MTP documents: {r}")
    assert r["loop_ok"], "mtp_targets differs from the per-position rule"
    assert r["n_crossing"] > 10, "too few crossing positions to test anything"
    assert r["crossing"] == 0.0, f"a target across a document has loss {r['crossing']}"
    assert r["kept_min"] > 0.0, "a target inside its document has no loss"


# ------------------------------------------------------------------------------ parity
FULL = ("model.recompute_granularity=full", "model.recompute_method=uniform",
        "model.recompute_num_layers=1")  # fmt: skip
ZB_V = ("parallel.pipeline_schedule=zb-v", "parallel.vpp=2")
DUALPIPEV = ("parallel.pipeline_schedule=dualpipev", "parallel.vpp=2")
# name: (world, reference model, eod dataset, layout)
LAYOUTS = {
    "tp2_sp_full_recompute": (2, MTP, None, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                             *FULL]),
    "pp2_1f1b_untied": (2, UNTIED, None, ["parallel.pp=2"]),
    "pp2_zb_v_untied": (2, (*V4, "model.tie_embeddings=false"), None, ["parallel.pp=2", *ZB_V]),
    "pp2_dualpipev_tied": (2, V4, None, ["parallel.pp=2", *DUALPIPEV]),
    "pp2_dp2_zero3_untied": (4, UNTIED, None, ["parallel.pp=2", "parallel.zero_stage=3"]),
    "moe_tp2_sp_ep2": (4, MOE, None, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                      "parallel.ep=2"]),
    "cp2_p2p_documents_selective": (2, (*MTP, *DOCS), EOD, [
        "parallel.cp=2", "parallel.cp_comm_type=p2p", "model.recompute_granularity=selective"]),
    "cp2_a2a_documents": (2, (*MTP, *DOCS), EOD, ["parallel.cp=2", "parallel.cp_comm_type=a2a"]),
}  # fmt: skip


# the layouts in the suite; the further ones in the slow tier (CI runs it after)
# and, for the suite's budget, the layouts test_deepseek_v3_parity.py runs with MTP in the suite
# (pp2 1F1B, pp2 ZB-V, cp2 a2a with documents)
SLOW_LAYOUTS = {
    "pp2_dualpipev_tied",
    "pp2_dp2_zero3_untied",
    "moe_tp2_sp_ep2",
    "pp2_1f1b_untied",
    "pp2_zb_v_untied",
    "cp2_a2a_documents",
}


@pytest.mark.parity
@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_LAYOUTS else k for k in LAYOUTS],
)
def test_mtp_parity_with_one_rank(layout, tmp_path):
    world, model, eod, overrides = LAYOUTS[layout]
    ref = reference_losses(tuple(model), eod=eod)
    got = train_losses(world, [*model, *overrides], str(tmp_path), eod=eod)
    assert ref[-1] < ref[0] - 0.05, f"reference loss did not fall: {list(ref)}"
    assert_parity(got, ref, f"mtp {layout}")


# -------------------------------------------------------------------------------- the CLI
@pytest.mark.slow  # the suite's budget
def test_mtp_loss_in_metrics_of_a_cli_run(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "megatron_lite.train", "--config",
         os.path.join(ROOT, "configs", "smoke.yaml"), "model.mtp_num_layers=2",
         "train.steps=2", f"train.out_dir={out}", "log.memory_steps=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for rec in records:
        assert {"mtp_loss", "mtp_loss_1", "mtp_loss_2"} <= rec.keys(), rec.keys()
        assert 0.0 < rec["mtp_loss"] < 2 * rec["loss"], rec
    assert "mtp_loss" in r.stdout, r.stdout[-1000:]


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.slow
def test_mtp_resumes_exactly_and_reshards_to_one_rank(tmp_path):
    """pp2 with untied embeddings: the last stage's embedding copy (mtp.embed_tokens) is not
    stored (the first stage writes the embedding) and is loaded from it; the MTP modules'
    weights are. The same layout resumes bitwise, one rank (no copy) within 1e-4."""
    from tests.parallel.test_checkpoint import SAVE, check_resume, train

    model = ["model.arch=llama", "model.num_layers=2", "model.mtp_num_layers=1",
             "model.tie_embeddings=false"]  # fmt: skip
    layout = [*model, "parallel.pp=2"]
    base = tmp_path / "pp2"
    full = train(2, [*layout, *SAVE], base)[0]
    check_resume((base, full), 2, layout, tmp_path / "same", exact=True)
    check_resume((base, full), 1, model, tmp_path / "one", exact=False)
