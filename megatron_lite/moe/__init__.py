"""Mixture of experts: top-k router, all-to-all token dispatcher over EP, grouped experts.

The exports load on first use (megatron_lite/lazy.py), so config validation can read the
routing rules of group_score.py without loading the layers (and with them DTensor)."""

from megatron_lite.lazy import lazy_exports

# name -> module: loaded on first use
_EXPORTS = {
    "AllToAllTokenDispatcher": "dispatcher",
    "LocalExperts": "experts",
    "MoEAuxLossAutoScaler": "router",
    "MoELayer": "layer",
    "RouterOptions": "router",
    "TopKRouter": "router",
    "moe_metrics": "layer",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
