"""The memory/throughput planner (python -m megatron_lite.plan): per-rank memory by term,
predicted step time, a layout search and a one-step measurement beside the prediction."""
