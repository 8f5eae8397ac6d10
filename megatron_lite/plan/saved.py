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
tp/sp/cp/Ulysses/ep, kernels, MoE or dense), at micro batches 1 and 2 (FIT_POINTS) on one fake
stage (one process group, chunk and layer for both); the others are fitted (layer_saves).

Selective recompute is derived from the same forward: the layer is built with every module of
recompute_modules selected and its regions run as plain calls (parallel/recompute.py
regions_run_by), each save recorded in order with its label and region, each region's entry
with the inputs the checkpoint would keep. A choice of modules is then that record replayed
as the meter would have seen it: the saves inside a chosen region dropped (the checkpoint's own
hooks hide them), its kept inputs saved at its entry under the caller's label, each storage
counted once, by its first saver (tests/unit/test_plan_modules.py compares every choice with
a forward under the real checkpoint).

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
from megatron_lite.plan.layer_trace import LayerTrace
from megatron_lite.resolve import cp_a2a_size, sequence_parallel

LAYER = "layer"  # the row of the layer's own code
MLP = "mlp"  # the layer's MLP (or MoE) module path: what recompute of mlp or moe reruns
# the micro batches measured: the fewest tokens, a slope of integer bytes (the fit exact in
# floats at every micro batch)
FIT_POINTS = (1, 2)
# the recompute_modules a layer is built with for the measurement (its regions are recorded)
REGIONS = ("core_attn", "mlp", "moe")
# the recompute choices whose backward working sets the trace summarizes: none, and the
# attention core's (plan/layer_trace.py; a recomputed MLP or MoE the walk adds itself:
# plan/peak.py's rebuilt)
TRACED = ((), ("core_attn",))
# key -> {micro batch: (the forward's record, {"final_norm": bytes})}
_SAVES: dict[tuple, dict[int, tuple]] = {}
# key -> {micro batch: layer_trace's summary}
_TRACES: dict[tuple, dict[int, tuple]] = {}
# key + (selective,) -> {micro batch: ({module path: bytes}, {"final_norm": bytes})}
_ROWS: dict[tuple, dict[int, tuple]] = {}
# key + recompute -> {micro batch: bytes the MTP modules save}
_MTP: dict[tuple, dict[int, float]] = {}


def _key(cfg: Config, kernels: str, moe: bool) -> tuple:
    """The measurement's key but the micro batch (model section, local layout, kernels, the
    layer kind); a dense layer's not ep (no part of it reads the expert group: a test compares
    its figures at every ep)."""
    p = cfg.parallel
    return (modules.model_key(cfg), p.tp, sequence_parallel(p), p.cp, cp_a2a_size(p),
            p.ep if moe else 1, kernels, moe)  # fmt: skip


def layer_saves(
    cfg: Config, moe: bool, kernels: str = "fused", selective: tuple[str, ...] = ()
) -> dict[str, float]:
    """{module path: bytes} one layer (an MoE layer's when `moe`) saves for backward on one
    rank for one microbatch, with selective recompute of `selective` (core_attn, mlp, moe; ()
    none). Each row is a·b + c in the micro batch b (every saved tensor holds T = (s/cp)·b
    tokens, or none: the torch kernels' fp32 weight copies, an MoE layer's [E]-sized ones):
    measured at micro batches 1 and 2, fitted for the others (exact:
    tests/unit/test_plan_modules.py)."""
    selective = tuple(selective)
    question = ("layer_saves", moe, kernels, selective)  # (a search asks it ~10^5 times)
    return modules.per_config(cfg, question, lambda: _saves(cfg, moe, kernels, selective)[0])


def layer_trace(cfg: Config, moe: bool, kernels: str = "fused") -> tuple:
    """One layer's plan/layer_trace.py summary (forward, backward states, ZeRO-3 moment) at
    cfg's micro batch, from the same runs as layer_saves: each figure fitted in the micro
    batch through the two measured ones (a state's largest moment is one op's at each)."""
    return modules.per_config(cfg, ("layer_trace", moe, kernels), lambda: _trace(cfg, moe, kernels))


def _trace(cfg: Config, moe: bool, kernels: str) -> tuple:
    m = cfg.model
    b = cfg.train.micro_batch_size
    core = m.recompute_granularity == "selective" and "core_attn" in m.recompute_modules
    sel = ("core_attn",) if core else ()
    key = _key(cfg, kernels, moe) + sel
    records = _records(cfg, moe, kernels)
    fitted = modules.cached(_TRACES, key, dict)
    if b not in fitted:
        fitted[b] = _fit_trace(*(records[point][2][sel] for point in FIT_POINTS), b)
    return fitted[b]


def _records(cfg: Config, moe: bool, kernels: str) -> dict:
    """{micro batch: _record_layers' result} at FIT_POINTS, measured once per key."""
    records = modules.cached(_SAVES, _key(cfg, kernels, moe), dict)
    if not records:  # on one fake stage
        records.update(_record_layers(cfg, moe, kernels, FIT_POINTS))
    return records


def _fit_trace(one: tuple, two: tuple, b: int) -> tuple:
    t = (b - FIT_POINTS[0]) / (FIT_POINTS[1] - FIT_POINTS[0])

    def line(u: float, v: float) -> float:
        return u + t * (v - u)

    states = {}
    for k in {**one[1], **two[1]}:  # (a state seen at one point only: its figures flat)
        (w, freed, arriving), (w2, freed2, arriving2) = (
            p[1].get(k, q[1].get(k)) for p, q in ((one, two), (two, one))
        )
        states[k] = (line(w, w2), line(freed, freed2), arriving or arriving2)
    zero3 = tuple(line(u, v) for u, v in zip(one[2], two[2], strict=True))
    return line(one[0], two[0]), states, zero3


def final_norm_saves(cfg: Config, kernels: str = "fused") -> float:
    """Bytes the last chunk's final norm saves for backward per microbatch, measured beside
    a layer of the model's first kind (the same stage, input and fit)."""

    def answer():
        return _saves(cfg, modules.layer_kinds(cfg)[0], kernels, ())[1]["final_norm"]

    return modules.per_config(cfg, ("final_norm_saves", kernels), answer)


def mtp_saves(cfg: Config, kernels: str = "fused") -> float:
    """Bytes the loss chunk's multi-token prediction modules (models/mtp.py) save for backward
    per microbatch: their embedding lookups, norms, projections, layers (under the config's
    recompute), logits and losses, measured on the real modules of a fake last stage at micro
    batches 1 and 2 and fitted (0 without MTP)."""
    if not cfg.model.mtp_num_layers:
        return 0.0

    def answer() -> float:
        m, b = cfg.model, cfg.train.micro_batch_size
        recompute = (m.recompute_granularity, tuple(m.recompute_modules))
        key = _key(cfg, kernels, "mtp") + recompute
        points = modules.cached(_MTP, key, dict)
        if not points:
            points.update(_measure_mtp(cfg, kernels))
        (b1, y1), (b2, y2) = ((point, points[point]) for point in FIT_POINTS)
        return y1 + (b - b1) * (y2 - y1) / (b2 - b1)

    return modules.per_config(cfg, ("mtp_saves", kernels), answer)


def _measure_mtp(cfg: Config, kernels: str) -> dict[int, float]:
    """{micro batch: bytes the MTP modules save}, at FIT_POINTS, on one fake last stage."""
    out = {}
    with _fake_stage(cfg, kernels) as (config, _mesh, _tracker, chunk, inputs):
        _to_training_dtype(chunk, cfg.train.precision)
        for b in FIT_POINTS:
            x, ctx = inputs(b)
            tokens = torch.zeros(b, config.seq_length, dtype=torch.long)
            meter = _meter(chunk, ctx=ctx)
            with meter, meter.label("mtp"):
                chunk.run_mtp(x, tokens, tokens, ctx)
            chunk.mtp.pop_stats()
            out[b] = float(meter.by_label.get("mtp", 0))
    return out


def _saves(cfg: Config, moe: bool, kernels: str, selective: tuple[str, ...]) -> tuple:
    """(the layer's rows, the final norm's {"final_norm": bytes}) at cfg's micro batch."""
    b = cfg.train.micro_batch_size
    key = _key(cfg, kernels, moe)
    points = modules.cached(_ROWS, key + (frozenset(selective),), dict)
    if not points:  # the line's two points, replayed from one record each
        records = _records(cfg, moe, kernels)
        for point in FIT_POINTS:
            record, norm, _ = records[point]
            points[point] = (replay(record, selective), norm)
    if b not in points:
        points[b] = tuple(_fit(points, i, b) for i in range(2))
    return points[b]


def _fit(points: dict[int, tuple], i: int, b: int) -> dict[str, float]:
    """Each row of part i's line through the two measured micro batches, at b."""
    (b1, p1), (b2, p2) = ((point, points[point]) for point in FIT_POINTS)
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
        exclude += _context(ctx)
    return SavedTensorMeter(exclude=exclude)


def _measure_layer(cfg: Config, moe: bool, kernels: str, selective: tuple[str, ...]) -> tuple:
    """(the layer's rows, the chunk's final norm's) at cfg's micro batch, measured under the
    real checkpoint (no record, no replay: what the replay is checked against)."""
    b = cfg.train.micro_batch_size
    cfg = _with_selective(cfg, selective)
    with _fake_stage(cfg, kernels) as (config, mesh, tracker, chunk, inputs):
        layer = modules.new_layer(config, mesh, tracker, modules.layer_number(config, moe))
        _with_fp8(layer, config)
        _to_training_dtype(layer, cfg.train.precision)
        _to_training_dtype(chunk, cfg.train.precision)
        x, ctx = inputs(b)
        meter = _labelled(layer, _meter(layer, chunk, ctx=ctx))
        with meter.meter:
            layer(x, ctx)
        meter.remove()
        rows = {k: float(v) for k, v in meter.meter.by_label.items()}
        return rows, _final_norm(chunk, x)


def _record_layers(cfg: Config, moe: bool, kernels: str, micro_batches: tuple) -> dict:
    """{micro batch: (the forward's record, the chunk's final norm's, the layer's
    LayerTrace summary)}, each on its own input to one layer (built with every recomputable
    region) on one fake stage, forward and backward."""
    from megatron_lite.parallel.recompute import regions_run_by

    cfg = _with_selective(cfg, REGIONS)
    out = {}
    with _fake_stage(cfg, kernels) as (config, mesh, tracker, chunk, inputs):
        layer = modules.new_layer(config, mesh, tracker, modules.layer_number(config, moe))
        _with_fp8(layer, config)
        _to_training_dtype(layer, cfg.train.precision)
        _to_training_dtype(chunk, cfg.train.precision)
        regions = {id(m): ("moe" if moe else "mlp") for n, m in layer.named_modules() if n == MLP}
        for b in micro_batches:
            x, ctx = inputs(b)
            norm = _final_norm(chunk, x)
            recorder = _Recorder(_meter(layer, chunk, ctx=ctx), regions)
            labels = _labelled(layer, recorder.meter)
            trace = LayerTrace(recorder.meter)
            with trace:
                trace.prepare(layer, [*chunk.parameters(), *chunk.buffers(), *_context(ctx)])
                trace.label([x], "activations")
                with recorder.meter, regions_run_by(recorder.run):
                    y = layer(x, ctx)
                del x  # held by what saved it
                labels.remove()
                trace.regions = _inside_only(record := tuple(recorder.record))
                trace.started = recorder.started
                trace.backward(y)
            saved, fp32 = sum(replay(record, ()).values()), cfg.train.precision != "bf16"
            summaries = {sel: trace.summary(saved, fp32, sel) for sel in TRACED}
            out[b] = (record, norm, summaries)
    return out


def _with_fp8(layer: torch.nn.Module, config) -> None:
    """Local FP8 (model.fp8=tensorwise|rowwise) as the model chunk applies it: its linears'
    GEMMs cast their operands (the FP8 copies and scales are the forward's and backward's
    temporaries). fp8_skip entries naming a layer by number (`layers.0.`) are not told apart."""
    from megatron_lite.models.fp8 import apply_fp8
    from megatron_lite.parallel.fp8 import LOCAL_RECIPES

    if config.fp8 in LOCAL_RECIPES:
        apply_fp8(layer, config.fp8, config.fp8_skip, config.fp8_unaligned, config.fp8_all_gather)


def _inside_only(record: tuple) -> dict[str, dict]:
    """{region: {storage key: bytes}} of the storages only saves inside the region make and
    its recompute does not keep (what a recompute of it rebuilds in the backward)."""
    where: dict = {}  # storage key -> the regions of its saves and entries' kept inputs
    nbytes: dict = {}
    for key, a, b, c in record:
        if key is None:  # a region's entry: its kept inputs are not rebuilt
            for (k, _), _n in b:
                where.setdefault(k, set()).add(None)
        else:
            where.setdefault(key[0], set()).add(c)
            nbytes[key[0]] = a
    out: dict[str, dict] = {}
    for k, regions in where.items():
        if len(regions) == 1 and None not in regions and k in nbytes:
            out.setdefault(next(iter(regions)), {})[k] = nbytes[k]
    return out


def _context(ctx) -> list:
    return [t for t in (*(ctx.rope or ()), ctx.docs, ctx.positions) if t is not None]


class _Labels:
    def __init__(self, meter, handles):
        self.meter, self._handles = meter, handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _labelled(layer: torch.nn.Module, meter) -> _Labels:
    """The meter's label is the innermost module's path while it runs ("layer": its own code)."""
    handles = []
    for name, m in layer.named_modules():
        tag = name or LAYER
        handles.append(m.register_forward_pre_hook(lambda *_, t=tag: meter._push(t)))
        handles.append(m.register_forward_hook(lambda *_: meter._pop()))
    return _Labels(meter, handles)


def _final_norm(chunk: torch.nn.Module, x) -> dict[str, float]:
    norm = _meter(chunk)
    with norm, norm.label("final_norm"):
        chunk.final_norm(x)
    return {"final_norm": float(norm.by_label.get("final_norm", 0))}


class _Recorder:
    """Records a forward's saves in order, (storage, bytes, label, region), and each
    recomputable region's entry, (None, region, ((storage, bytes), ...) it keeps, label);
    runs the regions as plain calls (regions_run_by). The meter still counts as usual."""

    def __init__(self, meter, regions: dict[int, str]):
        self.meter, self.record, self._regions, self._inside = meter, [], regions, []
        self._entries: dict = {}  # storage key -> the record's id of its current entry
        self.started: set[str] = set()  # regions whose backward has begun
        meter.on_save = self._saved

    def _saved(self, key, nbytes: int, label: str | None, new: bool) -> None:
        if new:  # a new entry (the meter counts it): a storage is a key only while held
            self._entries[key] = (key, len(self.record))
        region = self._inside[-1] if self._inside else None
        self.record.append((self._entries[key], nbytes, label, region))

    def run(self, fn, args):
        from megatron_lite.parallel.recompute import keeps
        from megatron_lite.training.activation_memory import _storage_key

        # a module's forward is the MLP/MoE region; the attention's core is a function
        region = self._regions.get(id(fn), "core_attn")
        kept = []
        for a in args:
            found = _storage_key(a) if keeps(a) else None
            if found is not None and found[0] not in self.meter._excluded:
                key, nbytes = found  # its entry if the meter holds it, else a new one
                entry = self._entries[key] if self.meter.held(key) else (key, len(self.record))
                kept.append((entry, nbytes))
        self.record.append((None, region, tuple(kept), self.meter.current_label))
        self._inside.append(region)
        try:
            out = fn(*args)
        finally:
            self._inside.pop()
        # its backward begins at its outputs' nodes (where a checkpoint would recompute it)
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.grad_fn.register_prehook(lambda grads, r=region: self.started.add(r) or None)
        return out


def replay(record: tuple, selective: tuple[str, ...] | frozenset) -> dict[str, float]:
    """{label: bytes} the meter would count for the forward of `record` (_Recorder) with the
    regions of `selective` recomputed (module docstring)."""
    seen, rows = set(), {}

    def save(key, nbytes, label):
        if key not in seen:
            seen.add(key)
            if label is not None:
                rows[label] = rows.get(label, 0.0) + nbytes

    for key, a, b, c in record:
        if key is None:  # a region's entry: a, b, c = region, kept inputs, caller's label
            for k, nbytes in b if a in selective else ():
                save(k, nbytes, c)
        elif c is None or c not in selective:  # a save: a, b, c = bytes, label, region
            save(key, a, b)
    return rows


def subtree(rows: dict[str, float], path: str) -> float:
    """Bytes of the module at `path` and every module inside it."""
    return sum(v for k, v in rows.items() if k == path or k.startswith(path + "."))
