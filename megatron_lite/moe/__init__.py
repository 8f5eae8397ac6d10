"""Mixture of experts: top-k router, all-to-all token dispatcher over EP, grouped experts."""

from megatron_lite.moe.dispatcher import AllToAllTokenDispatcher
from megatron_lite.moe.experts import LocalExperts
from megatron_lite.moe.layer import MoELayer, moe_metrics
from megatron_lite.moe.router import MoEAuxLossAutoScaler, RouterOptions, TopKRouter

__all__ = [
    "AllToAllTokenDispatcher",
    "LocalExperts",
    "MoEAuxLossAutoScaler",
    "MoELayer",
    "RouterOptions",
    "TopKRouter",
    "moe_metrics",
]
