"""NVMe optimizer offload against CPU offload: peak resident memory per rank and the swap's
throughput (docs/offload.md).

    python tools/bench_offload.py                        # ~31M parameters, 4 steps each
    python tools/bench_offload.py --path /local_nvme --buffer-mb 128 --steps 6
    python tools/bench_offload.py --quick                # a tiny model (the unit test's)

Memory: the same run (smoke.yaml's Llama at --hidden/--layers/--vocab, fp32, ZeRO-1 on one
rank, mock data) twice through the CLI, train.optimizer_offload=cpu then nvme. This process
polls each rank's /proc/<pid>/status every 20 ms and keeps VmHWM (the kernel's peak resident
set, which only grows): measured from outside, so nothing in the run counts for it. The
offloaded states are the fp32 masters and AdamW's two moments, 12 bytes per parameter; NVMe
offload keeps --buffer-mb of them in memory, so the expected saving is 12·N − buffer, and the
rule checked is: saving >= 0.8 × (12·N − buffer).

Throughput: the swap (nvme.NvmeStates) over pieces of the model's parameter sizes, one step
with no arithmetic (every group read and written back through the ring buffer), against a
plain sequential write and read of the same bytes to a file in the same directory (8 MiB
os.write / os.readv calls). Both go through the page cache, as the run's I/O does; neither
syncs. The figure is the swap's bytes per second over the plain one's (target >= 0.5).
Step times are the runs' metrics.jsonl medians; CPU time is the children's (getrusage).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")
STATE_BYTES = 12  # fp32 master + AdamW exp_avg + exp_avg_sq per parameter


def model_overrides(a) -> list[str]:
    return [
        "model.arch=llama", f"model.hidden_size={a.hidden}", f"model.num_layers={a.layers}",
        f"model.vocab_size={a.vocab}", f"model.num_attention_heads={a.hidden // 64}",
        f"model.num_query_groups={max(1, a.hidden // 256)}",
        f"model.ffn_hidden_size={a.hidden * 8 // 3 // 64 * 64}", "model.seq_length=128",
        "train.micro_batch_size=1", "train.global_batch_size=1", f"train.steps={a.steps}",
        "parallel.zero_stage=1", "log.progress=false", "log.memory_steps=0",
        "train.save_interval=0",
    ]  # fmt: skip


def param_sizes(a) -> list[int]:
    """Each parameter's elements, as the planner reads them off the real modules (meta)."""
    from megatron_lite.config import load_config
    from megatron_lite.plan.params import chunk_param_list
    from megatron_lite.validation import validate

    cfg = validate(load_config(SMOKE, model_overrides(a)), 1, warn=False)
    return [n for n, _ in chunk_param_list(cfg, 0, 0)]


def vm_hwm(pid: int) -> int | None:
    """The process's peak resident set in bytes (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run(a, offload: str, out: str) -> dict:
    """One training run through the CLI; its peak RSS, median step time and CPU time."""
    extra = [f"train.optimizer_offload={offload}", f"train.out_dir={out}"]
    if offload == "nvme":
        extra += [f"train.nvme_path={a.path}", f"train.nvme_buffer_mb={a.buffer_mb}"]
    cmd = [sys.executable, "-m", "megatron_lite.train", "--config", SMOKE]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen([*cmd, *model_overrides(a), *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    peak = 0
    while proc.poll() is None:
        peak = max(peak, vm_hwm(proc.pid) or 0)
        time.sleep(0.02)
    output = proc.stdout.read().decode()
    if proc.returncode:
        raise SystemExit(f"the {offload} run failed ({proc.returncode}):\n{output[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    times = [r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"peak": peak, "step_s": statistics.median(times), "cpu_s": cpu,
            "losses": [r["loss"] for r in records]}  # fmt: skip


def plain_throughput(path: str, nbytes: int) -> float:
    """Bytes per second of a sequential write then read of `nbytes` in a file under `path`,
    the second time (the first allocates the file, as the swap's fallocate and warm-up step
    do before it is timed)."""
    chunk = bytearray(8 << 20)
    fd, name = tempfile.mkstemp(dir=path, prefix=".bench_plain")
    try:
        for _ in range(2):  # the second pass is timed
            os.lseek(fd, 0, os.SEEK_SET)
            start = time.perf_counter()
            for at in range(0, nbytes, len(chunk)):
                os.write(fd, memoryview(chunk)[: min(len(chunk), nbytes - at)])
            os.lseek(fd, 0, os.SEEK_SET)
            while os.readv(fd, [chunk]):
                pass
            seconds = time.perf_counter() - start
        return 2 * nbytes / seconds
    finally:
        os.close(fd)
        os.unlink(name)


def swap_throughput(path: str, sizes: list[int], buffer_mb: int, repeats: int = 2) -> float:
    """Bytes per second of the swap's step (every group read and written, no arithmetic)."""
    from megatron_lite.parallel.data_parallel.nvme import NvmeStates

    names = [("exp_avg", "exp_avg_sq")] * len(sizes)
    swap = NvmeStates(path, 0, sizes, names, buffer_mb << 20, pin=False)
    try:
        swap.step(lambda first, last, views: None)  # warm: the file's pages exist
        start = time.perf_counter()
        for _ in range(repeats):
            swap.step(lambda first, last, views: None)
        return 2 * repeats * swap.nbytes / (time.perf_counter() - start)
    finally:
        swap.close()


def main(argv=None) -> dict:
    """Runs the benchmark, prints it; returns the figures (bytes, seconds, ratios)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--path", default=None, help="the swap directory (default: a temporary one)")
    p.add_argument("--buffer-mb", type=int, default=96)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="a tiny model (seconds)")
    a = p.parse_args(argv)
    if a.quick:
        a.hidden, a.layers, a.vocab, a.steps, a.buffer_mb = 128, 1, 512, 2, 1
    with tempfile.TemporaryDirectory() as tmp:
        a.path = a.path or os.path.join(tmp, "swap")
        os.makedirs(a.path, exist_ok=True)
        sizes = param_sizes(a)
        n = sum(sizes)
        cpu = run(a, "cpu", os.path.join(tmp, "cpu"))
        nvme = run(a, "nvme", os.path.join(tmp, "nvme"))
        swap = swap_throughput(a.path, sizes, a.buffer_mb)
        plain = plain_throughput(a.path, n * STATE_BYTES)
        left = os.listdir(a.path)
    offloaded, buffer = STATE_BYTES * n, a.buffer_mb << 20
    expected, saved = offloaded - buffer, cpu["peak"] - nvme["peak"]
    mib = 2**20
    print(f"model: {n / 1e6:.1f}M parameters; offloaded states {offloaded / mib:.0f} MiB; "
          f"buffer {a.buffer_mb} MiB; swap dir left after the runs: {left}")  # fmt: skip
    print(f"peak RSS, cpu offload:  {cpu['peak'] / mib:8.0f} MiB  (step {cpu['step_s']:.2f} s, "
          f"CPU {cpu['cpu_s']:.1f} s)")  # fmt: skip
    print(f"peak RSS, nvme offload: {nvme['peak'] / mib:8.0f} MiB  (step {nvme['step_s']:.2f} s, "
          f"CPU {nvme['cpu_s']:.1f} s)")  # fmt: skip
    verdict = "ok" if saved >= 0.8 * expected else "FAIL"
    print(f"saving: {saved / mib:.0f} MiB of the {expected / mib:.0f} MiB expected (states beyond "
          f"the buffer): {saved / max(expected, 1):.2f} (rule >= 0.80: {verdict})")  # fmt: skip
    print(f"losses equal: {cpu['losses'] == nvme['losses']}")
    print(f"swap throughput {swap / 1e9:.2f} GB/s, plain sequential write+read {plain / 1e9:.2f} "
          f"GB/s: {swap / plain:.2f} (target >= 0.5)")  # fmt: skip
    return {"saving": saved, "expected": expected, "ratio": swap / plain, "left": left,
            "equal": cpu["losses"] == nvme["losses"]}  # fmt: skip


if __name__ == "__main__":
    main()
