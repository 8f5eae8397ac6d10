"""Device placement of a dry-run step on CUDA (`plan --dry-run --device cuda`).

On a GPU every tensor of a rank's step lives on its device, `cuda:<local rank>`, except what
is meant to be on the host. A tensor made without `device=` lands on the CPU; on a GPU run
that is an error at the first op that mixes it with device tensors, or a silent host copy
per step. `DeviceCheck`, a dispatch mode around the dry run's step on fake CUDA tensors,
finds it where it is made:

- a factory op (`torch.zeros/empty/full/arange/tensor/...`: no tensor input) whose output
  is not on the rank's device is a `DeviceMismatch` naming the source line that made it
  ("tensor created on cpu at megatron_lite/x.py:123 in fn (expected cuda:0)"), unless that
  line is in a HOST_SITES function, which keeps tensors on the host by design;
- an op whose tensor inputs are on two devices (a 0-d CPU tensor beside CUDA ones is
  allowed, as CUDA allows it) is a DeviceMismatch naming its line, and where the CPU operand
  was made when this mode saw it made;
- a tensor on another GPU (`cuda:1` on local rank 0) is a DeviceMismatch.

Explicit moves (`.to(device)`, `.cpu()`, `copy_`) are not factories and are not checked: a
move to the host is a host sync (plan/host_sync.py counts it). The same mode records the
ops that sync the host (host_sync.SYNC_OPS, device-to-host copies) in a HostSyncs.
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from megatron_lite.plan.host_sync import SYNC_OPS, TORCH, HostSyncs, caller_file, source_line

aten = torch.ops.aten
# functions that keep their tensors on the host by design, as (file in megatron_lite,
# function): their CPU factories are not mismatches (a CPU tensor of theirs that later meets
# a device tensor in one op still is)
HOST_SITES = {
    ("data", "*"): "the data pipeline reads token ids on the host; the Trainer moves them",
    ("moe/experts.py", "_group_ends"): "the expert groups' row ends, built on the host from "
    "the split sizes already read, then moved to the device",
    ("parallel/random.py", "*"): "the RNG states (the CPU generator's state is a CPU tensor)",
    ("parallel/params.py", "_draw"): "the layout-independent init draws each block on the "
    "host's generator (the same numbers for any layout), then copies it to the device",
    ("parallel/params.py", "_draw_nothing"): "_draw's host blocks, allocated for a dry run",
    ("parallel/activation_offload.py", "_host_copy"): "model.activation_offload's host copies "
    "of saved tensors (pinned on a GPU); their reloads are checked like any device tensor",
}
# torch.distributed's host tensors are meant to be on the host (object collectives, meshes)
DISTRIBUTED = os.path.join(TORCH, "distributed")
FAKE_CUDA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda.py")
# ops that move a tensor between devices on purpose (not a misplaced tensor)
MOVES = {aten._to_copy, aten.copy_, aten._copy_from, aten._copy_from_and_resize}


class DeviceMismatch(RuntimeError):
    """A tensor of the step on the wrong device (module docstring); `where` is its line."""

    def __init__(self, message: str, where: str = ""):
        super().__init__(message)
        self.where = where

    def __reduce__(self):  # across a dry run's worker processes, with its line
        return type(self), (str(self), self.where)


def _host_site(where: str) -> bool:
    """Whether `where` ("megatron_lite/x.py:12 in fn") is in a HOST_SITES function."""
    path, _, fn = where.partition(" in ")
    rel = path.rsplit(":", 1)[0].removeprefix("megatron_lite/")
    return any(
        (rel == f or (rel.startswith(f + "/") and g == "*")) and g in ("*", fn)
        for (f, g) in HOST_SITES
    )


def _host_in_cxx(kwargs: dict, inputs: list) -> bool:
    """Whether an op's `device=cpu` is torch's C++ taking a fake CUDA tensor's device from its
    options, which say cpu (parallel/fake.py cuda_on_host): an op given a CUDA input, or one
    made by torch's own code (autograd's formulas, torch.nn.functional's C++), not ours."""
    device = kwargs.get("device")
    if device is None or torch.device(device).type != "cpu":
        return False
    if caller_file(machinery=True) == FAKE_CUDA:  # a move's destination, on the host
        return False
    if any(t.is_cuda for t in inputs):
        return True
    name = caller_file()
    return name.startswith(TORCH) and not name.startswith(DISTRIBUTED)


class DeviceCheck(TorchDispatchMode):
    """See the module docstring. `device`: the rank's GPU; `syncs`: where host syncs go.
    Enter it inside the FakeTensorMode (it sees each op before the fake mode runs it)."""

    def __init__(self, device: torch.device, syncs: HostSyncs):
        super().__init__()
        self.device, self.syncs = device, syncs
        self.made = WeakIdKeyDictionary()  # CPU tensor -> the line that made it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        packet = func.overloadpacket
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if _host_in_cxx(kwargs, inputs):
            kwargs["device"] = self.device
        self._syncs(packet, args, inputs, kwargs)
        if packet not in MOVES:
            self._check_inputs(packet, inputs)
        out = func(*args, **kwargs)
        if not inputs and caller_file(machinery=True) != FAKE_CUDA:
            self._check_made(packet, out)  # (fake_cuda's are the destinations of moves)
        elif packet is aten.lift_fresh:  # torch.tensor(data): made on the host, as on a GPU
            self._note_made(out)
        return out

    def _syncs(self, packet, args, inputs, kwargs) -> None:
        kind = SYNC_OPS.get(packet)
        if packet is aten.index and any(
            t is not None and t.dtype == torch.bool for t in args[1] if isinstance(t, torch.Tensor)
        ):
            kind = "boolean mask"
        elif packet is aten._to_copy and inputs[0].device.type == "cuda":
            to = kwargs.get("device")
            host = to is not None and to.type == "cpu" and not kwargs.get("non_blocking")
            kind = "device-to-host copy" if host else kind
        elif packet is aten.copy_ and args[0].device.type == "cpu" and args[1].is_cuda:
            # a non_blocking copy (into pinned memory, e.g. activation offload's on its side
            # stream) returns at once: the host waits only where it waits for its event
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            kind = None if non_blocking else "device-to-host copy"
        if kind is not None:
            self.syncs.record(kind)

    def _check_inputs(self, packet, inputs: list[torch.Tensor]) -> None:
        devices = {t.device for t in inputs if t.device.type != "meta"}
        cuda = {d for d in devices if d.type == "cuda"}
        wrong_gpu = cuda - {self.device}
        if wrong_gpu:
            where = source_line()
            raise DeviceMismatch(
                f"{packet} on {sorted(map(str, wrong_gpu))} at {where} (expected "
                f"{self.device}): a tensor on another rank's GPU",
                where,
            )
        hosts = [t for t in inputs if t.device.type == "cpu" and t.dim() > 0]
        if cuda and hosts:
            where = source_line()
            made = self.made.get(hosts[0])
            origin = f"; the cpu tensor was created at {made}" if made else ""
            raise DeviceMismatch(
                f"{packet} mixes cpu and {self.device} tensors at {where}{origin} (expected "
                f"{self.device})",
                where,
            )

    def _note_made(self, out) -> None:
        """Remember where host tensors made from Python data were made (for a later mix)."""
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.made[t] = source_line()

    def _check_made(self, packet, out) -> None:
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device in (self.device,):
                continue
            if t.device.type == "meta":
                continue
            where = source_line()
            if t.device.type == "cpu" and _host_site(where):
                self.made[t] = where
                continue
            if t.device.type == "cpu" and where == "<torch>":
                self.made[t] = where  # torch's own host-side tensors (a DeviceMesh's table)
                continue
            raise DeviceMismatch(
                f"tensor created on {t.device} at {where} (expected {self.device}) by {packet}",
                where,
            )
