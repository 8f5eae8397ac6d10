"""Routing benchmarks of issue 21 (imported by tools/bench_moe.py; `python
tools/bench_moe_routing.py` prints both):

- `balancing()`: aux-loss-free balancing. A sigmoid router whose weights send most tokens to a
  few experts (frozen weights, no aux loss) routes fresh tokens every step; after each step the
  expert bias moves by rate · sign(mean − load) from that step's token counts (the same
  `TopKRouter.update_expert_bias` the trainer calls). Reports the max/mean expert load per step
  and the first step it falls below 1.2.
- `group_destinations()`: group-limited routing on a real expert-parallel dispatch (gloo ranks
  on this CPU): the distinct EP ranks each token's rows are sent to, read from the all-to-all's
  send splits, with groups = EP ranks, against the same router without the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch


def _skewed_router(num_experts: int, topk: int, hidden: int, hot: int, skew: float, rate: float):
    """A sigmoid router with the expert bias on, whose first `hot` experts score `skew` higher
    in logit for tokens drawn around the mean direction `mean` (returned with it)."""
    from megatron_lite.moe.router import RouterOptions, TopKRouter

    gen = torch.Generator().manual_seed(0)
    options = RouterOptions(
        score_function="sigmoid", enable_expert_bias=True, bias_update_rate=rate
    )
    router = TopKRouter(hidden, num_experts, topk, options=options)
    mean = torch.randn(hidden, generator=gen)
    mean = mean / mean.norm()
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=gen) * 0.02)
        router.weight[:hot] += skew * mean  # logit + skew for tokens near the mean
    return router, mean


@torch.no_grad()
def balancing(
    num_experts: int = 64,
    topk: int = 8,
    hidden: int = 64,
    tokens: int = 4096,
    steps: int = 200,
    rate: float = 1e-3,
    hot: int = 4,
    skew: float = 0.15,
    threshold: float = 1.2,
) -> dict:
    """Max/mean expert load per step of a skewed router balanced by its expert bias alone.

    Returns: the settings, `start_ratio` (step 0, bias zero), `crossed_at` (first step whose
    max/mean is below `threshold`, None if none), `final_ratio`, `max_ratio_after_cross` (the
    worst step after crossing: it stays balanced), `hot_share_start`/`_end` (the hot experts'
    share of the assignments), `bias_min`/`bias_max` at the end and `curve` (every 10th
    step's ratio)."""
    router, mean = _skewed_router(num_experts, topk, hidden, hot, skew, rate)
    gen = torch.Generator().manual_seed(1)
    ratios, hot_shares = [], []
    for _ in range(steps):
        x = torch.randn(tokens, hidden, generator=gen) + 3.0 * mean  # [T, h] fresh tokens
        counts = router(x).stats[:num_experts]  # [E] assignments (what moe_metrics sums)
        ratios.append((counts.max() / counts.mean()).item())
        hot_shares.append((counts[:hot].sum() / counts.sum()).item())
        router.update_expert_bias(counts)
    crossed = next((i for i, r in enumerate(ratios) if r < threshold), None)
    return {
        "num_experts": num_experts,
        "topk": topk,
        "tokens_per_step": tokens,
        "rate": rate,
        "threshold": threshold,
        "start_ratio": ratios[0],
        "crossed_at": crossed,
        "final_ratio": ratios[-1],
        "max_ratio_after_cross": max(ratios[crossed:]) if crossed is not None else None,
        "hot_share_start": hot_shares[0],
        "hot_share_end": hot_shares[-1],
        "bias_min": router.expert_bias.min().item(),
        "bias_max": router.expert_bias.max().item(),
        "curve": {i: round(ratios[i], 4) for i in range(0, steps, 10)},
    }


def _destinations(rank, world, store_path, num_experts, topk, group_topk, queue):
    """One rank of group_destinations: real MoE layer forwards over a gloo EP group of all
    ranks, with groups = EP ranks and without; sends back, for each, the distinct destination
    ranks of each of its tokens."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    try:
        limited = _count_destinations(rank, world, num_experts, topk, world, group_topk)
        free = _count_destinations(rank, world, num_experts, topk, None, None)
        queue.put((rank, limited, free))
    finally:
        dist.destroy_process_group()


def _count_destinations(rank, world, num_experts, topk, groups, group_topk) -> list[int]:
    import torch.distributed as dist

    from megatron_lite.moe import MoELayer
    from megatron_lite.moe.router import RouterOptions

    torch.manual_seed(0)  # the same weights on every rank
    options = RouterOptions(
        score_function="sigmoid", enable_expert_bias=True, num_groups=groups, group_topk=group_topk
    )
    hidden = 32
    layer = MoELayer(
        hidden, 16, num_experts, topk, ep_group=dist.group.WORLD, router_options=options
    )
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 1.0)
        layer.router.expert_bias.normal_(0.0, 0.5)  # a trained-looking bias
    handles = []
    dispatch = layer.dispatcher.dispatch

    def recording(*args, **kwargs):
        out = dispatch(*args, **kwargs)
        handles.append(out[2])
        return out

    layer.dispatcher.dispatch = recording
    torch.manual_seed(1 + rank)  # each rank's own tokens
    with torch.no_grad():
        layer(torch.randn(256, 2, hidden))  # [s, b, h]: 512 tokens per rank
    h = handles[0]
    dest = torch.repeat_interleave(torch.arange(world), torch.tensor(h.send_splits))  # [N]
    per_token = [set() for _ in range(h.num_tokens)]
    for t, r in zip(h.token_ids.tolist(), dest.tolist(), strict=True):
        per_token[t].add(r)
    return [len(d) for d in per_token]


def group_destinations(
    ep: int = 4, num_experts: int = 64, topk: int = 8, group_topk: int = 2
) -> dict:
    """Distinct EP ranks per token's dispatch (gloo ranks forked here) with groups = EP ranks
    (each owns E/ep contiguous experts) and `group_topk` groups per token, against the same
    router without the limit. Returns max/mean destinations of both; the bound is group_topk."""
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "megatron_lite.moe"])
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        args = (ep, store, num_experts, topk, group_topk, queue)
        procs = [ctx.Process(target=_destinations, args=(r, *args)) for r in range(ep)]
        for p in procs:
            p.start()
        results = {r: (a, b) for r, a, b in (queue.get(timeout=300) for _ in procs)}
        for p in procs:
            p.join(timeout=60)
    limited = [n for r in range(ep) for n in results[r][0]]
    free = [n for r in range(ep) for n in results[r][1]]
    return {
        "ep": ep,
        "num_experts": num_experts,
        "topk": topk,
        "group_topk": group_topk,
        "tokens": len(limited),
        "max_destinations": max(limited),
        "mean_destinations": sum(limited) / len(limited),
        "unlimited_max_destinations": max(free),
        "unlimited_mean_destinations": sum(free) / len(free),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ep", type=int, default=4)
    args = parser.parse_args()
    print(json.dumps({"balancing": balancing(steps=args.steps)}, indent=1))
    print(json.dumps({"group_destinations": group_destinations(ep=args.ep)}, indent=1))


if __name__ == "__main__":
    main()
