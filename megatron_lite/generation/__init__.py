"""Text generation from trained or converted weights (`python -m megatron_lite.generate`):
where the weights come from (sources.py), the model built on a tensor-parallel mesh and
filled by the checkpoint machinery (model.py), and KV-cached decoding (decode.py)."""
