"""`--measure`: one training step of the layout on local gloo ranks, measured beside predicted.

Each rank builds the real Trainer, runs one step (one microbatch per rank: global batch =
micro batch · dp) inside a SavedTensorMeter labelled per transformer layer, and reports its
model states (the trainer's mem/* walk) and the bytes each layer saved for backward. On CPU
the plain-torch kernel references run, so the prediction uses kernels="torch".
"""

from __future__ import annotations

import copy
import os
import pickle
import tempfile

from megatron_lite.config import Config
from megatron_lite.parallel.data_parallel.memory import TERMS
from megatron_lite.plan.activations import layer_bytes, layer_shape
from megatron_lite.plan.memory import model_states, saved_activations
from megatron_lite.resolve import num_microbatches, rank_layout


def one_step_config(cfg: Config, out_dir: str) -> Config:
    """`cfg` (resolved) made to run one step with one microbatch per rank, writing nothing."""
    c = copy.deepcopy(cfg)
    c.train.global_batch_size = c.train.micro_batch_size * c.parallel.dp * c.parallel.pp
    c.train.steps, c.train.save_interval, c.train.eval_interval = 1, 0, 0
    c.train.out_dir, c.train.resume, c.log.progress = out_dir, "none", False
    c.data.mock = True
    return c


def measure_on_rank(cfg: Config) -> dict:
    """Run one step on this rank (process group initialized): {pp_rank, states, layers, peak}."""
    import torch.distributed as dist

    from megatron_lite.data import build_dataset
    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.training.trainer import Trainer

    p = cfg.parallel
    world = dist.get_world_size()
    mesh = ParallelMesh(rank_layout(p, world))
    dataset, vocab = build_dataset(cfg)
    trainer = Trainer(cfg, mesh, dataset, vocab)
    trainer.train_step()  # on CPU the step runs inside the trainer's SavedTensorMeter
    report = trainer.last_activation_report
    states = {k: int(v) for k, v in trainer.dp.memory().items()}
    layers = {k: v for k, v in report["by_label"].items() if k.startswith("layer.")}
    m = num_microbatches(cfg.train, p.dp)
    peak = report["peak_bytes"]
    return {"pp_rank": mesh.pp.rank, "states": states, "layers": layers, "peak": peak,
            "microbatches": m}  # fmt: skip


def predicted_layer(cfg: Config, kernels: str) -> float:
    """Predicted bytes one layer saves per microbatch through save_for_backward (what the
    SavedTensorMeter counts)."""
    return sum(layer_bytes(cfg, layer_shape(cfg, kernels)).values())


def _child(rank: int, world: int, store_path: str, cfg: Config, queue, fn=None) -> None:
    import datetime

    # CPU ranks on gloo, also on a GPU machine (gloo lacks CUDA send/recv; the meter is the
    # CPU's): hidden before anything initializes CUDA in this process
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))  # fmt: skip
        queue.put((rank, pickle.dumps((fn or measure_on_rank)(cfg))))
        dist.destroy_process_group()
    except BaseException as e:  # the parent prints it
        queue.put((rank, pickle.dumps(f"{type(e).__name__}: {e}")))


def run_local(cfg: Config, world: int, fn=None, one_step: bool = True) -> list:
    """`fn(cfg)` (default measure_on_rank; a module-level function) on `world` forked gloo
    ranks (from a clean forkserver); one_step: run it on one_step_config(cfg)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        run_cfg = one_step_config(cfg, os.path.join(tmp, "run")) if one_step else cfg
        args = (world, os.path.join(tmp, "store"), run_cfg, queue, fn)
        procs = [ctx.Process(target=_child, args=(r, *args), daemon=True) for r in range(world)]
        for proc in procs:
            proc.start()
        results = dict(queue.get(timeout=600) for _ in procs)
        for proc in procs:
            proc.join(timeout=30)
    out = [pickle.loads(results[r]) for r in range(world)]
    errors = [o for o in out if isinstance(o, str)]
    if errors:
        raise RuntimeError(f"a rank failed: {errors[0]}")
    return out


def measure_report(cfg: Config, world: int) -> str:
    """Measured beside predicted, per pipeline rank (first rank of each stage). The ranks run
    on CPU (see _child), so the prediction is for the plain-torch kernels."""
    kernels = "torch"
    results = run_local(cfg, world)
    run_cfg = one_step_config(cfg, "")
    lines = [f"measured on {world} local gloo ranks, one microbatch per rank (kernels={kernels}):"]
    seen = set()
    for res in results:
        if res["pp_rank"] in seen:
            continue
        seen.add(res["pp_rank"])
        pred = model_states(run_cfg, res["pp_rank"])
        for k in TERMS:
            lines.append(_row(f"pp{res['pp_rank']} {k}", res["states"][k], pred[k]))
        act = saved_activations(run_cfg, world, res["pp_rank"], kernels)
        lines.append(_row(f"pp{res['pp_rank']} saved peak", res["peak"], act))
        pred = predicted_layer(run_cfg, kernels)
        for label, got in sorted(res["layers"].items()):
            lines.append(_row(f"pp{res['pp_rank']} {label}", got / res["microbatches"], pred))
    return "\n".join(lines)


def _row(name: str, measured: float, predicted: float) -> str:
    ratio = f"×{measured / predicted:.3f}" if predicted else ("equal" if not measured else "—")
    return f"  {name:24s} measured {measured:14,.0f}  predicted {predicted:14,.0f}  {ratio}"
