"""Bus bytes (NCCL-tests' convention, ring algorithm) in comm_stats: the pure formula, and the
counts recorded by real collectives on two gloo ranks against what each rank sends its peer."""

import pytest
import torch
import torch.distributed as dist

from megatron_lite.parallel.comm_stats import CommStats, bus_bytes
from tests.dist_harness import run_ranks


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_bus_bytes_formulas(n):
    size = 3 * 1024
    ring = (n - 1) / n
    assert bus_bytes("all_gather", size, n) == pytest.approx(ring * size)
    assert bus_bytes("reduce_scatter", size, n) == pytest.approx(ring * size)
    assert bus_bytes("all_reduce", size, n) == pytest.approx(2 * ring * size)
    assert bus_bytes("all_to_all", size, n) == pytest.approx(ring * size)
    assert bus_bytes("send", size, n) == size
    assert bus_bytes("broadcast", size, n) == size  # NCCL-tests: busbw = algbw for broadcast


def test_bus_bytes_rejects_unknown_ops():
    with pytest.raises(ValueError, match="unknown op 'scatter'"):
        bus_bytes("scatter", 8, 2)


def test_record_takes_the_full_size_for_an_all_gather():
    """An all-gather's payload is its input shard; its bus bytes are of the gathered size."""
    stats = CommStats()
    shard = torch.zeros(4, 8)  # 128 bytes per rank, 512 gathered on 4 ranks
    stats.record("all_gather", shard, "tp", op="all_gather", n=4)
    stats.record("reduce_scatter", torch.zeros(16, 8), "tp", op="reduce_scatter", n=4)
    s = stats.summary()
    assert s["comm_bytes/all_gather"] == 128 and s["comm_bytes/reduce_scatter"] == 512
    assert s["comm_bus_bytes/all_gather"] == s["comm_bus_bytes/reduce_scatter"] == 384
    stats.start_step(1)
    assert stats.summary() == {}


def _collectives(rank, world):
    """One of each kind through mappings on a 2-rank group; returns the recorded bus bytes and
    the bytes this rank sends its peer in each (on 2 ranks the ring sends exactly that)."""
    from megatron_lite.parallel import mappings
    from megatron_lite.parallel.comm_stats import STATS

    g = dist.group.WORLD
    STATS.start_step(0)
    x = torch.randn(6, 5)  # 120 bytes
    mappings.all_gather_dim0(x, g)  # sends its 120-byte shard
    mappings.reduce_scatter_dim0(x, g)  # sends the peer's half: 60
    mappings.all_reduce(x.clone(), g)  # reduce-scatter + all-gather: 60 + 60
    mappings.all_to_all(x, 0, 1, g)  # sends the peer's chunk: 60
    nbytes = x.numel() * x.element_size()
    sent = {
        "all_gather": nbytes,
        "reduce_scatter": nbytes // 2,
        "all_reduce": nbytes,
        "all_to_all": nbytes // 2,
    }
    return dict(STATS.summary()), sent


def test_recorded_bus_bytes_equal_the_bytes_sent_on_two_ranks():
    for summary, sent in run_ranks(2, _collectives, timeout=30):
        for kind, want in sent.items():
            assert summary[f"comm_bus_bytes/{kind}"] == want, (kind, summary)
