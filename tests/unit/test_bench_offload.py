"""tools/bench_offload.py: issue #43's NVMe criteria on a mid-size model (~10M parameters,
~117 MiB of masters and AdamW states, a 32 MiB buffer; the largest piece is 24 MiB): the peak
RSS of the NVMe run, read from /proc from outside, is lower than the CPU-offload run's by >= 80%
of the states beyond the buffer; the losses are equal; the swap moves its bytes at >= 0.5 of a
plain sequential write and read in the same directory (printed, not asserted: a speed target
belongs to the benchmark, and this machine's disk is shared); the clean exits leave no swap
directory. (The ~31M figures in docs/offload.md are the default run's.) On request
(MEGATRON_LITE_OFFLOAD_BENCH=1): two runs of ~70 s each, over CI's slow-tier budget; the
bitwise and kill -9 criteria run in CI (tests/parallel/test_nvme_offload.py,
tests/launch/test_nvme_resume.py)."""

import os

import pytest

from tools.bench_offload import main


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MEGATRON_LITE_OFFLOAD_BENCH") != "1", reason="MEGATRON_LITE_OFFLOAD_BENCH=1"
)
def test_nvme_offload_saves_the_states_beyond_the_buffer():
    got = main(["--hidden", "512", "--layers", "3", "--vocab", "4096", "--buffer-mb", "32",
                "--steps", "3"])  # fmt: skip
    assert got["equal"], "nvme and cpu offload losses differ"
    assert got["saving"] >= 0.8 * got["expected"], got
    print(f"swap throughput / plain write+read: {got['ratio']:.2f} (issue #43: >= 0.5)")
    assert got["left"] == [], got
