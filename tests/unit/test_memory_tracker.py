"""The memory tracker counts what a device would hold: a real tensor's storage and a dry run's
fake tensor (its storage is on meta, its device the one it stands for), never a meta tensor
(a model built on meta before its weights get storage holds nothing)."""

import torch

from megatron_lite.parallel.fake import FakeTensorMode
from megatron_lite.training.memory_tracker import MemoryTracker


def _allocate() -> tuple[int, int]:
    with MemoryTracker() as tracker:
        meta = torch.empty(1000, device="meta")  # 4,000 bytes on meta: nothing
        alive = [meta, torch.empty(1000), meta.new_empty(500)]  # 4,000 bytes; meta again
        total, peak = tracker.total, tracker.peak.total
        del alive
        return total, peak


def test_meta_tensors_are_not_counted_real_or_fake():
    assert _allocate() == (4000, 4000)
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert _allocate() == (4000, 4000)
