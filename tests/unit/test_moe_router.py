"""Router top-k, load-balancing/z losses, the aux-loss gradient injection and capacity dropping
against plain float64 formulas (single process, no process group)."""

import math

import pytest
import torch

from megatron_lite.moe.router import (
    MoEAuxLossAutoScaler,
    RouterOptions,
    TopKRouter,
    capacity_keep,
    expert_bias_delta,
    expert_capacity,
    gather_token_shards,
    group_limited_mask,
    load_balancing_loss,
    sequence_load_balancing_loss,
    topk_softmax,
)


def _router(E=6, k=2, h=16, **kw) -> TopKRouter:
    r = TopKRouter(h, E, k, **kw).double()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        r.weight.copy_(torch.randn(E, h, generator=g, dtype=torch.float64))
    return r


def _reference(x, w, k):
    """Per-token loops in float64: softmax probs, top-k experts/probs, aux and z losses."""
    logits = x @ w.t()  # [T, E]
    T, E = logits.shape
    probs = torch.exp(logits - logits.max(1, keepdim=True).values)
    probs = probs / probs.sum(1, keepdim=True)
    chosen = [sorted(range(E), key=lambda e, t=t: -probs[t, e].item())[:k] for t in range(T)]
    counts = [sum(e in c for c in chosen) for e in range(E)]
    f = [counts[e] / (T * k) for e in range(E)]
    P = [probs[:, e].mean().item() for e in range(E)]
    aux = E * sum(fi * pi for fi, pi in zip(f, P, strict=True))
    z = sum(math.log(sum(math.exp(v) for v in row.tolist())) ** 2 for row in logits) / T
    return probs, chosen, counts, aux, z


def test_topk_and_losses_match_float64_formula():
    torch.manual_seed(0)
    T, E, k, h = 40, 6, 2, 16
    r = _router(E, k, h, aux_loss_coeff=0.5, z_loss_coeff=0.1)
    x = torch.randn(T, h, dtype=torch.float64)
    probs_ref, chosen, counts, aux, z = _reference(x, r.weight.detach(), k)
    route = r(x)
    assert [sorted(row) for row in route.indices.tolist()] == [sorted(c) for c in chosen]
    want_w = torch.stack([probs_ref[t, route.indices[t]] for t in range(T)])
    torch.testing.assert_close(route.weights, want_w, rtol=1e-12, atol=0)  # no renormalizing
    assert route.stats[:E].tolist() == counts, "tokens per expert"
    assert abs(route.stats[E].item() - aux) < 1e-6, (route.stats[E].item(), aux)
    assert abs(route.stats[E + 1].item() - z) < 1e-5 * z, (route.stats[E + 1].item(), z)
    assert route.keep is None and route.stats[E + 2].item() == 0, "dropless by default"


def test_uniform_routing_has_aux_loss_one():
    T, E, k = 12, 4, 2
    logits = torch.zeros(T, E, dtype=torch.float64)
    for t in range(T):  # token t prefers experts t and t+1 (mod E): balanced counts and probs
        logits[t, t % E], logits[t, (t + 1) % E] = 2.0, 1.0
    probs, _, indices = topk_softmax(logits, k)
    counts = torch.zeros(T, E, dtype=torch.float64).scatter_(1, indices, 1.0).sum(0)
    assert counts.tolist() == [T * k / E] * E
    assert abs(load_balancing_loss(probs.sum(0), counts, T, k).item() - 1.0) < 1e-12


def test_aux_objective_gradient_is_injected_with_scale():
    """Backward through the auto-scaler adds scale·d(aux_coeff·aux + z_coeff·z)/dW to the
    router weight while the forward output (and so the returned loss) is unchanged."""
    torch.manual_seed(1)
    T, E, k, h, scale = 24, 5, 2, 8, 0.37
    r = _router(E, k, h, aux_loss_coeff=0.3, z_loss_coeff=0.05)
    x = torch.randn(T, h, dtype=torch.float64)
    route = r(x)
    act = torch.randn(T, h, dtype=torch.float64, requires_grad=True)
    out = MoEAuxLossAutoScaler.apply(act, route.objective, scale)
    assert torch.equal(out, act)
    out.sum().backward()
    got = r.weight.grad.clone()

    # float64 reference: autograd on the plain formula with f held constant
    w = r.weight.detach().clone().requires_grad_(True)
    logits = x @ w.t()
    probs = torch.softmax(logits, -1)
    counts = torch.tensor(_reference(x, w.detach(), k)[2], dtype=torch.float64)
    aux = E * ((counts / (T * k)) * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    (scale * (0.3 * aux + 0.05 * z)).backward()
    torch.testing.assert_close(got, w.grad, rtol=1e-10, atol=1e-12)
    assert torch.equal(act.grad, torch.ones_like(act)), "activation gradient passes unchanged"


def test_capacity_drops_by_token_order_and_counts():
    """Every expert keeps its first ceil(f·T·k/E) assignments in token order; the rest are
    dropped and counted; the decision does not depend on the router probabilities."""
    torch.manual_seed(2)
    T, E, k, factor = 30, 4, 2, 0.5
    r = _router(E, k, 16, capacity_factor=factor)
    x = torch.randn(T, 16, dtype=torch.float64)
    route = r(x)
    cap = expert_capacity(T, E, k, factor)
    assert cap == math.ceil(0.5 * 30 * 2 / 4) == 8
    seen = [0] * E
    want = []
    for t in range(T):
        row = []
        for e in route.indices[t].tolist():
            row.append(seen[e] < cap)
            seen[e] += 1
        want.append(row)
    assert route.keep.tolist() == want
    n_dropped = sum(max(c - cap, 0) for c in seen)
    assert n_dropped > 0, "the test should exercise dropping"
    assert route.stats[E + 2].item() == n_dropped == (~route.keep).sum().item()
    assert route.stats[:E].tolist() == seen, "tokens per expert are counted before dropping"
    assert torch.equal(r(x).keep, route.keep), "deterministic"


def test_capacity_keep_with_offset_from_earlier_shards():
    """A later sequence shard keeps only what earlier shards left of each expert's capacity:
    splitting the tokens into two shards gives the same decisions as one."""
    torch.manual_seed(3)
    T, E, k, cap = 20, 3, 2, 9
    logits = torch.randn(T, E)
    _, _, indices = topk_softmax(logits, k)
    assign = torch.zeros(T, E).scatter_(1, indices, 1.0)
    whole = capacity_keep(assign, indices, torch.zeros(E), cap)
    first = capacity_keep(assign[:7], indices[:7], torch.zeros(E), cap)
    second = capacity_keep(assign[7:], indices[7:], assign[:7].sum(0), cap)
    assert torch.equal(torch.cat([first, second]), whole)


def test_gather_token_shards_single_process_is_identity():
    v = torch.arange(5, dtype=torch.float64)
    total, before = gather_token_shards(v, [None, None])
    assert torch.equal(total, v) and torch.equal(before, torch.zeros(5, dtype=torch.float64))


# ---------------------------------------------------------------- DeepSeek-V3-style routing
def _paper_routing(x, w, k, score, bias=None, groups=None, scaling=None, batch=1):
    """DeepSeek-V3 (arXiv 2412.19437) eqs. 12-20 token by token in float64, written from the
    paper: s = softmax or sigmoid of the affinities; selection ranks s + b (b only picks),
    node-limited to the `groups` = (G, M) best groups by the sum of each group's top k/M
    selection scores; gates are the picked s (sigmoid: normalized over the k), × scaling.
    Balance losses: P from s normalized per token, f from the top-k of the unbiased s over
    all experts; global over all T tokens, seq per sequence (token t is of sequence t mod b)
    then averaged. Returns (chosen expert sets, {token: {expert: gate}}, aux, seq aux)."""
    T, E = x.shape[0], w.shape[0]
    logits = [
        [sum(a * c for a, c in zip(x[t].tolist(), w[e].tolist(), strict=True)) for e in range(E)]
        for t in range(T)
    ]
    s = []
    for row in logits:
        if score == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            s.append([v / sum(ex) for v in ex])
        else:
            s.append([1 / (1 + math.exp(-v)) for v in row])
    b = [0.0] * E if bias is None else bias.tolist()
    chosen, gates = [], []
    for t in range(T):
        sel = [s[t][e] + b[e] for e in range(E)]
        allowed = list(range(E))
        if groups is not None:
            G, M = groups
            per = E // G
            gscore = [
                sum(sorted(sel[g * per : (g + 1) * per], reverse=True)[: k // M]) for g in range(G)
            ]
            best = sorted(range(G), key=lambda g: -gscore[g])[:M]
            allowed = [e for e in range(E) if e // per in best]
        pick = sorted(allowed, key=lambda e: -sel[e])[:k]
        g = {e: s[t][e] for e in pick}
        if score == "sigmoid" and k > 1:
            tot = sum(g.values())
            g = {e: v / tot for e, v in g.items()}
        if scaling is not None:
            g = {e: v * scaling for e, v in g.items()}
        chosen.append(set(pick))
        gates.append(g)
    p = [[v / sum(row) for v in row] for row in s]  # softmax rows already sum to 1
    top = [set(sorted(range(E), key=lambda e: -s[t][e])[:k]) for t in range(T)]

    def balance(tokens):
        n = len(tokens)
        f = [E / (k * n) * sum(e in top[t] for t in tokens) for e in range(E)]
        P = [sum(p[t][e] for t in tokens) / n for e in range(E)]
        return sum(fi * pi for fi, pi in zip(f, P, strict=True))

    seqs = [[t for t in range(T) if t % batch == j] for j in range(batch)]
    return chosen, gates, balance(range(T)), sum(balance(q) for q in seqs) / batch


ROUTINGS = {
    "softmax": dict(score="softmax"),
    "sigmoid": dict(score="sigmoid", scaling=2.5),
    "sigmoid_bias": dict(score="sigmoid", bias=True),
    "softmax_bias": dict(score="softmax", bias=True),
    "sigmoid_groups": dict(score="sigmoid", groups=(4, 2)),
    "sigmoid_bias_groups": dict(score="sigmoid", bias=True, groups=(4, 2), scaling=2.5),
    "softmax_groups": dict(score="softmax", groups=(4, 2)),
}


@pytest.mark.parametrize("name", ROUTINGS)
@pytest.mark.parametrize("aux_type", ["global", "seq"])
def test_routing_matches_paper_formulas(name, aux_type):
    """Expert choice, combine weights and the (global or sequence-wise) balance loss of the
    router equal the paper's formulas evaluated token by token in float64."""
    spec = ROUTINGS[name]
    T, E, k, h, b = 24, 8, 4, 16, 3  # T = s·b tokens in (s, b) order
    groups = spec.get("groups")
    options = RouterOptions(
        score_function=spec["score"],
        topk_scaling_factor=spec.get("scaling"),
        enable_expert_bias=spec.get("bias", False),
        aux_loss_type=aux_type,
        num_groups=groups and groups[0],
        group_topk=groups and groups[1],
    )
    r = _router(E, k, h, options=options)
    gen = torch.Generator().manual_seed(7)
    bias = None
    if options.enable_expert_bias:  # large enough to change some choices
        bias = torch.randn(E, generator=gen, dtype=torch.float64) * 0.2
        with torch.no_grad():
            r.expert_bias.copy_(bias)
    x = torch.randn(T, h, generator=gen, dtype=torch.float64) * 0.3
    chosen, gates, aux, seq_aux = _paper_routing(
        x, r.weight.detach(), k, spec["score"], bias, groups, spec.get("scaling"), b
    )
    route = r(x, batch_size=b)
    got = [set(row) for row in route.indices.tolist()]
    assert got == chosen, f"{name}: expert choice differs at tokens " + str(
        [t for t in range(T) if got[t] != chosen[t]]
    )
    for t in range(T):
        for j, e in enumerate(route.indices[t].tolist()):
            assert abs(route.weights[t, j].item() - gates[t][e]) < 1e-12, (name, t, e)
    want = seq_aux if aux_type == "seq" else aux
    assert abs(route.stats[E].item() - want) < 1e-12, (name, route.stats[E].item(), want)
    counts = [sum(e in c for c in chosen) for e in range(E)]
    assert route.stats[:E].tolist() == counts, "tokens per expert: the load actually routed"
    if groups is not None:  # at most group_topk groups per token
        per = E // groups[0]
        assert max(len({e // per for e in c}) for c in chosen) <= groups[1]
    if bias is not None:  # the bias must have changed some choice, or the test proves little
        unbiased = _paper_routing(x, r.weight.detach(), k, spec["score"], None, groups, None, b)
        assert unbiased[0] != chosen, "bias too small to change any choice"


def test_seq_aux_objective_gradient():
    """The sequence-wise aux term's gradient (f constant, P differentiable, sigmoid scores
    normalized per token) equals autograd on the plain float64 formula."""
    T, E, k, h, b, coeff = 20, 6, 2, 8, 4, 0.3
    options = RouterOptions(score_function="sigmoid", aux_loss_type="seq")
    r = _router(E, k, h, aux_loss_coeff=coeff, options=options)
    x = torch.randn(T, h, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    route = r(x, batch_size=b)
    route.objective.backward()
    w = r.weight.detach().clone().requires_grad_(True)
    s = torch.sigmoid(x @ w.t())  # [T, E]
    p = s / s.sum(-1, keepdim=True)
    top = torch.zeros(T, E, dtype=torch.float64).scatter(1, s.detach().topk(k).indices, 1.0)
    loss = 0.0
    for j in range(b):  # sequence j holds tokens j, j + b, ...
        rows = torch.arange(j, T, b)
        n = len(rows)
        f = E / (k * n) * top[rows].sum(0)
        loss = loss + (f * p[rows].mean(0)).sum() / b
    (coeff * loss).backward()
    torch.testing.assert_close(r.weight.grad, w.grad, rtol=1e-10, atol=1e-13)
    assert abs(route.stats[E].item() - loss.item()) < 1e-12


def test_seq_aux_of_balanced_sequences_is_one():
    """Every sequence spreads its tokens evenly with uniform probabilities: loss 1."""
    counts = torch.full((3, 4), 2.0, dtype=torch.float64)  # 4 tokens per sequence, k = 2
    probs = torch.full((3, 4), 1.0, dtype=torch.float64)  # Σ_t P_i,t = 4 · 1/4
    assert sequence_load_balancing_loss(probs, counts, 4, 2).item() == 1.0


def test_expert_bias_update_is_sign_of_mean_minus_load():
    """bias_i += rate · sign(mean − load_i), exactly, as fp32 state; a tie with the mean stays."""
    options = RouterOptions(
        score_function="sigmoid", enable_expert_bias=True, bias_update_rate=1e-3
    )
    r = TopKRouter(8, 4, 2, options=options)
    assert r.expert_bias.dtype == torch.float32 and not r.expert_bias.requires_grad
    assert "expert_bias" in r.state_dict(), "the bias is checkpointed state"
    assert [n for n, p in r.named_parameters() if p.requires_grad] == ["weight"]
    counts = torch.tensor([10.0, 2.0, 5.0, 3.0], dtype=torch.float64)  # mean 5
    want = [0.0] * 4
    for _ in range(3):
        r.update_expert_bias(counts)
        for e, c in enumerate(counts.tolist()):
            want[e] = float(
                torch.tensor(
                    want[e] + (1e-3 if c < 5 else -1e-3 if c > 5 else 0.0), dtype=torch.float32
                )
            )
    assert r.expert_bias.tolist() == want
    assert torch.equal(
        expert_bias_delta(counts, 1e-3), torch.tensor([-1e-3, 1e-3, 0, 1e-3], dtype=torch.float64)
    )


def test_router_declares_its_expert_bias_as_step_updated_state():
    """The non-finite guard finds the bias through this hook (training/nonfinite.py); a router
    without a bias declares nothing."""
    on = TopKRouter(8, 4, 2, options=RouterOptions(enable_expert_bias=True))
    ((name, tensor, key),) = on.step_updated_state()
    assert name == "expert_bias" and tensor is on.expert_bias
    assert key == "model.moe_router_bias_update_rate"
    assert TopKRouter(8, 4, 2).step_updated_state() == []


def test_group_limited_mask_keeps_best_groups():
    """Hand-made scores: group scores are the sums of each group's top k/M = 2."""
    select = torch.tensor([[0.9, 0.1, 0.0, 0.5, 0.4, 0.45, 0.3, 0.2]])  # 4 groups of 2
    # group sums (top 2 of 2): 1.0, 0.5, 0.85, 0.5 -> best two: groups 0 and 2
    mask = group_limited_mask(select, 4, 2, 4)
    assert mask.tolist() == [[True, True, False, False, True, True, False, False]]


def _group_mask_reference(select, groups: int, group_topk: int, width: int) -> list:
    """Per-token loops: a group's score is the sum of its `width` largest entries; the token
    keeps its group_topk best groups -> [T][E] bools."""
    T, E = select.shape
    per = E // groups
    out = []
    for t in range(T):
        row = select[t].tolist()
        scores = [sum(sorted(row[g * per : (g + 1) * per])[-width:]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -scores[g])[:group_topk]
        out.append([e // per in best for e in range(E)])
    return out


def test_group_score_rules_against_plain_torch():
    """16 experts in 4 groups, top-6 over 2 groups: Megatron's rule sums a group's top 3
    (topk // group_topk), DeepSeek-V3's its top 2; both against per-token loops, and the two
    rules keep different groups for some tokens."""
    select = torch.rand(200, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    masks = {}
    for rule, width in (("topk_per_group", 3), ("top2", 2)):
        masks[rule] = group_limited_mask(select, 4, 2, 6, rule)
        want = _group_mask_reference(select, 4, 2, width)
        assert masks[rule].tolist() == want, f"group score {rule}: masks differ from the loops"
    differ = (masks["topk_per_group"] != masks["top2"]).any(1).sum().item()
    assert differ > 0, "the two group scores kept the same groups for every token"
    # by hand: group 0 [0.9, 0.5, 0.0, 0.0] top-2 1.4, top-3 1.4; group 1 [0.6, 0.5, 0.45, 0]
    # top-2 1.1, top-3 1.55; groups 2, 3 lower: top2 keeps group 0, topk_per_group group 1
    one = torch.tensor([[0.9, 0.5, 0.0, 0.0, 0.6, 0.5, 0.45, 0.0] + [0.1] * 8])
    assert group_limited_mask(one, 4, 1, 3, "top2")[0, :8].tolist() == [True] * 4 + [False] * 4
    assert (
        group_limited_mask(one, 4, 1, 3, "topk_per_group")[0, :8].tolist()
        == [False] * 4 + [True] * 4
    )


def test_top2_group_score_routes_as_hf_deepseek_v3():
    """Our sigmoid router with the expert bias, group-limited top-k (group_score=top2), top-k
    renormalization and the scaling factor picks the experts and weights of transformers'
    DeepseekV3TopkRouter on the same weights and tokens; Megatron's rule (the default) picks
    other experts for some of them (top-6 over 2 of 4 groups: a group's top 3, not top 2)."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    E, h, k = 16, 32, 6
    config = DeepseekV3Config(
        hidden_size=h, n_routed_experts=E, num_experts_per_tok=k, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    hf = DeepseekV3TopkRouter(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, h, generator=g))
        hf.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.3)
    x = torch.randn(256, h, generator=g)
    _, hf_weights, hf_indices = hf(x)
    hf_sets = [set(row) for row in hf_indices.tolist()]
    chosen = {}
    for rule in ("top2", "topk_per_group"):
        options = RouterOptions(
            score_function="sigmoid", topk_scaling_factor=2.5, norm_topk=True,
            enable_expert_bias=True, num_groups=4, group_topk=2, group_score=rule,
        )  # fmt: skip
        ours = TopKRouter(h, E, k, options=options)
        with torch.no_grad():
            ours.weight.copy_(hf.weight)
            ours.expert_bias.copy_(hf.e_score_correction_bias)
        route = ours(x)
        chosen[rule] = [set(row) for row in route.indices.tolist()]
        if rule == "top2":
            assert chosen[rule] == hf_sets, "top2: other experts than HF DeepSeek-V3's"
            order = route.indices.argsort(1), hf_indices.argsort(1)
            w_ours, w_hf = route.weights.gather(1, order[0]), hf_weights.gather(1, order[1])
            torch.testing.assert_close(w_ours, w_hf, rtol=1e-6, atol=1e-6)
    differ = sum(a != b for a, b in zip(chosen["topk_per_group"], hf_sets, strict=True))
    print(f"topk_per_group picks other experts than DeepSeek-V3 for {differ} of 256 tokens")
    assert differ > 0, "the default rule should differ from DeepSeek-V3's on this case"


def test_dry_run_routes_with_every_router_option():
    """Under a dry run (fake tensors, torch's fake process group, EP rank 1 of 2) a layer with
    sigmoid scores, the expert bias, the sequence-wise aux loss and group-limited routing runs
    forward, backward, moe_metrics and the bias update on balanced routing's nominal counts."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_lite.moe import MoELayer, moe_metrics
    from megatron_lite.parallel.fake import FakeTensorMode

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        options = RouterOptions(
            score_function="sigmoid",
            enable_expert_bias=True,
            aux_loss_type="seq",
            num_groups=2,
            group_topk=1,
        )
        with FakeTensorMode(allow_non_fake_inputs=True):
            layer = MoELayer(
                16, 8, 4, 2, ep_group=dist.group.WORLD, aux_loss_coeff=0.01, router_options=options
            )
            x = torch.randn(7, 2, 16, requires_grad=True)  # [s, b, h]
            layer(x).sum().backward()
            metrics = moe_metrics(
                [layer], 1, 4, True, group=dist.group.WORLD, expert_bias=True, update_bias=True
            )
    finally:
        dist.destroy_process_group()
    # 14 tokens · 2 = 28 assignments over 4 experts: 7 each
    assert metrics["aux_loss"] == 1.0 and metrics["load_max_mean_ratio"] == 1.0
    assert metrics["expert_bias_min"] == metrics["expert_bias_max"] == 0.0
    assert metrics["moe/layer_0/expert_bias_max"] == 0.0
    assert metrics["tokens_per_expert_max"] == metrics["tokens_per_expert_min"] == 7


@pytest.mark.parametrize(
    "kw",
    [
        dict(score_function="tanh"),
        dict(aux_loss_type="token"),
        dict(num_groups=4),
        dict(num_groups=3, group_topk=1),  # 3 does not divide 8
        dict(num_groups=4, group_topk=2, enable_expert_bias=True),  # k=1 < group_topk
        dict(group_score="max"),
        dict(num_groups=8, group_topk=2, group_score="top2"),  # a group of 1 has no top 2
    ],
)
def test_router_rejects_inconsistent_options(kw):
    k = 1 if "enable_expert_bias" in kw else 2
    with pytest.raises(ValueError, match="RouterOptions"):
        TopKRouter(8, 8, k, options=RouterOptions(**kw))
