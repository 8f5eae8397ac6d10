"""The NVMe swap (data_parallel/nvme.py, nvme_io.py) without processes: the ring buffer, the
groups, a ShardedOptimizer stepping through the swap file against the same optimizer with its
states in host memory (CPU offload; bitwise: the same torch AdamW on the same values), the
checkpoint staging round trip, stale directories, and the errors naming the path."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch

from megatron_lite.parallel.data_parallel import nvme_io
from megatron_lite.parallel.data_parallel.nvme import NvmeSettings, Ring, plan_groups
from megatron_lite.parallel.data_parallel.optimizer import Piece, ShardedOptimizer
from megatron_lite.parallel.data_parallel.optimizer_spec import ADAMW, hyperparameters

SIZES = [(64, 40), (300,), (17, 5), (1000,), (33,), (128, 8)]  # parameters' shapes


def _pieces(offload: str, dtype=torch.float32) -> tuple[list[Piece], SimpleNamespace]:
    """One piece per parameter (a whole shard), over a stand-in buffer (the fields Piece reads),
    whose weights are `dtype` (the masters fp32)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SIZES]
    n = sum(p.numel() for p in params)
    data = torch.cat([p.detach().view(-1) for p in params])
    starts = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
    ranges = {id(p): SimpleNamespace(start=s) for p, s in zip(params, starts, strict=True)}
    buf = SimpleNamespace(param_data=data, grad_shard=torch.zeros(n), names={}, ranges=ranges,
                          shard_size=1, group=None, replica_group=None)  # fmt: skip
    pieces = []
    for p, s in zip(params, starts, strict=True):
        master = torch.nn.Parameter(
            torch.empty(0)
            if offload == "nvme"
            else data[s : s + p.numel()].to(torch.float32, copy=True)
        )
        pieces.append(Piece(buf, p, s, s + p.numel(), s, master, False, swapped=offload == "nvme"))
    return pieces, buf


def _optimizer(offload: str, tmp, buffer_bytes: int, dtype=torch.float32):
    pieces, buf = _pieces(offload, dtype)
    hyper = hyperparameters(ADAMW, {"lr": 1e-2, "weight_decay": 0.1})
    settings = NvmeSettings(str(tmp), buffer_bytes, 0) if offload == "nvme" else None
    return ShardedOptimizer(pieces, ADAMW, hyper, offload, None, settings), buf


def _train(opt, buf, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        buf.grad_shard.copy_(torch.randn(buf.grad_shard.shape, generator=g))  # fp32 grads
        opt.step()


def test_ring_is_fifo_and_wraps():
    ring = Ring(10)
    assert [ring.take(4), ring.take(4)] == [0, 4]
    assert ring.fits(4) is None  # 2 left at the end, none before the oldest
    ring.give_back()
    assert ring.take(3) == 0  # wraps to the freed start
    assert ring.fits(2) is None  # [3, 4) is free but too small; [8, 10) lies beyond the newest
    ring.give_back()
    assert ring.take(5) == 3


def test_groups_hold_at_most_half_the_buffer_and_tile_the_file():
    sizes = [10, 30, 20, 60, 5, 5]
    groups = plan_groups(sizes, 80)
    assert [(g.first, g.last) for g in groups] == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert [g.offset for g in groups] == [0, 40, 60, 120]  # back to back
    assert all(g.nbytes <= 40 or g.last - g.first == 1 for g in groups)


@pytest.mark.parametrize(
    "buffer_bytes, dtype",
    [(40_000, torch.float32), (1 << 20, torch.float32), (40_000, torch.bfloat16)],
)  # 3 groups (one deferred read); one group; bf16 weights (fp32 masters)
def test_swapped_steps_equal_host_states_bitwise(tmp_path, buffer_bytes, dtype):
    ref, ref_buf = _optimizer("cpu", tmp_path, 0, dtype)
    got, got_buf = _optimizer("nvme", tmp_path, buffer_bytes, dtype)
    assert len(got.swap.groups) == (3 if buffer_bytes == 40_000 else 1)
    _train(ref, ref_buf)
    _train(got, got_buf)
    assert torch.equal(got_buf.param_data, ref_buf.param_data), "weights differ after 3 steps"
    for a, b in zip(got.state_shards(), ref.state_shards(), strict=True):
        for k in b.states:
            assert torch.equal(a.states[k], b.states[k]), f"state {k} differs"
        assert a.step.item() == b.step.item() == 3
    got.close()
    assert os.listdir(tmp_path) == [], "close() leaves the swap directory"


def test_loaded_states_are_committed_to_the_swap_file(tmp_path):
    opt, buf = _optimizer("nvme", tmp_path, 40_000)
    _train(opt, buf, 1)
    shards = opt.state_shards()  # what a load fills: host copies, then commit
    for s in shards:
        for t in s.states.values():
            t.fill_(0.5)
    opt.commit_loaded_states()
    for s in opt.state_shards():
        assert all(bool((t == 0.5).all()) for t in s.states.values())
    opt.close()


def test_stale_directories_are_discarded_live_ones_kept(tmp_path):
    dead = tmp_path / nvme_io.swap_dir_name(0, pid=2**22 + 7)  # beyond pid_max: never alive
    reused = tmp_path / (nvme_io.swap_dir_name(1, pid=os.getpid()).rsplit(".", 2)[0] + ".1.rank1")
    live = tmp_path / nvme_io.swap_dir_name(3, pid=os.getppid())
    other = tmp_path / "unrelated"
    for d in (dead, reused, live, other):
        d.mkdir()
    opt, _ = _optimizer("nvme", tmp_path, 40_000)
    left = sorted(os.listdir(tmp_path))
    mine = os.path.basename(opt.swap.file.dir)
    assert left == sorted([live.name, other.name, mine]), left
    opt.close()


def test_vanished_swap_file_is_an_error_naming_the_path(tmp_path):
    opt, buf = _optimizer("nvme", tmp_path, 40_000)
    shutil.rmtree(opt.swap.file.dir)
    with pytest.raises(nvme_io.NvmeSwapError, match=f"train.nvme_path='{tmp_path}'.*vanished"):
        _train(opt, buf, 1)
    opt.close()


def test_full_filesystem_is_an_error_naming_the_path(tmp_path):
    """RLIMIT_FSIZE below the swap file's size stands for a full disk (EFBIG, as ENOSPC): the
    soft limit only, restored at once (this process's other files are far below it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(nvme_io.NvmeSwapError) as info:
            _optimizer("nvme", tmp_path, 40_000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(info.value)
    assert f"train.nvme_path='{tmp_path}'" in message, message
    assert "File too large" in message and "free space" in message, message


def test_full_tmpfs_is_an_error_naming_the_path(tmp_path):
    """A real full filesystem where this process may mount one (root): a 16 KiB tmpfs."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the RLIMIT_FSIZE test stands for it)")
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(tmp_path)],
                           capture_output=True)  # fmt: skip
    if mount.returncode:
        pytest.skip(f"root without mount: {mount.stderr.decode().strip()}")
    try:
        with pytest.raises(nvme_io.NvmeSwapError) as info:
            _optimizer("nvme", tmp_path, 40_000)  # a 59 KiB swap file
        assert os.listdir(tmp_path) == [], "the failed swap directory is left behind"
    finally:
        subprocess.run(["umount", str(tmp_path)], check=True)
    message = str(info.value)
    assert f"train.nvme_path='{tmp_path}'" in message and "No space left" in message, message
