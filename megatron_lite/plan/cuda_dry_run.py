"""`plan --dry-run --device cuda`: the dry run's step on fake CUDA tensors, its device
placement checked and its host synchronizations counted (docs/cuda_dry_run.md).

`cuda_step(rank, devices)` is the context plan/dry_run.py `run_rank` runs a rank's build and
steps in: the stand-in CUDA runtime (plan/fake_cuda.py) with this rank's GPU current
(`cuda:<rank mod devices>`, as train.py's local_device sets it), a FakeTensorMode, and the
DeviceCheck (plan/device_check.py) that raises DeviceMismatch at the first tensor of the step
made on the wrong device and records host syncs (plan/host_sync.py). `attach(audit,
tracker)` gives the audit the MemoryTracker that names the step's phases; `audit.in_step(k)`
marks step k's syncs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from megatron_lite.plan.host_sync import HostSyncs, counting_reads, sync_table

DEVICES_PER_NODE = 8  # the GPUs a rank's node shows (local rank = rank mod this)


@dataclass
class Audit:
    """What a CUDA dry run of one rank saw: its device and its host syncs."""

    device: str
    syncs: HostSyncs

    def in_step(self, step: int):
        return self.syncs.in_step(step)

    def attach(self, tracker) -> None:
        """Take phases from `tracker` (a MemoryTracker): its `where()`, and each phase's exit
        (the syncs between phases are named by the phase before them)."""
        self.syncs.tracker = tracker
        phase, syncs = tracker.phase, self.syncs

        @contextlib.contextmanager
        def noted(name: str, working: bool = False):
            with phase(name, working):
                yield
            syncs.note_phase(name)

        tracker.phase = noted


@contextlib.contextmanager
def cuda_step(rank: int, devices: int = DEVICES_PER_NODE) -> Iterator[Audit]:
    """The context of a rank's CUDA dry run (module docstring); yields its Audit."""
    from megatron_lite.parallel.fake import FakeTensorMode
    from megatron_lite.plan.device_check import DeviceCheck
    from megatron_lite.plan.fake_cuda import fake_cuda

    syncs = HostSyncs()
    # made before CUDA looks available (FakeTensorMode's avoid_device_init: no CUDA init)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_cuda(rank % devices, devices, on_sync=syncs.record) as device:
        audit = Audit(str(device), syncs)
        with (
            mode,
            DeviceCheck(device, syncs),
            counting_reads(syncs),
        ):
            yield audit


def steady_syncs(audit: Audit) -> dict:
    """The steady step's (step 1's) syncs: {"phase|kind|where": count}."""
    return {"|".join(k): n for k, n in sorted(audit.syncs.counts(1).items())}


def syncs_report(by_key: dict, microbatches: int) -> str:
    """steady_syncs' figures as sync_table's lines."""
    from collections import Counter

    counts = Counter({tuple(k.split("|", 2)): n for k, n in by_key.items()})
    return sync_table(counts, microbatches)
