"""The moments a pipeline rank's memory can peak, walked along its own schedule, with every
planner term at each: the peak is one instant, so the terms are those of the largest moment,
not each term's own maximum.

The walk runs the rank's action list (pipeline/schedules.py) for the fewest microbatches with
the full step's steady state (min(M, 2·pp), what plan --dry-run runs), counting the
(microbatch, chunk) pairs whose saved activations are held, and records:
- forward: the end of a chunk's forward at its last layer's MLP (the held pairs, this one
  complete, plus the layer's forward working set, plan/working.py);
- backward: the start of a chunk's backward (the held pairs and the received output gradient),
  then its first layer's backward moments (under full recompute, beside the group it rebuilds);
- loss backward (the last virtual stage): the held pairs, the logits and the loss's fp32
  gradient beside them (with multi-token prediction, the MTP modules' saves are among the
  held pair's, and their backward runs first: gone after this moment); with gradient
  buffers, the output layer's weight gradient [V/tp, h] and its input's gradient as the
  layer's bucket arrives (the logits freed, the final norm's saved input alive); then the
  layers' backward as above.
The model states change within a step too:
- ZeRO-2 (data_parallel/buffers.py): the bucket launched last by the previous backward stays in
  flight until the next backward launches one; a backward's first weight gradient allocates the
  chunk's first bucket (in backward order);
- ZeRO-3 (FSDP2): the sharded gradients exist only from the step's last reduce-scatter to the
  optimizer step (none at these moments); with M > 1 each chunk keeps unsharded gradients (the
  reduce dtype) from its first backward (under a split backward the linear weights' from its
  first W, which computes them). Under parallel.zero3_grad_reduce=microbatch it keeps none
  between microbatches: a backward holds the running layer's gradients made so far (the first
  microbatch's moments, every microbatch) until its reduce-scatter, a W the chunk's weight
  gradients it writes (the compute dtype) until after_weight reduces them, and the fp32 sharded
  gradients exist from the chunk's first backward on. The backward's end reduce-scatters the
  chunk root (its largest unit: embedding, output layer), its gradients (the compute dtype)
  copied into the flat reduce-dtype input before they are freed: both at once. Gathered
  weights (the compute dtype): a forward holds the chunk root (embedding, final norm, output
  layer) and the running layer twice (its weights and the all-gather buffer kept for the next
  copy-out); a backward starts by gathering the root again (the flat all-gather output beside
  its copy), then holds the root, the running layer and the prefetched next one (none in a
  chunk of one layer); the loss backward holds the root and one layer.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass

from megatron_lite.config import Config
from megatron_lite.parallel.data_parallel.memory import formula_bytes
from megatron_lite.parallel.data_parallel.optimizer_spec import get_optimizer
from megatron_lite.parallel.fp8 import gemm_dims_aligned
from megatron_lite.pipeline.schedules import get_schedule, splits_backward, virtual_stage
from megatron_lite.plan.activations import (
    chunk_bytes,
    deferred_wgrad_bytes,
    head_terms,
    layer_bytes,
    layer_shape,
    rebuilt_mlp,
    recompute_settings,
)
from megatron_lite.plan.modules import layer_kinds, per_config
from megatron_lite.plan.modules import layer_params as layer_params_of
from megatron_lite.plan.optimizer_states import split_states
from megatron_lite.plan.params import (
    buckets,
    buffer_bytes,
    chunk_moe,
    chunk_param_list,
    fsdp_units,
    head_params,
    last_embedding_grad,
    layer_linear_weights,
    placement,
    rank_params,
)
from megatron_lite.plan.saved import mtp_saves
from megatron_lite.plan.working import backward_moments, forward_working
from megatron_lite.resolve import mtp_moe_pattern, num_microbatches, padded_vocab_size


@dataclass
class Moment:
    """One instant of the step: where (`phase`) and the planner's terms then (bytes)."""

    phase: str
    terms: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.terms.values())


@dataclass
class _Chunk:
    """What the walk needs of one model chunk of the rank."""

    kept: float  # saved bytes per microbatch
    rebuilt: float  # recompute: what a backward rebuilds first (full: the group, selective:
    # the last layer's recomputed MLP or MoE)
    rerun_offset: float  # its forward's working set against forward_working
    last_moe: bool  # its last layer is an MoE layer
    loss: bool  # the last virtual stage: the loss is computed here
    embedding: bool  # virtual stage 0
    root: float  # ZeRO-3: the chunk root's parameters
    layer: float  # ZeRO-3: its largest layer unit's parameters
    layers: int  # its layer count
    params: float  # its parameters (dense + expert)
    shard: float  # ZeRO-3: its parameters' elements on this rank (dense / n, experts / n_edp)
    cuts: tuple[list, list]  # ZeRO-2: (dense, expert) buckets, (elements, parameters) each
    ends: tuple[list, list]  # the running sums of their parameters (_live_buckets)
    after: int  # dense parameters after its layers (final norm, output layer)
    left: tuple[int, int]  # ZeRO-2: the (dense, expert) bucket its backward launches last
    deferred: float = 0.0  # a split backward's queued weight GEMMs' bytes, from B to W
    deferred_weights: int = 0  # the elements of the weights whose gradients W computes
    mtp_deferred: float = 0.0  # of `deferred`, the MTP modules' (queued before the layers')
    backwarded: bool = False  # the walk has run a backward of it
    weighted: bool = False  # the walk has run a W of it


def fp8_gathered(cfg: Config, moe: bool) -> int:
    """Elements of one layer's weights ZeRO-3 gathers in FP8 (model.fp8=tensorwise with
    fp8_all_gather: data_parallel/fsdp_fp8.py): its parallel linears whose dims are multiples
    of 16 (the others stay bf16, model.fp8_unaligned); layers named in model.fp8_skip are not
    told apart (the default skips the output layer only, a root parameter)."""
    m = cfg.model
    if cfg.parallel.zero_stage != 3 or m.fp8 != "tensorwise" or not m.fp8_all_gather:
        return 0
    shapes = layer_params_of(cfg, moe).linear_shapes
    return sum(o * i for o, i in shapes if gemm_dims_aligned(o, i))


def fp8_gathered_elements(cfg: Config, pp_rank: int) -> int:
    """Elements of this pipeline rank's weights ZeRO-3 gathers in FP8 (`fp8_gathered`), over
    its chunks' layers: each gather moves them in 1 byte instead of the compute dtype's."""
    chunks = range(cfg.parallel.vpp)
    return sum(fp8_gathered(cfg, e) for c in chunks for e in chunk_moe(cfg, pp_rank, c))


def static_states(cfg: Config, pp_rank: int) -> dict[str, float]:
    """{weights, grads, master, optimizer} bytes that hold through the step's forward and
    backward: formula_bytes without the transient gradients, and no ZeRO-3 gradient shards."""
    return dict(per_config(cfg, ("static_states", pp_rank), lambda: _static(cfg, pp_rank)))


def _static(cfg: Config, pp_rank: int) -> dict[str, float]:
    p = cfg.parallel
    if not get_optimizer(cfg.train.optimizer).elementwise:  # groups stepped whole or flat
        return split_states(cfg, pp_rank, transient=False)
    dense, expert = rank_params(cfg, pp_rank)
    n_dense = p.dp_shard or p.dp * p.cp
    n_expert = p.dp_shard or max(p.dp * p.cp // p.ep, 1)
    out = dict.fromkeys(("weights", "grads", "master", "optimizer"), 0.0)
    for count, n in ((dense, n_dense), (expert, n_expert)):
        if count:
            spec = get_optimizer(cfg.train.optimizer)  # its states' bytes per parameter
            terms = formula_bytes(count, cfg.train.precision, p.zero_stage, n, optimizer=spec)
            for k, v in terms.items():
                out[k] += v
    if p.zero_stage == 3:
        out["grads"] = 0.0
    return out


def _deferred(cfg: Config, shape, moe: list[bool], loss: bool) -> tuple[float, int, float]:
    """A split backward's queued weight GEMMs of one chunk and microbatch: (the bytes they
    keep from B to W, the elements of the weights whose gradients they compute, the MTP
    modules' part of those bytes). Its layers' (none of a fully recomputed layer: its rerun in
    B computes them there) and, on the last virtual stage, the output layer's (input [s, b, h]
    and logits gradient [s, b, V/tp]) and the MTP modules'."""
    gran, _, method, num = recompute_settings(cfg)
    queued = moe if gran != "full" else (moe[min(num, len(moe)) :] if method == "block" else [])
    out = sum(deferred_wgrad_bytes(cfg, shape, e) for e in queued)
    weights = sum(layer_linear_weights(cfg, e) for e in queued)
    mtp = 0.0
    if loss:
        m = cfg.model
        v_local = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, shape.tp)
        head = shape.tokens * shape.act_bytes * (shape.h + v_local / shape.tp)
        out += head
        weights += v_local // shape.tp * shape.h
        # the MTP modules: each its projection [h/tp, 2h] and layer (rerun in B under full
        # recompute, so nothing queued there) and the shared head once more
        for e in mtp_moe_pattern(m):
            mtp += head
            if gran != "full":
                mtp += deferred_wgrad_bytes(cfg, shape, e)
                mtp += shape.tokens * shape.act_bytes * (2 * shape.h + shape.h / shape.tp)
                weights += layer_linear_weights(cfg, e) + shape.h // shape.tp * 2 * shape.h
    return out + mtp, weights, mtp


def _chunks(cfg: Config, pp_rank: int, shape) -> list[_Chunk]:
    p = cfg.parallel
    _, modules, _, _ = recompute_settings(cfg)  # selective's (none otherwise)
    split = splits_backward(p.pipeline_schedule, p.vpp)
    shards = (p.dp_shard or p.dp * p.cp, p.dp_shard or max(p.dp * p.cp // p.ep, 1))
    chunks = []
    mtp = mtp_saves(cfg, shape.kernels)  # the loss chunk's MTP modules, kept with its layers'
    for c in range(p.vpp):
        moe = chunk_moe(cfg, pp_rank, c)
        kept, rebuilt = chunk_bytes(cfg, shape, moe)
        offset = 0.0
        one = shape.tokens * shape.u * shape.h * shape.act_bytes  # [s/cp(/tp), b, h]
        if not rebuilt and moe and moe[-1] and "moe" in modules:
            rebuilt = rebuilt_mlp(cfg, shape, True) + one  # all it saves, its input too
            offset = -2 * one  # attn, input
        elif not rebuilt and moe and not moe[-1] and "mlp" in modules:
            rebuilt = rebuilt_mlp(cfg, shape, False)
            offset = -one  # the attention's
        root, layers = fsdp_units(cfg, pp_rank, c)
        # FP8-gathered weights take 1 byte an element: the units in compute-dtype elements
        # (the extra unit past the layers, experts outside them, gathers in bf16)
        fp8 = [fp8_gathered(cfg, e) * (1 - 1 / shape.act_bytes) for e in moe]
        units = [n - f for n, f in itertools.zip_longest(layers, fp8, fillvalue=0.0)]
        stage = virtual_stage(pp_rank, c, p.pp, placement(cfg))
        cuts = ([], [])
        if p.zero_stage == 2:
            for expert, n, cut in zip((False, True), shards, cuts, strict=True):
                cut += buckets(cfg, pp_rank, c, expert, n) if n > 1 else []
        loss = stage == p.pp * p.vpp - 1
        kept += mtp if loss else 0.0
        ends = tuple(list(itertools.accumulate(n for _, n in cut)) for cut in cuts)
        chunks.append(_Chunk(
            kept=kept, rebuilt=rebuilt, rerun_offset=offset, last_moe=bool(moe and moe[-1]),
            loss=loss, embedding=stage == 0, root=root,
            layer=max(units, default=0), layers=len(layers), params=root + sum(layers),
            shard=sum(n / shards[e] for n, e in chunk_param_list(cfg, pp_rank, c)), cuts=cuts,
            ends=ends, after=len(head_params(cfg, pp_rank, c)[1]),
            left=_left_in_flight(cfg, pp_rank, c, cuts, ends),
        ))  # fmt: skip
        if split:
            ch = chunks[-1]
            ch.deferred, ch.deferred_weights, ch.mtp_deferred = _deferred(cfg, shape, moe, loss)
    return chunks


def _mtp_layer_backward(cfg: Config, shape, ch: _Chunk, head: dict, bwd: dict, fwd: dict,
                        state: tuple, root: float, layer: float, mtp_emb: float):  # fmt: skip
    """The last MTP module's layer backward, after its head's: the module's head saves (final
    norm, output layer input, logits) gone, its layer's freed as measured, and the MTP head's
    gradient of the output weight waiting in autograd's input buffer for the main head's."""
    now, kept, embedding, logits = state
    e = mtp_moe_pattern(cfg.model)[-1]
    saves = sum(layer_bytes(cfg, shape, e).values())
    moments = bwd[e] if e in bwd else backward_moments(cfg, shape, e)
    act = kept - (head["final_norm"] + head["output_in"] + head["logits"])
    held = head["embedding_grad"] + root + layer + ch.mtp_deferred + mtp_emb
    rebuilt = ch.rebuilt if ch.last_moe == e else 0.0  # its recomputed MoE (or MLP), as a layer's
    if rebuilt:
        forward = fwd[e] if e in fwd else forward_working(cfg, shape, e)
        yield "loss backward", (now, act, embedding, logits,
                                held + rebuilt + forward + ch.rerun_offset)  # fmt: skip
    for w, freed, *_ in moments:
        if rebuilt:
            w, freed = w + max(rebuilt - freed, 0.0), max(freed - rebuilt, 0.0)
        yield "loss backward", (now, act - min(freed, saves), embedding, logits, w + held)


def _left_in_flight(cfg: Config, pp_rank: int, c: int, cuts: tuple, ends: tuple) -> tuple:
    """ZeRO-2: elements of the (dense, expert) bucket chunk c's backward launches last, which
    stays in flight until the next backward launches one (data_parallel/buffers.py): the one
    whose parameter gets its gradient last. That is the last in backward order, except in a
    chunk with the embedding, where the parameter before the layers whose gradient the
    embedding's backward makes last (measured: plan/modules.py) decides."""
    out = [cut[-1][0] if cut else 0 for cut in cuts]
    last = last_embedding_grad(cfg, pp_rank, c)
    if last is not None and cuts[0]:
        params = chunk_param_list(cfg, pp_rank, c)
        dense = [i for i, (_, expert) in enumerate(params) if not expert]
        at = len(dense) - 1 - dense.index(last)  # its place in the dense buffer's backward order
        out[0] = cuts[0][bisect.bisect_right(ends[0], at)][0]
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _compute_actions(
    pp: int, rank: int, microbatches: int, vpp: int, schedule: str | None = None
) -> tuple:
    """(kind, chunk) of each compute action (forward, backward, weight) of the rank's schedule,
    in order."""
    actions = get_schedule(pp, rank, microbatches, vpp, schedule)
    return tuple((a.kind, a.chunk) for a in actions if not a.is_comm)


def _walk(cfg: Config, pp_rank: int, kernels: str):
    """Yield (phase, terms that depend on the moment) along the rank's schedule; the static
    terms are the first thing yielded, as ("", terms). A zero-bubble schedule's queued weight
    GEMMs (from each B to its W: `_Chunk.deferred`) are in every moment's working bytes."""
    pending = [0.0]  # the queued weight GEMMs' bytes now (moved by `_moments`)
    for phase, dynamic in _moments(cfg, pp_rank, kernels, pending):
        if phase:
            grads, act, embedding, logits, working = dynamic
            dynamic = (grads, act, embedding, logits, working + pending[0])
        yield phase, dynamic


def _moments(cfg: Config, pp_rank: int, kernels: str, pending: list[float]):
    """`_walk`'s moments without the queued weight GEMMs, which it keeps in pending[0]."""
    p = cfg.parallel
    shape = layer_shape(cfg, kernels)
    m = num_microbatches(cfg.train, p.dp)
    walk = min(m, 2 * p.pp) if p.pp > 1 else min(m, 2)
    chunks = _chunks(cfg, pp_rank, shape)
    head = head_terms(cfg, shape)
    split = splits_backward(p.pipeline_schedule, p.vpp)  # B and W apart (zb-h1, zb-v, ...)
    yield "", dict(static_states(cfg, pp_rank), buffers=buffer_bytes(cfg, pp_rank))
    A = shape.act_bytes
    reduce_bytes = 2 if p.grad_reduce_dtype == "bf16" else 4
    recv = shape.tokens * shape.u * shape.h * shape.residual_bytes  # a received output grad
    logits = head["final_norm"] + head["output_in"] + head["logits"]
    emb_grad = head["embedding_grad"]  # the embedding's weight gradient, [V/tp, h]
    emb_out = shape.tokens * shape.h * A  # its output's gradient, masked
    # the MTP lookup's dense gradient of the embedding weight, held until summed with the
    # weight's other gradients: the tied output layer's (pp > 1) or the embedding's (one
    # chunk); an untied last stage's own copy takes it at once
    mtp_emb = emb_grad if head["mtp"] and (cfg.model.tie_embeddings or p.pp * p.vpp == 1) else 0.0
    kinds = set(layer_kinds(cfg))  # (measured: only the kinds the model has)
    fwd = {e: forward_working(cfg, shape, e) for e in kinds}
    bwd = {e: backward_moments(cfg, shape, e) for e in kinds}
    # ZeRO-3 with M > 1: a chunk's later backwards add into its unsharded gradients
    later = {e: backward_moments(cfg, shape, e, accumulated=True) for e in kinds}
    # ... (step), or reduce-scatter each microbatch into the fp32 shards (microbatch)
    keep = p.zero_stage == 3 and m > 1 and p.zero3_grad_reduce == "step"
    per_mb = p.zero_stage == 3 and m > 1 and not keep
    kept = embedding = grads = 0.0  # saved by the held pairs; gradients beyond the static
    in_flight = [0, 0]  # ZeRO-2: the (dense, expert) buckets the last backward left in flight
    last_chunk = None  # and its chunk

    # an aux or z loss: the router's gradient (the MoE layer's first dense parameter in
    # backward order) takes the objective's short path and reaches its bucket before the
    # experts' backward
    objective = bool(cfg.model.moe_aux_loss_coeff or cfg.model.moe_z_loss_coeff)

    def zero2(ch, c: int, group: int, arrived: int, arriving: int | None = None,
              router: bool = False) -> float:  # fmt: skip
        """Bytes of ZeRO-2 buckets alive in chunk c's backward: `group`'s (`arrived`,
        `arriving`: _live_buckets), the other group's in flight, or, in an MoE layer's
        backward (`router`), the dense buckets of the head's gradients (the loss chunk) and of
        the router's (with an objective)."""
        mine = in_flight[group]
        if ch.cuts[group]:
            same = last_chunk == c and len(ch.cuts[group]) == 1
            mine = _live_buckets(ch.cuts[group], arrived, arriving, in_flight[group], same,
                                 ch.ends[group])  # fmt: skip
        other = in_flight[1 - group]
        head = ch.after if ch.loss else 0
        if router and group == 1 and ch.cuts[0] and (head or objective):
            same = last_chunk == c and len(ch.cuts[0]) == 1
            first = head if objective else None
            other = _live_buckets(ch.cuts[0], head, first, in_flight[0], same, ch.ends[0])
        return grads + 4 * (mine + other)

    seen = set()  # (action, state) already yielded: the steady state repeats itself
    for kind, c in _compute_actions(p.pp, pp_rank, walk, p.vpp, p.pipeline_schedule):
        ch = chunks[c]
        root, layer = (A * ch.root, A * ch.layer) if p.zero_stage == 3 else (0.0, 0.0)
        held = min(ch.layers, 2)  # a backward's running layer and the one it prefetches
        if kind == "weight" and keep and not ch.weighted:
            ch.weighted = True  # the unsharded gradients of the weights W computes, from now on
            grads += reduce_bytes * ch.deferred_weights
        now = grads + 4 * sum(in_flight)
        if kind == "weight":  # W: the queued GEMMs run (into the gradients), then release
            state = ("weight", c, round(kept), round(now), round(pending[0]))
            if state not in seen:
                seen.add(state)
                # (per microbatch: W's own gradients, until after_weight reduce-scatters them)
                written = A * ch.deferred_weights if per_mb else 0.0
                yield "weight", (now, kept, embedding, 0.0, written)
            pending[0] -= ch.deferred
            continue
        if kind == "forward":
            kept += ch.kept
            embedding += head["embedding"] if ch.embedding else 0.0
            state = (True, c, round(kept), round(now), round(pending[0]))
            if state not in seen:
                seen.add(state)
                yield "forward", (now, kept + fwd[ch.last_moe], embedding, 0.0, root + 2 * layer)
            continue
        moved = (round(grads), tuple(in_flight), last_chunk, round(pending[0]))
        state = (False, c, round(kept), *moved)
        if state in seen:  # the same moments again: only the state moves on
            pending[0] += ch.deferred
            kept -= ch.kept
            embedding -= head["embedding"] if ch.embedding else 0.0
            in_flight, last_chunk = list(ch.left), c
            continue
        seen.add(state)
        if ch.loss:  # the root gathered again, then the loss's gradient beside the logits
            for w, gathered in ((0.0, 2 * root + layer), (head["logits_grad"], root + layer)):
                yield "loss backward", (now, kept, embedding, logits, w + gathered)
            # the MTP modules' backward (their ops are the forward's last) runs first: their
            # saves are gone by the main head's backward and the layers', their queued weight
            # GEMMs' tensors (a split backward) held, and their lookup's dense gradient of a
            # shared embedding weight until the weight's last gradient is summed with it
            if head["mtp"]:
                if not split:  # (a split backward queues those weight GEMMs until W)
                    at = (now, kept, embedding, logits)
                    yield from _mtp_layer_backward(cfg, shape, ch, head, bwd, fwd, at, root,
                                                   layer, mtp_emb)  # fmt: skip
                kept -= head["mtp"]
                w = head["logits_grad"] + root + layer + ch.mtp_deferred + mtp_emb
                yield "loss backward", (now, kept, embedding, logits, w)
            if shape.main_grad:  # the output layer's weight gradient as its bucket arrives
                g, out_grads = zero2(ch, c, 0, 0, 0), head["embedding_grad"] + head["output_in"]
                out_grads += ch.mtp_deferred + mtp_emb
                # the MTP heads' use of the output weight: its gradient (returned, as the
                # weight is passed in: parallel/layers.py) waits for the main head's in
                # autograd's input buffer, which then sums both into a third [V/tp, h]
                out_grads += 2 * head["embedding_grad"] if head["mtp"] and not split else 0.0
                yield "loss backward", (g, kept + head["final_norm"], embedding, 0.0, out_grads)
        else:
            yield "backward", (now, kept + recv, embedding, 0.0, 2 * root + held * layer)
        if ch.rebuilt:  # the recomputed group's (or module's) forward again
            rerun = ch.rebuilt + fwd[ch.last_moe] + ch.rerun_offset + root + 2 * layer
            yield "backward", (now, kept + recv * (not ch.loss), embedding, 0.0, rerun)
            if ch.last_moe and objective:  # then the router's gradient first (see above)
                g = zero2(ch, c, 1, 0, None, router=True)
                yield "backward", (g, kept + recv * (not ch.loss), embedding, 0.0, rerun)
        accumulated = keep and ch.backwarded
        layers_kept = ch.kept - (head["mtp"] if ch.loss else 0.0)  # (the MTP's freed above)
        for w, freed, group, arrived, arriving in (later if accumulated else bwd)[ch.last_moe]:
            if ch.rebuilt:  # what the backward frees is of the rebuilt part first
                w, freed = w + max(ch.rebuilt - freed, 0.0), max(freed - ch.rebuilt, 0.0)
            act = kept + (0.0 if ch.loss else recv) - min(freed, layers_kept)
            before = ch.after if group == 0 and ch.loss else 0  # the head's, in already
            if arriving is not None:
                arriving += before
            g = zero2(ch, c, group, arrived + before, arriving, router=ch.last_moe)
            # the loss chunk's output gradient (the final norm's) is the step's own temporary
            w += recv if ch.loss else 0.0
            # a split backward queues its weight GEMMs' tensors as it frees the saved ones
            rest = ch.deferred - ch.mtp_deferred
            w += ch.mtp_deferred + (
                rest * min(freed, layers_kept) / layers_kept if layers_kept else 0.0
            )
            w += mtp_emb if ch.loss and ch.embedding else 0.0  # (summed at the embedding's)
            yield "backward", (g, act, embedding, 0.0, w + root + held * layer)
        kept -= layers_kept
        if ch.embedding:  # its weight gradient beside the output's, then into its bucket
            act, total = kept + (0.0 if ch.loss else recv), sum(n for _, n in ch.cuts[0])
            g = zero2(ch, c, 0, total - 1)
            queued = ch.deferred  # the chunk's layers all through B
            queued += mtp_emb if ch.loss else 0.0  # the MTP lookup's, summed with this one
            yield "backward", (g, act, embedding, 0.0, emb_grad + emb_out + root + queued)
            g = zero2(ch, c, 0, total - 1, total - 1)
            yield "backward", (g, act, embedding, 0.0, emb_grad + root + queued)
        if per_mb:  # the root's reduce-scatter at the backward's end (_reduce_root)
            grads += 0.0 if ch.backwarded else 4 * ch.shard
            ch.backwarded = True  # its fp32 sharded gradients from now on
            g = grads + (A + reduce_bytes) * ch.root
            yield "backward", (g, kept + (0.0 if ch.loss else recv), embedding, 0.0, 0.0)
        embedding -= head["embedding"] if ch.embedding else 0.0
        in_flight, last_chunk = list(ch.left), c
        if keep and not ch.backwarded:
            ch.backwarded = True  # its unsharded gradients from now on (W's from its first W)
            grads += reduce_bytes * (ch.params - ch.deferred_weights)
        pending[0] += ch.deferred  # B done: its weight GEMMs wait for W


def _live_buckets(cut: list, arrived: int, arriving: int | None, prev: int, same: bool,
                  ends: list | None = None) -> int:  # fmt: skip
    """Elements of one gradient buffer's ZeRO-2 buckets alive during its chunk's backward
    (data_parallel/buffers.py): `cut` its buckets, (elements, parameters) in backward order
    (`ends`: the running sums of their parameters, computed if not given); `arrived`
    parameters' gradients added (a bucket launched once full, completing the one launched
    before it); `arriving` the index of the one being added now (its bucket allocated); `prev`
    the bucket the previous backward left in flight, `same` when that is this buffer's only
    bucket (waited for and reused)."""
    if ends is None:
        ends = list(itertools.accumulate(count for _, count in cut))
    full = bisect.bisect_right(ends, arrived)  # buckets 0..full-1 complete (launched)
    alive = {full} if full < len(cut) and (ends[full - 1] if full else 0) < arrived else set()
    if arriving is not None:
        at = bisect.bisect_right(ends, arriving)  # the bucket holding `arriving`
        if full <= at < len(cut):
            alive.add(at)
    live = sum(cut[i][0] for i in alive)
    if full:
        return live + cut[full - 1][0]
    return live + (0 if same and 0 in alive else prev)


def _terms(static: dict[str, float], dynamic: tuple) -> dict[str, float]:
    grads, activations, embedding, logits_loss, working = dynamic
    terms = dict(static, activations=activations, embedding=embedding, logits_loss=logits_loss)
    terms["grads"] += grads
    terms["working"] = working
    return terms


def moments(cfg: Config, pp_rank: int, kernels: str = "fused") -> list[Moment]:
    """Every moment of the walk (see the module docstring), in schedule order; `cfg`
    resolved."""
    walk = _walk(cfg, pp_rank, kernels)
    _, static = next(walk)
    return [Moment(phase, _terms(static, dynamic)) for phase, dynamic in walk]


def peak_moment(cfg: Config, pp_rank: int, kernels: str = "fused") -> Moment:
    """The largest moment of `moments` (the first of equals, as a tracker records a peak)."""
    pending = [0.0]  # _walk's, inlined: the search walks some 10^6 moments
    walk = _moments(cfg, pp_rank, kernels, pending)
    _, static = next(walk)
    best, best_total = None, -1.0
    for phase, (grads, act, embedding, logits, working) in walk:
        working += pending[0]
        total = grads + act + embedding + logits + working  # (sum's order)
        if total > best_total:
            best, best_total = (phase, (grads, act, embedding, logits, working)), total
    return Moment(best[0], _terms(static, best[1]))


def saved_peak(cfg: Config, pp_rank: int, kernels: str = "fused") -> float:
    """The most bytes saved for backward at once on the rank (what the SavedTensorMeter
    measures, no working set): the held pairs' activations and
    embedding bytes, and on the last virtual stage the logits and loss of the pair it just
    forwarded; `cfg` resolved."""
    p = cfg.parallel
    shape = layer_shape(cfg, kernels)
    head = head_terms(cfg, shape)
    m = num_microbatches(cfg.train, p.dp)
    walk = min(m, 2 * p.pp) if p.pp > 1 else min(m, 2)
    chunks = _chunks(cfg, pp_rank, shape)
    logits = head["final_norm"] + head["output_in"] + head["logits"]
    kept = best = 0.0
    for kind, c in _compute_actions(p.pp, pp_rank, walk, p.vpp, p.pipeline_schedule):
        if kind == "weight":  # the queued GEMMs' tensors are not saved for backward
            continue
        forward, ch = kind == "forward", chunks[c]
        step = ch.kept + (head["embedding"] if ch.embedding else 0.0)
        kept += step if forward else -step
        if forward:
            best = max(best, kept + (logits if ch.loss else 0.0))
    return best
