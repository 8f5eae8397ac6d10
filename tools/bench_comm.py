"""Bus bandwidth and latency of the collectives on the process groups of a layout, written as a
fabric file (JSON) that the planner reads instead of datasheet link figures.

    python tools/bench_comm.py --world 4 parallel.tp=2 --out runs/fabric.json
    python tools/bench_comm.py --world 8 --config configs/quickstart.yaml --gpus-per-node 4
    torchrun --nproc-per-node 8 tools/bench_comm.py --config configs/quickstart.yaml

Without torchrun's environment (RANK unset) it starts --world ranks here (gloo over a FileStore
on CPU, nccl on CUDA, one GPU per rank); under torchrun each process is one rank and joins as
training does. Each group kind of the config's layout (ParallelMesh's groups, and HSDP's with
parallel.dp_shard) runs each op at sizes --min-bytes to --max-bytes (doubling) on all its groups
at once: --warmup ops, a barrier, --iters ops timed back to back; a group's time is its slowest
rank's, and its scope 'inter' when its ranks span nodes (rank // --gpus-per-node), else 'intra'.
Sizes, algbw and busbw are nccl-tests' (NVIDIA/nccl-tests doc/PERFORMANCE.md; busbw · time is
parallel/comm_stats.py's `bus_bytes`). Details and the file's format: docs/bench_comm.md; the
reader: megatron_lite/plan/fabric.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.plan.fabric import OPS  # noqa: E402  (the ops a fabric file may hold)

KINDS = ("tp", "cp", "cp_a2a", "cp_ring", "dp", "dp_cp", "pp", "ep", "edp")  # ParallelMesh's
HYBRID = ("dp_cp_shard", "dp_cp_replica")  # parallel.dp_shard's (data_parallel/ddp.py)
DTYPES = ("float32", "bfloat16", "float16")
_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """'4096', '4K', '1M', '2G' (powers of 1024, as nccl-tests' -b/-e) -> bytes."""
    t = text.strip().lower().removesuffix("b")
    scale = _UNITS.get(t[-1:], 1)
    try:
        value = int(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: e.g. 4096, 64K, 4M, 1G"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size is at least 1 byte")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python tools/bench_comm.py",
        description=__doc__.split("\n\n")[0],
        epilog="Format of the output: docs/bench_comm.md.",
    )
    p.add_argument("--config", default=None, help="YAML config whose parallel.* layout is measured")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. parallel.tp=2")
    p.add_argument("--world", type=int, default=None,
                   help="ranks to start here (default: tp·pp·cp·dp of the config, else 2); "
                   "under torchrun: WORLD_SIZE, and --world must agree")  # fmt: skip
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="ranks per node, for the intra/inter scope (default: torchrun's "
                   "LOCAL_WORLD_SIZE, else the GPUs here, else --world: one node)")  # fmt: skip
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    p.add_argument("--groups", default=None,
                   help=f"comma-separated group kinds (default: all of {', '.join(KINDS)}, "
                   "plus dp_cp_shard and dp_cp_replica with parallel.dp_shard)")  # fmt: skip
    p.add_argument("--min-bytes", type=parse_size, default=None,
                   help="smallest size S (default 1K; K, M, G suffixes)")  # fmt: skip
    p.add_argument("--max-bytes", type=parse_size, default=None,
                   help="largest size S (default 4M on CPU, 1G on CUDA)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=5, help="untimed ops per size (nccl-tests: 5)")
    p.add_argument("--iters", type=int, default=20, help="timed ops per size (nccl-tests: 20)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the buffers' element type")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="cpu: gloo; cuda: nccl; auto: cuda when available")  # fmt: skip
    p.add_argument("--out", default="runs/fabric.json", help="the fabric file to write")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are killed")
    a = p.parse_args(argv)
    a.ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    if bad := [o for o in a.ops if o not in OPS]:
        p.error(f"--ops: {bad} are not ops; choose from {', '.join(OPS)}")
    if a.groups is not None:
        a.groups = [g.strip() for g in a.groups.split(",") if g.strip()]
        if bad := [g for g in a.groups if g not in (*KINDS, *HYBRID)]:
            p.error(f"--groups: {bad} are not group kinds; choose from {', '.join(KINDS + HYBRID)}")
    if a.warmup < 0 or a.iters < 1:
        p.error(f"--warmup {a.warmup} --iters {a.iters}: need warmup >= 0 and iters >= 1")
    if a.world is not None and a.world < 2:
        p.error(f"--world {a.world}: a collective needs at least 2 ranks")
    if a.min_bytes and a.max_bytes and a.min_bytes > a.max_bytes:
        p.error(f"--min-bytes {a.min_bytes} > --max-bytes {a.max_bytes}: swap them")
    return a


# ------------------------------------------------------------------ layout and groups
def layout_of(a: argparse.Namespace, world: int):
    """(parallel config, RankLayout) of the config on `world` ranks; SystemExit names a bad one."""
    from megatron_lite.config import ConfigError, load_config
    from megatron_lite.resolve import rank_layout

    try:
        p = load_config(a.config, a.overrides).parallel
        if p.dp is not None and p.tp * p.pp * p.cp * p.dp != world:
            raise ConfigError(
                f"parallel.dp={p.dp}: tp·pp·cp·dp = {p.tp * p.pp * p.cp * p.dp} ranks, but "
                f"--world is {world}. Fix: --world {p.tp * p.pp * p.cp * p.dp}, or drop parallel.dp"
            )
        return p, rank_layout(p, world)
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"bench_comm: {e}") from None


def world_of(a: argparse.Namespace) -> int:
    """--world, else the config's tp·pp·cp·dp when dp is set, else 2."""
    if a.world is not None:
        return a.world
    from megatron_lite.config import load_config

    p = load_config(a.config, a.overrides).parallel
    return p.tp * p.pp * p.cp * p.dp if p.dp is not None else 2


def group_kinds(mesh, p, wanted) -> list[tuple[str, list[str], object, list[tuple[int, ...]]]]:
    """[(kind, aliases, this rank's process group, every group's ranks)] of the kinds of size
    > 1 in `wanted` (None: all), one per distinct set of groups."""
    import torch.distributed as dist

    found = [(k, getattr(mesh, k).group, [tuple(r) for r in mesh.layout.groups(k)]) for k in KINDS]
    if p.dp_shard and mesh.dp_cp.size > p.dp_shard:
        from megatron_lite.parallel.data_parallel.ddp import hybrid_groups

        pair = hybrid_groups(mesh, "dp_cp", p.dp_shard)  # (shard group, replica group)
        for name, g in zip(HYBRID, pair, strict=True):
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, tuple(dist.get_process_group_ranks(g)))
            found.append((name, g, sorted(set(everyone))))
    out, seen = [], {}
    for name, group, groups in found:
        key = frozenset(groups)
        if len(groups[0]) < 2 or (wanted is not None and name not in wanted):
            continue
        if key in seen:
            seen[key].append(name)
            continue
        seen[key] = []
        out.append((name, seen[key], group, groups))
    return out


# ------------------------------------------------------------------ one op at one size
def make_op(op: str, size: int, group, ranks: tuple[int, ...], dtype, device):
    """(a function running `op` once on `group`, its nccl-tests size in bytes), or None when
    `size` is below one element per rank. Counts round down as nccl-tests' do."""
    import torch
    import torch.distributed as dist

    n, elem = len(ranks), torch.empty((), dtype=dtype).element_size()
    count = size // elem
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        count = count // n * n
    if count < 1:
        return None
    # the functions training calls (parallel/mappings.py): torch's newer names where present
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    full = torch.ones(count, dtype=dtype, device=device)
    if op == "all_reduce":
        fn = lambda: dist.all_reduce(full, group=group)  # noqa: E731
    elif op == "all_gather":
        shard = full[: count // n].clone()
        fn = lambda: gather(full, shard, group=group)  # noqa: E731
    elif op == "reduce_scatter":
        shard = full[: count // n].clone()
        fn = lambda: scatter(shard, full, group=group)  # noqa: E731
    elif op == "all_to_all":
        out = torch.empty_like(full)
        fn = lambda: dist.all_to_all_single(out, full, group=group)  # noqa: E731
    else:  # send: nccl-tests' sendrecv, to the next rank of the group and from the previous
        me, recv = ranks.index(dist.get_rank()), torch.empty_like(full)
        pair = [dist.P2POp(dist.isend, full, ranks[(me + 1) % n], group),
                dist.P2POp(dist.irecv, recv, ranks[(me - 1) % n], group)]  # fmt: skip

        def fn() -> None:
            for work in dist.batch_isend_irecv(pair):
                work.wait()

    return fn, count * elem


def time_op(fn, warmup: int, iters: int, sync) -> float:
    """Seconds per op on this rank: `iters` ops back to back after a barrier (nccl-tests)."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def scope_of(ranks, gpus_per_node: int) -> str:
    return "inter" if len({r // gpus_per_node for r in ranks}) > 1 else "intra"


def points(op, kind, groups, times, size, gpus_per_node) -> dict[str, dict]:
    """{scope: point} of one kind, op and size: per group the slowest rank, per scope the
    slowest group."""
    from megatron_lite.parallel.comm_stats import bus_bytes

    out = {}
    for ranks in groups:
        t = max(times[r] for r in ranks)
        scope, n = scope_of(ranks, gpus_per_node), len(ranks)
        if scope not in out or t > out[scope]["time_s"]:
            algbw, busbw = size / t / 1e9, bus_bytes(op, size, n) / t / 1e9
            out[scope] = {"group": kind, "n": n, "bytes": size, "time_s": t,
                          "algbw": algbw, "busbw": busbw}  # fmt: skip
    return out


# ------------------------------------------------------------------ one rank
def sizes_of(a: argparse.Namespace, cuda: bool) -> list[int]:
    """--min-bytes, doubling, up to --max-bytes (nccl-tests' -b, -f 2, -e)."""
    lo = a.min_bytes or 1 << 10
    hi = max(a.max_bytes or (1 << 30 if cuda else 4 << 20), lo)
    out = [lo]
    while out[-1] * 2 <= hi:
        out.append(out[-1] * 2)
    return out


def measure(a: argparse.Namespace, gpus_per_node: int) -> dict | None:
    """Every kind, op and size on this rank's groups (torch.distributed initialized); rank 0
    returns the fabric file's content, the others None."""
    import torch
    import torch.distributed as dist

    from megatron_lite.parallel.mesh import ParallelMesh

    rank, world = dist.get_rank(), dist.get_world_size()
    p, layout = layout_of(a, world)
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = getattr(torch, a.dtype)
    kinds = group_kinds(ParallelMesh(layout), p, a.groups)
    if not kinds:  # the same on every rank: all stop here
        raise SystemExit(
            f"bench_comm: no group of {', '.join(a.groups or KINDS + HYBRID)} has more than one "
            f"rank in this layout ({layout.rank_map().splitlines()[0]}). Fix: choose --groups "
            "of more than one rank, or a layout that has them"
        )
    ops: dict[str, dict[str, list]] = {op: {} for op in a.ops}
    everyone = torch.zeros(world, dtype=torch.float64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    for kind, _, group, groups in kinds:
        ranks = next(g for g in groups if rank in g)
        for op in a.ops:
            for size in sizes_of(a, cuda):
                made = make_op(op, size, group, ranks, dtype, device)
                if made is None:
                    continue
                mine = torch.tensor([time_op(made[0], a.warmup, a.iters, sync)], device=device)
                gather(everyone, mine.double())  # [world] seconds
                if rank == 0:
                    found = points(op, kind, groups, everyone.tolist(), made[1], gpus_per_node)
                    for scope, point in found.items():
                        ops[op].setdefault(scope, []).append(point)
    if rank != 0:
        return None
    return fabric_file(a, p, layout, kinds, ops, gpus_per_node, device)


def fabric_file(a, p, layout, kinds, ops, gpus_per_node: int, device) -> dict:
    """The JSON object written to --out (docs/bench_comm.md)."""
    import torch
    import torch.distributed as dist

    from megatron_lite.plan.fabric import FORMAT, VERSION

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "format": FORMAT,
        "version": VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {
            "hostname": platform.node(),
            "platform": platform.platform(),
            "device": name or platform.machine(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "load_avg": list(os.getloadavg()),
        },  # fmt: skip
        "backend": dist.get_backend(),
        "world": dist.get_world_size(),
        "gpus_per_node": gpus_per_node,
        "layout": {
            "tp": p.tp,
            "pp": p.pp,
            "cp": p.cp,
            "ep": p.ep,
            "dp": layout.dp,
            "order": p.order,
            "cp_a2a": layout.a2a,
            "dp_shard": p.dp_shard,
        },  # fmt: skip
        "groups": {
            kind: {
                "aliases": aliases,
                "ranks": [list(g) for g in groups],
                "scopes": sorted({scope_of(g, gpus_per_node) for g in groups}),
            }
            for kind, aliases, _, groups in kinds
        },  # fmt: skip
        "dtype": a.dtype,
        "timing": {
            "warmup": a.warmup,
            "iters": a.iters,
            "rank_reduce": "max",
            "clock": "time.perf_counter, iters back to back after a barrier",
        },  # fmt: skip
        "units": {
            "bytes": "B (nccl-tests' size S)",
            "time_s": "s per op",
            "algbw": "GB/s (1e9 B/s) = bytes / time_s",
            "busbw": "GB/s = algbw · nccl-tests' factor",
        },  # fmt: skip
        "ops": {op: scopes for op, scopes in ops.items() if scopes},
    }


def report(fabric: dict, out: str) -> None:
    """Write the file and print one nccl-tests-like line per point."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(fabric, f, indent=1)
    print(f"{'op':>14} {'group':>13} {'scope':>5} {'n':>3} {'size (B)':>11} {'time (us)':>10} "
          f"{'algbw':>8} {'busbw':>8}  (GB/s)")  # fmt: skip
    for op, scopes in fabric["ops"].items():
        for scope, entries in scopes.items():
            for e in entries:
                us, bw = e["time_s"] * 1e6, f"{e['algbw']:>8.3f} {e['busbw']:>8.3f}"
                print(f"{op:>14} {e['group']:>13} {scope:>5} {e['n']:>3} {e['bytes']:>11} "
                      f"{us:>10.1f} {bw}")  # fmt: skip
    print(f"bench_comm: wrote {out} ({fabric['backend']}, {fabric['world']} ranks)")


# ------------------------------------------------------------------ starting the ranks
def _spawned_rank(rank: int, world: int, store: str, a: argparse.Namespace, gpn: int) -> None:
    """One rank started by this tool: join over the FileStore, measure, rank 0 writes."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = _cuda(a)
    if cuda:
        torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=a.timeout)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store, world),
                            rank=rank, world_size=world, timeout=timeout)  # fmt: skip
    fabric = measure(a, gpn)
    if fabric is not None:
        report(fabric, a.out)
    dist.barrier()
    dist.destroy_process_group()


def _cuda(a: argparse.Namespace) -> bool:
    import torch

    return a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())


def spawn(a: argparse.Namespace, world: int) -> int:
    """Start `world` ranks here and wait for them; the exit code (0 when all succeeded)."""
    import multiprocessing as mp
    import tempfile

    import torch

    layout_of(a, world)  # a bad layout: one message here, not one per rank
    gpus = torch.cuda.device_count() if _cuda(a) else 0
    if _cuda(a) and world > gpus:
        raise SystemExit(f"bench_comm: --world {world} > {gpus} GPUs here. Fix: --world {gpus}, "
                         "or --device cpu (gloo)")  # fmt: skip
    gpn = a.gpus_per_node or gpus or world
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        args = (world, os.path.join(tmp, "store"), a, gpn)
        procs = [ctx.Process(target=_spawned_rank, args=(r, *args)) for r in range(world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + a.timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # a rank failed (its traceback is above): the others would wait forever
            time.sleep(0.1)
        for proc in procs:
            proc.join(timeout=1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        print(f"bench_comm: ranks' exit codes {codes} (timeout {a.timeout:g} s)", file=sys.stderr)
        return 1
    return 0


def under_torchrun(a: argparse.Namespace) -> int:
    """This process is one rank of torchrun's (RANK, WORLD_SIZE set): join as training does."""
    import torch.distributed as dist

    from megatron_lite.config import load_config
    from megatron_lite.train import init_distributed

    world = int(os.environ["WORLD_SIZE"])
    if a.world is not None and a.world != world:
        raise SystemExit(f"bench_comm: --world {a.world} but WORLD_SIZE={world}. Fix: drop --world")
    layout_of(a, world)
    init_distributed(load_config(a.config, a.overrides))
    gpn = a.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    fabric = measure(a, gpn)
    if fabric is not None:
        report(fabric, a.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if "RANK" in os.environ:
        return under_torchrun(a)
    return spawn(a, world_of(a))


if __name__ == "__main__":
    sys.exit(main())
