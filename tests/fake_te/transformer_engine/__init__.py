"""Test stand-in for Transformer Engine (see tests/fake_te/README.md)."""
