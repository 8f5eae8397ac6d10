"""The real model's modules, built at a layout's local shapes for the planner: parameters (and
buffers) on the meta device, with the process groups of a fake world whose groups have the
layout's sizes (torch's "fake" backend, as plan --dry-run uses: every collective returns at once).

Nothing here knows an architecture: a transformer layer is whatever `TransformerLayer` builds
from the resolved model config, a chunk's embedding and head whatever `ModelChunk` builds
around its layers. What the planner reads of them:
- each parameter's elements and whether it is an expert's (ParamMeta.is_expert), in
  registration order (`nn.Module.parameters()`, the order the gradient buffers lay out);
- the parallel linears whose weight-gradient GEMM a split backward queues (the modules with a
  `wgrad_queue`, parallel/layers.py): their weights' [out, in] local shapes;
- a chunk's parameters before its layers (registered on the chunk itself or on a child added
  before `layers`) and after them, the tied embedding weights (data_parallel.finalize
  .tied_params) and its buffers' bytes;
- of a chunk with the embedding, which of the parameters before its layers gets its gradient
  last: `ModelChunk.embed` run forward and backward on the meta device (GPT's learned
  positions get theirs before the word embedding's, whatever their registration order). Its
  gradient bucket is the one a backward leaves in flight under ZeRO-2 (plan/peak.py).

Built once per key (functools-style caches below: the one module-level state here, bounded):
the model section's fields, the local layout (tp, sequence parallelism, ep) and, for a chunk,
whether it holds the embedding and the head. The search asks for the same few shapes
thousands of times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from megatron_lite.config import Config
from megatron_lite.resolve import cp_a2a_size, sequence_parallel

_MAX_ENTRIES = 4096  # per cache: far above the distinct keys of one search
_MODEL_KEYS: dict[int, tuple] = {}  # id(model section) -> (it, precision, its key's number)
_MODEL_NUMBERS: dict[tuple, int] = {}  # a model key -> a small number (cheap to hash)
_LAYERS: dict[tuple, LayerParams] = {}
_CHUNKS: dict[tuple, ChunkParams] = {}
_HEAD_DIMS: dict[tuple, object] = {}  # model key -> the attention part's HeadDims
_PER_CONFIG: dict[int, tuple] = {}  # id(config) -> (it, its sections, {question: answer})
_PER_CONFIG_ENTRIES = 64  # the configs asked about last (a search asks about one at a time)


@dataclass(frozen=True)
class LayerParams:
    """One transformer layer's parameters on one TP/EP rank."""

    params: tuple[tuple[int, bool], ...]  # (elements, is_expert), registration order
    linear_shapes: tuple[tuple[int, int], ...]  # [out, in] of each queueable linear weight
    buffer_bytes: int  # its buffers' bytes
    gated: bool  # its MLPs' fc1 holds [gate, up] (the model spec's gated_mlp)
    # (name in the layer, parameter on the meta device with its ParamMeta), as `params`: what
    # an optimizer's groups rule and whole-matrix cost read (plan/optimizer_states.py)
    named: tuple[tuple[str, torch.nn.Parameter], ...] = field(default=(), compare=False)

    @property
    def linear_weights(self) -> int:
        """Elements of the parallel-linear weights whose gradient GEMM a split backward
        queues for W (parallel/linear_async.py)."""
        return sum(o * i for o, i in self.linear_shapes)


@dataclass(frozen=True)
class ChunkParams:
    """A model chunk's own parameters (its embedding, final norm, output layer: what it holds
    besides its layers) on one TP rank."""

    before: tuple[tuple[int, bool], ...]  # registered before the layers
    after: tuple[tuple[int, bool], ...]  # after them
    tied: tuple[int, ...]  # indices into before + after of the tied embedding weights
    buffer_bytes: int  # its buffers' bytes (RoPE tables, the vocabulary padding mask)
    linear_shapes: tuple[tuple[int, int], ...]  # [out, in] of its queueable linear weights
    last_grad: int | None = None  # index into `before` of the one whose gradient comes last
    # (name in the chunk, meta-device parameter) of before + after, as LayerParams.named
    named: tuple[tuple[str, torch.nn.Parameter], ...] = field(default=(), compare=False)


_SCALARS = frozenset((int, float, str, bool, type(None)))  # model_key's fields kept as they are


def frozen(v):
    """`v` hashable: lists and tuples as tuples, dicts as sorted item tuples, recursively."""
    if isinstance(v, list | tuple):
        return tuple(frozen(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, frozen(x)) for k, x in v.items()))
    return v


def model_key(cfg: Config) -> int:
    """Every field of the model section but its recompute_* ones (the planner passes the
    recompute it measures), and the precision (any of them may change the modules), as a
    number, one per distinct key. Remembered per section object, so a search pays for it once
    per layout: a section is taken as fixed once planned (validate() and the search's layouts
    make new ones; change a copy, not a planned section)."""
    m, precision = cfg.model, cfg.train.precision
    hit = _MODEL_KEYS.get(id(m))
    if hit is not None and hit[0] is m and hit[1] == precision:
        return hit[2]
    fields = (v for k, v in vars(m).items() if not k.startswith("recompute_"))
    key = tuple(v if type(v) in _SCALARS else frozen(v) for v in fields) + (precision,)
    number = _MODEL_NUMBERS.setdefault(key, len(_MODEL_NUMBERS))
    if len(_MODEL_KEYS) >= _MAX_ENTRIES:
        _MODEL_KEYS.clear()
    _MODEL_KEYS[id(m)] = (m, precision, number)
    return number


def cached(table: dict, key: tuple, build: Callable[[], object]):
    hit = table.get(key)
    if hit is None:
        if len(table) >= _MAX_ENTRIES:
            table.clear()
        hit = table[key] = build()
    return hit


def head_dims(cfg: Config):
    """The attention part's `HeadDims` (q/k, v, rotary widths per head) of the resolved `cfg`:
    the model section's alone, so remembered per model key (resolving a config for its
    TransformerConfig once per layout cost the 70B search 8%)."""

    def read():
        config = transformer_config(cfg, layers_only=True)
        return config.spec.head_dims(config)

    return cached(_HEAD_DIMS, (model_key(cfg),), read)


def per_config(cfg: Config, question: tuple, answer: Callable[[], object]):
    """`answer()`, remembered for this config object and `question` (hashable): the planner
    asks the same few questions of one layout (its chunks' layers and parameters) thousands of
    times. A config is taken as fixed once planned, as model_key takes its model section
    (validate() and the search's layouts make new ones; change a copy, not a planned config):
    a section replaced on it is a new config here."""
    hit = _PER_CONFIG.get(id(cfg))
    if (
        hit is None
        or hit[0] is not cfg
        or hit[1] is not cfg.model
        or hit[2] is not cfg.parallel
        or hit[3] is not cfg.train
    ):
        if len(_PER_CONFIG) >= _PER_CONFIG_ENTRIES:
            _PER_CONFIG.clear()
        hit = _PER_CONFIG[id(cfg)] = (cfg, cfg.model, cfg.parallel, cfg.train, {})
    answers = hit[4]
    found = answers.get(question, answers)  # (the dict itself: not an answer)
    if found is answers:
        found = answers[question] = answer()
    return found


@contextlib.contextmanager
def fake_mesh(tp: int, cp: int = 1, a2a: int | None = None, ep: int = 1) -> Iterator:
    """A `ParallelMesh` for rank 0 of a fake world (torch's "fake" backend: collectives
    return at once) whose tp, cp (Ulysses over `a2a` of them) and ep groups have these sizes;
    the process group is destroyed on exit. Refuses to run where a process group exists."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout

    if dist.is_initialized():
        raise RuntimeError(
            "plan: the planner builds the model's modules in a fake process group of its own; "
            "call it before torch.distributed.init_process_group or after destroying it"
        )
    dp = ep // math.gcd(ep, cp)  # the fewest data-parallel ranks ep folds into
    layout = RankLayout(tp * cp * dp, tp=tp, cp=cp, ep=ep, cp_a2a=a2a)
    hook = sys.excepthook  # init_process_group wraps it (a "[rank0]:" prefix) every time
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world_size)
    try:
        yield ParallelMesh(layout)
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def transformer_config(cfg: Config, layers_only: bool = False):
    """The models' resolved `TransformerConfig` of `cfg` (`layers_only`: a vocabulary of 1
    where none is named, the layers do not read it)."""
    from megatron_lite.models import TransformerConfig

    p = cfg.parallel
    if layers_only and cfg.model.vocab_size is None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=1))
    return TransformerConfig.from_config(cfg, p.tp * p.pp * p.cp * (p.dp or 1))


def layer_kinds(cfg: Config) -> list[bool]:
    """The layer kinds the model has (dense False, MoE True), in order of first appearance."""
    from megatron_lite.resolve import moe_layer_pattern

    return list(dict.fromkeys(moe_layer_pattern(cfg.model)))


def layer_number(config, moe: bool) -> int:
    """A global layer number of that kind (MoE or dense) in the model."""
    pattern = config.moe_layer_pattern
    return next((i for i, e in enumerate(pattern) if e == moe), 0)


def new_layer(config, mesh, tracker, number: int) -> torch.nn.Module:
    """The model's layer `number` (models.build_layer: the architecture's layer part)."""
    import megatron_lite.models as models

    build = getattr(models, "build_layer", None)
    if build is None:  # before the architecture registry
        from megatron_lite.models.transformer import TransformerLayer as build
    return build(config, mesh, tracker, number)


def _param_list(params) -> tuple[tuple[int, bool], ...]:
    from megatron_lite.parallel.params import meta_of

    return tuple((p.numel(), bool(meta_of(p).is_expert)) for p in params if p.requires_grad)


def _linear_shapes(module: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """[out, in] of the weights of the parallel linears that can queue their weight GEMM."""
    out = []
    for m in module.modules():
        w = getattr(m, "weight", None)
        if hasattr(m, "wgrad_queue") and isinstance(w, torch.nn.Parameter):
            out.append(tuple(w.shape))
    return tuple(out)


def _buffer_bytes(module: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def layer_params(cfg: Config, moe: bool) -> LayerParams:
    """One layer's parameters (an MoE layer's when `moe`) at `cfg`'s layout (cached)."""

    def shared():  # between configs of one model and local layout
        p = cfg.parallel
        key = (model_key(cfg), p.tp, sequence_parallel(p), p.ep, moe)
        return cached(_LAYERS, key, lambda: _build_layer(cfg, moe))

    return per_config(cfg, ("layer_params", moe), shared)


def _build_layer(cfg: Config, moe: bool) -> LayerParams:
    from megatron_lite.parallel.random import RNGStatesTracker

    config = transformer_config(cfg, layers_only=True)
    with fake_mesh(cfg.parallel.tp, ep=cfg.parallel.ep) as mesh, torch.device("meta"):
        layer = new_layer(config, mesh, RNGStatesTracker(), layer_number(config, moe))
    params = _param_list(layer.parameters())
    gated = bool(config.spec.gated_mlp)
    named = tuple((n, q) for n, q in layer.named_parameters() if q.requires_grad)
    return LayerParams(params, _linear_shapes(layer), _buffer_bytes(layer), gated, named)


def chunk_params(cfg: Config, pre_process: bool, post_process: bool) -> ChunkParams:
    """A chunk's own parameters (embedding when `pre_process`, final norm and output layer,
    and the multi-token prediction modules, when `post_process`) and buffers at `cfg`'s
    layout (cached). A miss builds, in one fake world, every kind of chunk the layout's
    pipeline has (all three of a multi-stage one: the search asks for each) that is not built
    yet."""
    p = cfg.parallel
    # ep: the last chunk's MTP layers may be MoE layers (their experts over ep)
    key = (model_key(cfg), p.tp, sequence_parallel(p), p.cp, cp_a2a_size(p), p.ep)
    hit = _CHUNKS.get(key + (pre_process, post_process))
    if hit is not None:
        return hit
    kinds = [(True, True)] if p.pp * p.vpp == 1 else [(True, False), (False, False), (False, True)]
    kinds = [
        k
        for k in {(pre_process, post_process): 0, **dict.fromkeys(kinds)}
        if key + k not in _CHUNKS
    ]
    if len(_CHUNKS) + len(kinds) > _MAX_ENTRIES:
        _CHUNKS.clear()
    for k, built in zip(kinds, _build_chunks(cfg, kinds), strict=True):
        _CHUNKS[key + k] = built
    return _CHUNKS[key + (pre_process, post_process)]


def _build_chunks(cfg: Config, kinds: list[tuple[bool, bool]]) -> list[ChunkParams]:
    from megatron_lite.models import ModelChunk
    from megatron_lite.parallel.random import RNGStatesTracker

    p = cfg.parallel
    config = transformer_config(cfg)
    with fake_mesh(p.tp, p.cp, cp_a2a_size(p), p.ep) as mesh, torch.device("meta"):
        chunks = [
            ModelChunk(config, mesh, RNGStatesTracker(), [], pre, post) for pre, post in kinds
        ]
        return [_chunk_params(chunk, _last_grad(chunk, config)) for chunk in chunks]


def _last_grad(chunk: torch.nn.Module, config) -> int | None:
    """Index into the chunk's parameters before its layers (`_chunk_params`'s `before`) of
    the one whose gradient arrives last in the backward of `chunk.embed` (None without an
    embedding): measured with hooks after each gradient's accumulation, on the meta device."""
    if not chunk.pre_process:
        return None
    before = _before(chunk)
    order: list[int] = []
    hooks = [
        q.register_post_accumulate_grad_hook(lambda _, i=i: order.append(i))
        for i, q in enumerate(before)
        if q.requires_grad
    ]
    try:
        with torch.device("meta"):
            ids = torch.zeros(1, config.seq_length, dtype=torch.long)
            chunk.embed(ids).float().sum().backward()
    finally:
        for h in hooks:
            h.remove()
        for q in before:
            q.grad = None
    return order[-1] if order else None


def _before(chunk: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The chunk's parameters registered before its layers, in registration order."""
    children = list(chunk.named_children())
    cut = [n for n, _ in children].index("layers")
    first = list(chunk.parameters(recurse=False))
    return first + [q for _, c in children[:cut] for q in c.parameters()]


def _chunk_params(chunk: torch.nn.Module, last_grad: int | None = None) -> ChunkParams:
    from megatron_lite.parallel.data_parallel.finalize import tied_params

    children = list(chunk.named_children())
    cut = [n for n, _ in children].index("layers")
    before = _before(chunk)
    after = [q for _, c in children[cut + 1 :] for q in c.parameters()]
    ordered = [q for q in before + after if q.requires_grad]
    tied = {id(q) for q in tied_params([chunk])}
    names = {id(q): n for n, q in chunk.named_parameters()}
    return ChunkParams(
        before=_param_list(before),
        after=_param_list(after),
        tied=tuple(i for i, q in enumerate(ordered) if id(q) in tied),
        buffer_bytes=_buffer_bytes(chunk),
        linear_shapes=_linear_shapes(chunk),
        last_grad=last_grad,
        named=tuple((names[id(q)], q) for q in ordered),
    )
