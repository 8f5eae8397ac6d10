"""Activation bytes saved for backward, measured: one real transformer layer (and a chunk's
final norm) run forward on fake tensors at the layout's local shapes, under the
SavedTensorMeter (training/activation_memory.py: unique storages, parameters and buffers
excluded), with a label per module path, so each row is what that module's own code saved
(the innermost module wins; "layer" is the layer's own code: its dropout masks, a
recompute's kept input).

The real model decides every figure: its attention and MLP parts, their kernels (fused: the
Triton kernels' autograd functions allocate and save what they do on a GPU, their launches
skipped on fake tensors; torch: the plain-torch references), context parallelism's all-to-all
and ring, the MoE dispatch under a dry run's balanced routing, selective recompute. A fake
forward costs the Python of its ops (tens of ms for a full-size layer), not its sizes, so it
runs at full size, once per key (the model section but its recompute fields, the local layout
tp/sp/cp/Ulysses/ep, kernels, MoE or dense, the selective modules), at micro batches 1 and 2
(FIT_POINTS) on one fake stage (one process group, chunk and layer for both); the others are
fitted (layer_saves).

The fake tensors are the CPU's, as plan --dry-run's: an op whose CPU kernel keeps something else
than the GPU's is counted as the CPU keeps it. The one known: dropout (model.hidden_dropout > 0)
keeps its mask in the input's dtype on the CPU, a bool on the GPU, so the figure is over by
(A - 1)·T·h·u bytes per mask there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import torch

from megatron_lite.config import Config
from megatron_lite.plan import modules
from megatron_lite.resolve import cp_a2a_size, sequence_parallel

LAYER = "layer"  # the row of the layer's own code
# the micro batches measured: the fewest tokens, a slope of integer bytes (the fit exact in
# floats at every micro batch)
FIT_POINTS = (1, 2)
# key -> {micro batch: ({module path: bytes}, {"final_norm": bytes})}
_SAVES: dict[tuple, dict[int, tuple]] = {}


def _key(cfg: Config, kernels: str, *rest) -> tuple:
    """The measurement's key but the micro batch (model section, local layout, kernels)."""
    p = cfg.parallel
    return (modules.model_key(cfg), p.tp, sequence_parallel(p), p.cp, cp_a2a_size(p), p.ep,
            kernels, *rest)  # fmt: skip


def layer_saves(
    cfg: Config, moe: bool, kernels: str = "fused", selective: tuple[str, ...] = ()
) -> dict[str, float]:
    """{module path: bytes} one layer (an MoE layer's when `moe`) saves for backward on one
    rank for one microbatch, with selective recompute of `selective` (core_attn, mlp, moe; ()
    none). Each row is a·b + c in the micro batch b (every saved tensor holds T = (s/cp)·b
    tokens, or none: the torch kernels' fp32 weight copies, an MoE layer's [E]-sized ones):
    measured at micro batches 1 and 2, fitted for the others (exact:
    tests/unit/test_plan_modules.py)."""
    return _saves(cfg, moe, kernels, tuple(selective))[0]


def final_norm_saves(cfg: Config, kernels: str = "fused") -> float:
    """Bytes the last chunk's final norm saves for backward per microbatch, measured beside
    a layer of the model's first kind (the same stage, input and fit)."""
    return _saves(cfg, modules.layer_kinds(cfg)[0], kernels, ())[1]["final_norm"]


def _saves(cfg: Config, moe: bool, kernels: str, selective: tuple[str, ...]) -> tuple:
    """(the layer's rows, the final norm's {"final_norm": bytes}) at cfg's micro batch."""
    b = cfg.train.micro_batch_size
    points = modules.cached(_SAVES, _key(cfg, kernels, moe, selective), dict)
    if not points:  # the line's two points, on one fake stage
        points.update(_measure_layers(cfg, moe, kernels, selective, FIT_POINTS))
    if b not in points:
        points[b] = tuple(_fit(points, i, b) for i in range(2))
    return points[b]


def _fit(points: dict[int, tuple], i: int, b: int) -> dict[str, float]:
    """Each row of part i's line through the two measured micro batches, at b."""
    (b1, p1), (b2, p2) = list(points.items())[:2]
    r1, r2 = p1[i], p2[i]
    return {k: r1[k] + (b - b1) * (r2[k] - r1[k]) / (b2 - b1) for k in r1}


@contextlib.contextmanager
def _kernels(kernels: str) -> Iterator[None]:
    """The kernels a dry run selects (kernels/dispatch.py's switch), restored after."""
    from megatron_lite.kernels.dispatch import ENV_VAR as KERNELS_ENV

    before = os.environ.get(KERNELS_ENV)
    os.environ[KERNELS_ENV] = "triton" if kernels == "fused" else "torch"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(KERNELS_ENV, None)
        else:
            os.environ[KERNELS_ENV] = before


def _with_selective(cfg: Config, selective: tuple[str, ...]) -> Config:
    m = dataclasses.replace(
        cfg.model,
        recompute_granularity="selective" if selective else None,
        recompute_modules=list(selective) if selective else cfg.model.recompute_modules,
        recompute_method=None,
        recompute_num_layers=None,
    )
    return dataclasses.replace(cfg, model=m)


@contextlib.contextmanager
def _fake_stage(cfg: Config, kernels: str) -> Iterator[tuple]:
    """(config, mesh, tracker, chunk, inputs) under a FakeTensorMode: a layer-less last chunk
    of the layout (its RoPE tables, its final norm), and inputs(b) -> (x [s/cp(/tp), b, h],
    its TokenContext) in the residual stream's dtype (fp32 under fp32 training or
    fp32_residual_connection, else bf16), weights cast as the trainer casts them."""
    from megatron_lite.models import ModelChunk
    from megatron_lite.parallel.fake import FakeTensorMode
    from megatron_lite.parallel.random import TP_RNG, RNGStatesTracker

    p, t = cfg.parallel, cfg.train
    config = modules.transformer_config(cfg, layers_only=True)  # (the vocabulary: unread)
    bf16 = t.precision == "bf16"
    tracker = RNGStatesTracker()  # the trainer's TP-rank dropout state (no global seeding)
    tracker.add(TP_RNG, t.seed)
    rng = torch.get_rng_state()  # the caller's generator, untouched by the measurement
    with (
        _kernels(kernels),
        modules.fake_mesh(p.tp, p.cp, cp_a2a_size(p), p.ep) as mesh,
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        chunk = ModelChunk(config, mesh, tracker, [], False, True)
        s = config.seq_length // p.cp // (p.tp if config.sequence_parallel else 1)
        residual = torch.bfloat16 if bf16 and not config.fp32_residual_connection else None

        def inputs(b: int) -> tuple:
            x = torch.empty(s, b, config.hidden_size, dtype=residual)
            tokens = torch.zeros(b, config.seq_length, dtype=torch.long)
            return x.requires_grad_(), chunk.token_context(
                tokens if config.uses_documents else None
            )

        amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        try:
            with amp:
                yield config, mesh, tracker, chunk, inputs
        finally:
            torch.set_rng_state(rng)


def _to_training_dtype(module: torch.nn.Module, precision: str) -> None:
    if precision == "bf16":  # training/trainer.py: bf16 weights (untrained state stays fp32)
        for q in module.parameters():
            if q.requires_grad:
                q.data = q.data.to(torch.bfloat16)


def _meter(*modules_: torch.nn.Module, ctx=None):
    from megatron_lite.training.activation_memory import SavedTensorMeter

    exclude = [t for m in modules_ for t in (*m.parameters(), *m.buffers())]
    if ctx is not None:
        exclude += [t for t in (*(ctx.rope or ()), ctx.docs, ctx.positions) if t is not None]
    return SavedTensorMeter(exclude=exclude)


def _measure_layer(cfg: Config, moe: bool, kernels: str, selective: tuple[str, ...]) -> tuple:
    """(the layer's rows, the chunk's final norm's) at cfg's micro batch, measured."""
    b = cfg.train.micro_batch_size
    return _measure_layers(cfg, moe, kernels, selective, (b,))[b]


def _measure_layers(
    cfg: Config, moe: bool, kernels: str, selective: tuple[str, ...], micro_batches: tuple
) -> dict[int, tuple]:
    """{micro batch: (the layer's rows, the chunk's final norm's)}, each on its own input to
    one layer on one fake stage."""
    cfg = _with_selective(cfg, selective)
    out = {}
    with _fake_stage(cfg, kernels) as (config, mesh, tracker, chunk, inputs):
        layer = modules.new_layer(config, mesh, tracker, modules.layer_number(config, moe))
        _to_training_dtype(layer, cfg.train.precision)
        _to_training_dtype(chunk, cfg.train.precision)
        for b in micro_batches:
            out[b] = _forward(layer, chunk, *inputs(b))
    return out


def _forward(layer: torch.nn.Module, chunk: torch.nn.Module, x, ctx) -> tuple:
    """One forward of the layer, then of the chunk's final norm, on x, each metered."""
    meter = _meter(layer, chunk, ctx=ctx)
    handles = []
    for name, m in layer.named_modules():
        tag = name or LAYER
        handles.append(m.register_forward_pre_hook(lambda *_, t=tag: meter._push(t)))
        handles.append(m.register_forward_hook(lambda *_: meter._pop()))
    try:
        with meter:
            layer(x, ctx)
    finally:
        for h in handles:
            h.remove()
    norm = _meter(chunk)
    with norm, norm.label("final_norm"):
        chunk.final_norm(x)
    rows = {k: float(v) for k, v in meter.by_label.items()}
    return rows, {"final_norm": float(norm.by_label.get("final_norm", 0))}


def subtree(rows: dict[str, float], path: str) -> float:
    """Bytes of the module at `path` and every module inside it."""
    return sum(v for k, v in rows.items() if k == path or k.startswith(path + "."))
