"""Verdicts of the acceptance run (tools/gpu_check.py): each function reads what one item
produced (pytest's JUnit XML, the kernel benchmark's JSON, a run's metrics.jsonl records, the
dry run's JSON) and returns Items: pass, fail or skipped (with why), one line of figures, and
the figures themselves for the report. No processes, no torch: the bands live here.

Bands (each a claim about the numbers, stated in the report):
- LOSS_BAND: a backend's mean loss over the last third of the steps (the last 10 of 30) within
  2% (relative) of the plain run's, 3% for FP8 GEMMs. The same schedule on the same text at 4
  layers, h 256 on CPU falls 26% in 30 steps (8.34 -> 6.15 over the last 10), the last-10 mean
  moving 8e-5 between bf16 and fp32 and 1.3e-4 with tests/fake_te's float8 GEMM operands: the
  band is ~150x the rounding and under a tenth of the drop. A backend that learns a few steps slower
  near the end (the curve falls ~0.5% a step there), drops a gradient term or lets attention see
  future tokens lands outside. The plain run must fall MIN_LEARNING (5%), else the band could
  not tell a backend that learns from one that does not (mock data: not asked; the loss cannot
  fall below ln V there). FP8 gets 1% more: real E4M3 GEMMs are unmeasured.
- MEMORY_BAND: the measured peak within 5% of the dry run's and of the planner's. They agree
  within 1% at full size (docs/benchmarks.md, "Planner against the dry run"); the allocator
  adds what no tensor shows (cuBLAS workspaces, flash-attention's backward accumulators: tens
  of MiB) and 512-byte rounding; 5% of the 1B run's ~27 GiB is less than its smallest
  model-state term (the bf16 weights, ~1.8 GiB), so a missing or doubled term falls outside.
- Resume: the resumed run's losses equal the uninterrupted run's bit for bit (both run with
  torch's deterministic algorithms, so the GPU's atomics cannot blur the comparison).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field

LOSS_BAND = 0.02
LOSS_BAND_FP8 = 0.03
MIN_LEARNING = 0.05
MEMORY_BAND = 0.05
PLANNER_RESERVE = 0.05  # plan --reserve's default: the allocator fragmentation it allows
DTYPES = ("fp32", "bf16", "fp16")
SELF_CHECK_FAILED = "failed its self-check"  # kernels/selfcheck.py's warning, in a run's log


@dataclass
class Item:
    """One line of the report: `status` pass | fail | skipped; `detail` the figures, or why."""

    name: str
    status: str
    detail: str
    data: dict = field(default_factory=dict)
    wall_s: float | None = None

    def line(self) -> str:
        word = {"pass": "PASS", "fail": "FAIL", "skipped": "SKIP"}[self.status]
        text = f"skipped: {self.detail}" if self.status == "skipped" else self.detail
        return f"{word}  {self.name:<18} {text}"

    def as_dict(self) -> dict:
        return asdict(self)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else math.inf


# ------------------------------------------------------------------------------ kernel tests
def kernel_test_items(junit: str, gpu: bool, failure: str | None) -> list[Item]:
    """kernels/<dtype> (and kernels/other: the tests without a dtype) from pytest's JUnit XML.
    On a GPU every dtype must run and pass; on CPU bf16/fp16 are skipped by the tests
    themselves (the Triton interpreter), and the item says so."""
    if failure or not os.path.isfile(junit):
        why = failure or f"pytest wrote no {junit}"
        return [Item(f"kernels/{d}", "fail", why) for d in (*DTYPES, "other")]
    groups: dict[str, dict] = {d: {"passed": 0, "failed": [], "skipped": []} for d in DTYPES}
    groups["other"] = {"passed": 0, "failed": [], "skipped": []}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        found = re.search(r"[\[-](fp32|bf16|fp16)[\]-]", case.get("name", ""))
        g = groups[found.group(1) if found else "other"]
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            message = (bad.get("message") or "").strip().split("\n")[0][:200]
            g["failed"].append(f"{name}: {message}")
        elif skip is not None:
            g["skipped"].append(skip.get("message") or "")
        else:
            g["passed"] += 1
    items = []
    how = "compiled" if gpu else "Triton interpreter"
    for dtype, g in groups.items():
        n_skip, data = len(g["skipped"]), {**g, "skipped": len(g["skipped"])}
        data["skip_reasons"] = sorted(set(g["skipped"]))
        if g["failed"]:
            detail = f"{len(g['failed'])} failed, {g['passed']} passed: {g['failed'][0]}"
            items.append(Item(f"kernels/{dtype}", "fail", detail, data))
        elif g["passed"] == 0 and not gpu:
            why = data["skip_reasons"][0] if n_skip else "no such test selected on CPU"
            items.append(Item(f"kernels/{dtype}", "skipped", why, data))
        elif g["passed"] == 0 or (gpu and n_skip and dtype != "other"):
            why = "; ".join(data["skip_reasons"]) or "no test ran"
            detail = f"{g['passed']} passed, {n_skip} skipped on the GPU: {why}"
            items.append(Item(f"kernels/{dtype}", "fail", detail, data))
        else:
            extra = f", {n_skip} skipped ({'; '.join(data['skip_reasons'])})" if n_skip else ""
            items.append(Item(f"kernels/{dtype}", "pass", f"{g['passed']} passed ({how}){extra}",
                              data))  # fmt: skip
    return items


# ---------------------------------------------------------------------------- kernel bench
def bench_item(path: str, gpu: bool, failure: str | None) -> Item:
    """kernel_bench from bench_kernels.json: per op the Triton kernel's forward and backward
    time, GB/s and fraction of the measured copy bandwidth beside eager torch (its reference).
    Passes when every Triton row ran and is no slower than eager torch in both directions."""
    if failure or not os.path.isfile(path):
        return Item("kernel_bench", "fail", failure or f"the benchmark wrote no {path}")
    with open(path) as f:
        bench = json.load(f)
    rows = {(r["op"], r["provider"]): r for r in bench["results"]}
    ops = sorted({op for op, _ in rows})
    keys = ("fwd_ms", "bwd_ms", "fwd_gbs", "bwd_gbs", "fwd_frac_copy", "bwd_frac_copy", "note")
    table = {op: {p: {k: rows[(op, p)].get(k) for k in keys} for p in ("triton", "torch")
                  if (op, p) in rows} for op in ops}  # fmt: skip
    data = {"copy_gbs": bench["meta"]["copy_gbs"], "dtype": bench["meta"]["dtype"], "ops": table}
    if not gpu:
        return Item("kernel_bench", "skipped", "the Triton kernels need a GPU (the torch rows "
                    f"ran on CPU, copy {data['copy_gbs']:.1f} GB/s)", data)  # fmt: skip
    problems, fracs = [], []
    for op in ops:
        tri, ref = table[op].get("triton", {}), table[op].get("torch", {})
        if tri.get("fwd_ms") is None or ref.get("fwd_ms") is None:
            problems.append(f"{op}: {tri.get('note') or ref.get('note') or 'no timing'}")
            continue
        fracs += [tri["fwd_frac_copy"], tri["bwd_frac_copy"]]
        for phase in ("fwd", "bwd"):
            if tri[f"{phase}_ms"] > ref[f"{phase}_ms"]:
                problems.append(f"{op} {phase} {tri[f'{phase}_ms']:.3f} ms slower than eager "
                                f"torch's {ref[f'{phase}_ms']:.3f} ms")  # fmt: skip
    if problems:
        return Item("kernel_bench", "fail", "; ".join(problems), data)
    detail = (f"{len(ops)} ops, Triton at {min(fracs):.0%}-{max(fracs):.0%} of copy bandwidth "
              f"({data['copy_gbs']:.0f} GB/s), faster than eager torch in fwd and bwd")  # fmt: skip
    return Item("kernel_bench", "pass", detail, data)


# ---------------------------------------------------------------------------- training runs
def read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(records: list[dict], steps: int) -> dict:
    """A run's figures: its losses, and over the steady steps (after the first third: the first
    two run under the memory tracker, the first ones compile kernels) the medians of tokens/s,
    TFLOP/s per rank, MFU and step time; the last record's mem/* figures."""
    steady = [r for r in records if r["step"] >= steps // 3] or records
    med = lambda k: statistics.median(r[k] for r in steady) if all(k in r for r in steady) else None
    last = records[-1] if records else {}
    return {
        "steps": [r["step"] for r in records],
        "losses": [r["loss"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],
        "steady_from_step": steps // 3,
        "tokens_per_s": med("tokens_per_s"),
        "tflops_per_rank": med("tflops_per_rank"),
        "mfu": med("mfu"),
        "step_time_s": med("step_time_s"),
        "memory": {k[4:]: v for k, v in last.items() if k.startswith("mem/")},
    }


def _tail_mean(losses: list[float]) -> float:
    return statistics.fmean(losses[-max(len(losses) // 3, 1) :])


def run_failure(summary: dict, steps: int, ended: str | None, log_tail: str) -> str | None:
    """Why a run did not produce `steps` finite losses (`ended`: how its process failed), or
    None."""
    if ended:
        return ended
    if len(summary["losses"]) != steps:
        return f"{len(summary['losses'])} of {steps} steps in metrics.jsonl: {log_tail}"
    if not all(math.isfinite(x) for x in summary["losses"]):
        return f"non-finite losses {summary['losses']}"
    fell_back = [w for w in summary.get("warnings", []) if SELF_CHECK_FAILED in w]
    if fell_back:  # the run is right but not what the GPU should run (kernels/selfcheck.py)
        return f"a Triton kernel failed its self-check, the torch reference ran: {fell_back[0]}"
    return None


def _throughput(s: dict) -> str:
    """Tokens/s, TFLOP/s and MFU, and how many warning lines the run's log has (data.warnings:
    a kernel that fell back to torch, say)."""
    mfu = f", MFU {s['mfu']:.1%}" if s["mfu"] is not None else ""
    warned = f" ({len(s['warnings'])} warnings in its log)" if s.get("warnings") else ""
    return f"{s['tokens_per_s']:,.0f} tok/s, {s['tflops_per_rank']:.3g} TFLOP/s{mfu}{warned}"


def plain_item(summary: dict, failure: str | None, real_data: bool) -> Item:
    """train/plain: it ran, and on text it learned (else no band can tell backends apart)."""
    if failure:
        return Item("train/plain", "fail", failure, summary)
    first, tail = summary["losses"][0], _tail_mean(summary["losses"])
    drop = 1 - tail / first
    summary = {**summary, "tail_mean_loss": tail, "learning_drop": drop}
    text = f"{_throughput(summary)}; loss {first:.4f} at step 1, {tail:.4f} over the last third"
    if not real_data:
        return Item("train/plain", "pass", f"{text} (mock data: no learning asked)", summary)
    if drop < MIN_LEARNING:
        text += f": fell {drop:.1%}, less than the {MIN_LEARNING:.0%} the loss band needs"
        return Item("train/plain", "fail", text, summary)
    return Item("train/plain", "pass", f"{text} (-{drop:.1%})", summary)


def backend_item(name: str, summary: dict, failure: str | None, plain: Item, fp8: bool) -> Item:
    """train/<backend>: it ran, and its last-third mean loss is within the band of plain's."""
    if failure:
        return Item(f"train/{name}", "fail", failure, summary)
    if "tail_mean_loss" not in plain.data:
        return Item(f"train/{name}", "fail", "no reference: train/plain did not run", summary)
    band = LOSS_BAND_FP8 if fp8 else LOSS_BAND
    tail, ref = _tail_mean(summary["losses"]), plain.data["tail_mean_loss"]
    rel = _rel(tail, ref)
    steps = zip(summary["losses"], plain.data["losses"], strict=True)
    summary = {
        **summary,
        "tail_mean_loss": tail,
        "band": band,
        "tail_rel_diff": rel,
        "max_step_rel_diff": max(_rel(a, b) for a, b in steps),
        "bitwise_equal_to_plain": summary["losses"] == plain.data["losses"],
    }
    same = " (bitwise equal)" if summary["bitwise_equal_to_plain"] else ""
    text = (f"{_throughput(summary)}; last-third mean loss {tail:.4f} vs plain {ref:.4f}: "
            f"{rel:.2%} (band {band:.0%}){same}")  # fmt: skip
    if plain.status != "pass":  # plain did not learn: being near it proves nothing
        return Item(f"train/{name}", "fail", f"{text}; no verdict: train/plain failed", summary)
    return Item(f"train/{name}", "pass" if rel <= band else "fail", text, summary)


# ----------------------------------------------------------------------------------- memory
def memory_item(plain: Item, dry_json: str, gpu: bool, failure: str | None) -> Item:
    """The plain run's measured peak (GPU: the allocator's max_memory_allocated; CPU: the
    memory tracker's step peak) beside the dry run's and the planner's for the same layout."""
    if failure or not os.path.isfile(dry_json):
        return Item("memory", "fail", failure or f"the dry run wrote no {dry_json}")
    if plain.status != "pass" and "memory" not in plain.data:
        return Item("memory", "fail", "no measurement: train/plain failed")
    with open(dry_json) as f:
        rank0 = json.load(f)[0]
    mem = plain.data["memory"]
    key = "allocated_peak" if gpu else "step_peak"
    if key not in mem:
        return Item("memory", "fail", f"metrics.jsonl has no mem/{key}")
    measured, dry, planned = mem[key], rank0["peak_bytes"], rank0["predicted_peak_bytes"]
    data = {
        "measured": key,
        "measured_bytes": measured,
        "reserved_bytes": mem.get("reserved_peak"),
        "tracker_step_peak_bytes": mem.get("step_peak"),
        "dry_run_peak_bytes": dry,
        "planner_peak_bytes": planned,
        "vs_dry_run": measured / dry - 1,
        "vs_planner": measured / planned - 1,
        "band": MEMORY_BAND,
        "dry_run_by_category": rank0["by_category"],
        "planner_by_term": rank0["predicted"],
        "warnings": [],
    }
    gib = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"
    text = (f"{'allocator' if gpu else 'tracker'} peak {gib(measured)}, dry run {gib(dry)} "
            f"({data['vs_dry_run']:+.1%}), planner {gib(planned)} ({data['vs_planner']:+.1%}); "
            f"band {MEMORY_BAND:.0%}")  # fmt: skip
    if data["reserved_bytes"]:
        frag = 1 - measured / data["reserved_bytes"]
        data["fragmentation"] = frag
        text += f"; reserved {gib(data['reserved_bytes'])} ({frag:.1%} unused)"
        if frag > PLANNER_RESERVE:
            data["warnings"].append(
                f"the allocator left {frag:.1%} of its reserve unused, more than the planner's "
                f"{PLANNER_RESERVE:.0%} fragmentation reserve: a layout planned within "
                f"{frag:.0%} of the limit may not fit"
            )
    ok = abs(data["vs_dry_run"]) <= MEMORY_BAND and abs(data["vs_planner"]) <= MEMORY_BAND
    return Item("memory", "pass" if ok else "fail", text, data)


# ----------------------------------------------------------------------------------- resume
def resume_item(ref: dict, resumed: dict, save_at: int, failure: str | None) -> Item:
    """Steps save_at+1.. of the resumed run against the uninterrupted run: bit for bit."""
    if failure:
        return Item("resume", "fail", failure)
    want = dict(zip(ref["steps"], zip(ref["losses"], ref["grad_norms"], strict=True),
                    strict=True))  # fmt: skip
    got = dict(zip(resumed["steps"], zip(resumed["losses"], resumed["grad_norms"], strict=True),
                   strict=True))  # fmt: skip
    compared = [s for s in sorted(want) if s >= save_at]
    if sorted(got) != compared:
        return Item("resume", "fail", f"the resumed run logged steps {sorted(got)}, expected "
                    f"{compared}")  # fmt: skip
    differ = [s for s in compared if got[s][0] != want[s][0]]
    data = {
        "saved_after_step": save_at,
        "compared_steps": [compared[0] + 1, compared[-1] + 1],  # 1-based, as the progress line
        "losses_bitwise": not differ,
        "grad_norms_bitwise": all(got[s][1] == want[s][1] for s in compared),
        "max_loss_rel_diff": max(_rel(got[s][0], want[s][0]) for s in compared),
        "first_differing_step": differ[0] + 1 if differ else None,
    }
    span = f"steps {data['compared_steps'][0]}-{data['compared_steps'][1]}"
    if differ:
        text = (f"{span}: losses differ from step {differ[0] + 1} (max relative difference "
                f"{data['max_loss_rel_diff']:.2e})")  # fmt: skip
        if differ[0] > compared[0]:  # a forward from the restored state matched
            text += (f"; step {compared[0] + 1} is equal: a nondeterministic backward kernel "
                     "(nondeterminism_warnings) or the optimizer state")  # fmt: skip
        return Item("resume", "fail", text, data)
    norms = "grad norms too" if data["grad_norms_bitwise"] else "grad norms differ"
    return Item("resume", "pass", f"saved after step {save_at}, {span} losses bitwise equal "
                f"to the uninterrupted run ({norms})", data)  # fmt: skip
