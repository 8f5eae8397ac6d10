"""The background prefetcher: order, lookahead bound, errors raised in the caller, shutdown."""

import threading
import time

import pytest
import torch

from megatron_lite.data.prefetch import Prefetcher


def test_results_in_key_order_and_bounded_lookahead():
    fetched = []

    def fetch(k):
        fetched.append(k)
        time.sleep(0.002 * (k % 3))  # uneven fetch times must not reorder results
        return [torch.full((2,), k)]

    with Prefetcher(fetch, range(10), depth=2, pin_memory=False) as p:
        time.sleep(0.1)
        # depth results queued + at most one being fetched: never the whole stream
        assert len(fetched) <= 3, fetched
        got = [(k, int(v[0][0])) for k, v in p]
    assert got == [(k, k) for k in range(10)]


def test_get_checks_the_key():
    with Prefetcher(lambda k: k * k, [5, 6, 7], pin_memory=False) as p:
        assert p.get(5) == 25 and p.get(6) == 36
        with pytest.raises(KeyError, match="expected key 7"):
            p.get(8)


def test_error_is_raised_in_the_caller_at_its_key():
    def fetch(k):
        if k == 2:
            raise ValueError("bad sample 2")
        return k

    p = Prefetcher(fetch, range(5), pin_memory=False)
    assert [next(p)[0], next(p)[0]] == [0, 1]
    with pytest.raises(ValueError, match="bad sample 2"):
        next(p)
    with pytest.raises(StopIteration):
        next(p)
    assert not p._thread.is_alive()


def test_close_stops_a_blocked_producer_and_is_idempotent():
    p = Prefetcher(lambda k: k, iter(range(10**9)), depth=1, pin_memory=False)
    assert next(p) == (0, 0)
    start = time.perf_counter()
    p.close()
    p.close()
    assert not p._thread.is_alive() and time.perf_counter() - start < 2
    assert not any(t.name == "data-prefetch" and t is p._thread for t in threading.enumerate())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_on_cuda():
    with Prefetcher(lambda k: {"x": [torch.zeros(3)]}, range(2)) as p:
        assert next(p)[1]["x"][0].is_pinned()
