"""Group-limited routing's group score (light: no torch, read by config validation too).

A token keeps the group_topk expert groups whose scores are highest; a group's score is the
sum of its top n selection scores: n = topk // group_topk ("topk_per_group",
Megatron-Core's group_limited_topk) or n = 2 ("top2", DeepSeek-V3's released code and HF's
DeepseekV3TopkRouter). They agree when topk = 2·group_topk (DeepSeek-V3: top-8 over 4 of 8
groups)."""

from __future__ import annotations

GROUP_SCORES = ("topk_per_group", "top2")  # the values of model.moe_router_group_score


def group_score_width(group_score: str, topk: int, group_topk: int) -> int:
    """How many of a group's best selection scores its group score sums."""
    if group_score == "topk_per_group":
        return topk // group_topk
    if group_score == "top2":
        return 2
    raise ValueError(
        f"model.moe_router_group_score={group_score!r}: must be one of {', '.join(GROUP_SCORES)}"
    )
