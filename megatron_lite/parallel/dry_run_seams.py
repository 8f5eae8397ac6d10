"""The dry run's seams: every place where the real code behaves differently under
`python -m megatron_lite.plan --dry-run`, and why.

A dry run (plan/dry_run.py) runs the real Trainer at full size on one CPU: its tensors live
under `FakeTensorMode` (shapes, dtypes and devices, no data) and its process groups on torch's
`fake` backend (every collective returns at once, moving nothing). Almost all code runs
unchanged on both. Where it cannot (it reads a value back to Python, or it must choose a
device or a kernel that only exists with real data), it asks one of six named functions, the
seams:

- `host.read(t, nominal)` (parallel/host.py): `t.tolist()`; under a dry run the caller's
  nominal value instead (a finite loss, balanced routing, the full token count);
- `fake.is_fake(t)` (parallel/fake.py): whether `t` is a fake tensor (no data to read or
  compute on);
- `fake.active()` (parallel/fake.py): whether the code runs under FakeTensorMode (a choice made
  before any tensor exists: where to build, which optimizer kernel);
- `fake.real_tensors()` (parallel/fake.py): a context where tensors are real even under a dry
  run (a rank table read on the host);
- "fake group", `dist.get_backend(group) == "fake"` (torch): whether a group is the dry run's
  fake process group (object collectives keep each rank's own object; no links to check);
- `dispatch.is_fake(x)` (kernels/dispatch.py): the kernels' own `is_fake` (they import nothing
  of the package): a fake tensor allocates the Triton kernels' outputs, and no kernel launches.

`CALL_SITES` lists every call of a seam in the package (and `kernels/`), by file and function,
with why it is there: it is the one list to read to know what a dry run does not run as a
real run does. tests/unit/test_dry_run_seams.py parses the sources and fails, naming the file
and line, on a call that is not listed here, and on a listed one that is gone. To add one,
add its entry here with the reason; prefer passing a value in (a nominal, a flag) over a new
kind of seam. torch's private fake-tensor API is imported only by parallel/fake.py (and by
kernels/dispatch.py, which imports nothing of the package: its own `is_fake`).

Not seams: the dry run's drivers, which create the fake world (plan/dry_run.py, and the
planner's modules that run layers on fake tensors), and the memory tracker, which follows
allocations of real and fake tensors alike.
"""

from __future__ import annotations

from dataclasses import dataclass

SEAMS = (
    "host.read",
    "fake.is_fake",
    "fake.active",
    "fake.real_tensors",
    "fake group",
    "dispatch.is_fake",
)


@dataclass(frozen=True)
class CallSite:
    """A call of `seam` (one of SEAMS) in `function` ("Class.method", or "<module>") of the
    file `path` (relative to the repository root), for the reason `why`."""

    seam: str
    path: str
    function: str
    why: str


def _sites(seam: str, path: str, *entries: tuple[str, str]) -> tuple[CallSite, ...]:
    return tuple(CallSite(seam, path, function, why) for function, why in entries)


# an immutable table (tuples of frozen dataclasses), read by the test and by readers
CALL_SITES: tuple[CallSite, ...] = (
    # the training step's reads: what the step needs as Python numbers
    *_sites(
        "host.read",
        "megatron_lite/training/step.py",
        ("TrainStep.global_tokens", "the global token count the loss is divided by: full"),
        ("TrainStep._attempt", "the reduced Σg², loss and flags: unit norm, loss 1, no signals"),
    ),
    *_sites(
        "host.read",
        "megatron_lite/training/straggler.py",
        ("StragglerDetector.report", "every rank's compute times: this rank's, for each rank"),
    ),
    *_sites(
        "host.read",
        "megatron_lite/training/reporting.py",
        ("MemoryReport.report", "the mem/* maxima over ranks: this rank's own"),
    ),
    *_sites(
        "host.read",
        "megatron_lite/training/nonfinite.py",
        ("StateGuard.__init__", "whether any rank declares step-updated state: this rank's"),
        ("StateGuard.check", "non-finite step-updated state anywhere: none"),
    ),
    *_sites(
        "host.read",
        "megatron_lite/checkpoint/rank_agreement.py",
        ("RankAgreement.any", "a flag agreed over the ranks: this rank's"),
    ),
    # MoE: token counts size the all-to-all; a dry run routes evenly
    *_sites(
        "host.read",
        "megatron_lite/moe/router.py",
        ("TopKRouter.forward", "the token count of the aux loss: even sequence shards"),
    ),
    *_sites(
        "host.read",
        "megatron_lite/moe/dispatcher.py",
        ("AllToAllTokenDispatcher.dispatch", "the all-to-all's split sizes: balanced routing"),
    ),
    *_sites(
        "host.read",
        "megatron_lite/moe/layer.py",
        ("moe_metrics", "the step's reduced MoE statistics: this rank's share, zero bias"),
    ),
    *_sites(
        "host.read",
        "megatron_lite/context/ring.py",
        ("_doc_bounds", "the packed documents in each ring segment: one document"),
    ),
    *_sites(
        "host.read",
        "megatron_lite/plan/host_sync.py",
        ("counting_reads", "the CUDA dry run wraps the seam to count each read as a host sync"),
    ),
    *_sites(
        "fake.is_fake",
        "megatron_lite/parallel/host.py",
        ("read", "the seam itself: a fake tensor has no values to read"),
    ),
    *_sites(
        "fake.is_fake",
        "megatron_lite/moe/experts.py",
        (
            "grouped_mm",
            "the grouped GEMM's per-expert loop reads the split sizes: use the "
            "native op's allocation instead",
        ),
    ),  # fmt: skip
    *_sites(
        "fake.is_fake",
        "megatron_lite/parallel/activation_offload.py",
        (
            "ActivationOffloader._pack",
            "a dry run's fake activations are offloaded as a run's are (device and host bytes)",
        ),
    ),
    *_sites(
        "fake.active",
        "megatron_lite/models/__init__.py",
        ("build_model", "fake tensors have no storage to give later: build on the device"),
    ),
    *_sites(
        "fake.active",
        "megatron_lite/training/model_setup.py",
        ("setup_model_and_optimizer", "model.compile: a dry run measures the eager step"),
    ),
    *_sites(
        "fake.is_fake",
        "megatron_lite/moe/experts.py",
        (
            "LocalExperts.forward",
            "model.fp8's grouped GEMM casts by amax: fake tensors take "
            "the bf16 GEMM (the same shapes)",
        ),
    ),
    *_sites(
        "fake.active",
        "megatron_lite/parallel/params.py",
        ("_draw", "a fake shard holds no values: draw nothing (shapes only)"),
    ),
    *_sites(
        "fake.active",
        "megatron_lite/parallel/data_parallel/optimizer.py",
        ("ShardedOptimizer.__init__", "offload: the host's copy ops, there is no CUDA stream"),
        ("ShardedOptimizer.__init__", "the GPU's fused optimizer step and its allocations"),
    ),
    *_sites(
        "fake.active",
        "megatron_lite/parallel/data_parallel/ddp.py",
        ("DataParallel.__init__", "NVMe offload: a dry run writes no swap file (as cpu)"),
    ),
    *_sites(
        "fake.active",
        "megatron_lite/parallel/data_parallel/fsdp_optimizer.py",
        ("FSDPOptimizer.__init__", "the GPU's fused optimizer step and its allocations"),
    ),
    *_sites(
        "fake.active",
        "megatron_lite/parallel/data_parallel/fsdp_whole_matrix.py",
        ("FSDPWholeMatrixOptimizer.__init__", "the GPU's fused optimizer step and allocations"),
    ),
    *_sites(
        "fake.real_tensors",
        "megatron_lite/parallel/data_parallel/fsdp.py",
        ("sharding_mesh", "a DeviceMesh's rank table is read on the host"),
    ),
    *_sites(
        "fake group",
        "megatron_lite/parallel/mappings.py",
        ("host_backend", "checkpoint groups on host tensors: fake under a dry run, not gloo"),
        ("broadcast_objects", "a fake group moves no objects: each rank keeps its own"),
        ("all_gather_objects", "a fake group moves no objects: every entry is this rank's"),
    ),
    *_sites(
        "fake group",
        "megatron_lite/pipeline/p2p.py",
        ("warm_up", "no links to check in a fake world"),
    ),
    *_sites(
        "dispatch.is_fake",
        "kernels/dispatch.py",
        ("launch", "no data to compute: the caller's outputs are what a dry run measures"),
        ("use_triton", "automatic dispatch: the GPU's kernels, no self-check on fake values"),
        ("use_triton", "forced Triton: the GPU's kernels even on a CPU dry run"),
    ),
)
