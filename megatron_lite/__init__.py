"""megatron_lite: Megatron-style multi-dimensional parallel pretraining on PyTorch."""

__version__ = "0.1.0"
