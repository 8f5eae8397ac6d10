"""Router top-k, load-balancing/z losses, the aux-loss gradient injection and capacity dropping
against plain float64 formulas (single process, no process group)."""

import math

import torch

from megatron_lite.moe.router import (
    MoEAuxLossAutoScaler,
    TopKRouter,
    capacity_keep,
    expert_capacity,
    gather_token_shards,
    load_balancing_loss,
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
