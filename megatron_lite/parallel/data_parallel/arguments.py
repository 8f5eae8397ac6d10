"""The argument checks of the public data-parallel API: `build_data_parallel`, `DataParallel`
and `FullyShardedDataParallel` run them first, before any mesh, group or shard is touched
(the rules themselves live in rules.py, shared with the config path). A bad argument raises
`DataParallelArgumentError` (a ValueError) naming the call, the argument, its value, the rule
and a fix."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from megatron_lite.parallel.data_parallel import rules
from megatron_lite.parallel.data_parallel.optimizer_spec import (
    NAMED_HYPERPARAMETERS,
    OptimizerSpec,
    hyperparameters,
    optimizer_names,
    resolve_optimizer,
)
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import meta_of


class DataParallelArgumentError(ValueError):
    """A bad argument of the data-parallel API; `arg` names it (e.g. "bucket_size")."""

    def __init__(self, where: str, arg: str, value: Any, rule: str, fix: str):
        self.arg = arg
        super().__init__(f"{where}: {arg}={_show(value)}: {rule}. Fix: {fix}.")


def _show(value: Any) -> str:
    """A short repr: modules by class name, at most ~100 characters."""
    if isinstance(value, torch.nn.Module):
        return f"<{type(value).__name__}>"
    if isinstance(value, list | tuple) and any(isinstance(v, torch.nn.Module) for v in value):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _require(where: str, arg: str, value: Any, problem: str | None, fix: str) -> None:
    if problem is not None:
        raise DataParallelArgumentError(where, arg, value, problem, fix)


def _reduce_fix(value: Any) -> str:
    named = rules.REDUCE_DTYPES.get(value) if isinstance(value, str) else None
    return f"pass {named}" if named is not None else "pass torch.float32 or torch.bfloat16"


# argument -> (rule, fix); betas, weight_decay, dp_shard and the chunks need more than a value
_VALUE_RULES: dict[str, tuple[Callable[[Any], str | None], str | Callable[[Any], str]]] = {
    "zero_stage": (rules.zero_stage, "pass zero_stage=0, 1, 2 or 3"),
    "lr": (rules.positive_fp32, "pass e.g. lr=3e-4"),
    "eps": (rules.positive_fp32, "pass e.g. eps=1e-8"),
    "bucket_size": (rules.bucket_size, "pass e.g. bucket_size=40_000_000 (Megatron's default)"),
    "grad_reduce_dtype": (rules.reduce_dtype, _reduce_fix),
    "reduce_dtype": (rules.reduce_dtype, _reduce_fix),
    "param_dtype": (rules.weight_dtype, "pass torch.float32 or torch.bfloat16"),
    "dp_shard": (rules.dp_shard_value, "pass a divisor of the data-parallel group, or None"),
    "offload": (rules.offload_value, 'pass offload=False, "cpu" or "nvme"'),
    "nvme_buffer_mb": (rules.nvme_buffer_mb, "pass e.g. nvme_buffer_mb=1024"),
    **{
        name: (rules.flag, f"pass {name}=True or {name}=False")
        for name in (
            "overlap_grad_reduce",
            "overlap_param_gather",
            "reshard_after_forward",
            "tie_embeddings",
        )
    },
}


def check_arguments(where: str, chunks, mesh, args: dict[str, Any]) -> None:
    """Every rule on the keyword arguments `args` (by their API names; those a call does not
    take are absent), then on `chunks`, then on `mesh` and what depends on it. Reads the
    parameters' dtype, device and metadata and the mesh's sizes only: no tensor is created,
    no group used."""
    check_values(where, args)
    check_chunks(where, chunks)
    if "zero_stage" in args:
        check_meta(where, chunks, args["zero_stage"])
    if "device" in args:
        _check_device(where, args["device"], chunks)
    _require(
        where,
        "mesh",
        mesh,
        None if isinstance(mesh, ParallelMesh) else "must be a ParallelMesh",
        "build one with ParallelMesh(RankLayout(world_size, tp=..., pp=...)) after "
        "torch.distributed.init_process_group",
    )
    _check_dp_shard(where, args.get("dp_shard"), chunks, mesh)
    _check_tied(where, args.get("tie_embeddings", False), chunks, mesh)


def check_values(where: str, args: dict[str, Any]) -> None:
    """The rules on the arguments' values alone and with each other (no chunks, no mesh)."""
    for name, value in args.items():
        if name in _VALUE_RULES and not (name == "eps" and value is None):  # None: the default
            problem, fix = _VALUE_RULES[name]
            fix = fix if isinstance(fix, str) else fix(value)
            _require(where, name, value, problem(value), fix)
    if "optimizer" in args:
        check_optimizer(where, args)
    if args.get("betas") is not None:
        _check_betas(where, args["betas"])
    if "weight_decay" in args:
        wd = args["weight_decay"]
        fix = "pass e.g. weight_decay=0.1 (0 for none), with lr·weight_decay < 1"
        _require(where, "weight_decay", wd, rules.weight_decay(wd, args.get("lr")), fix)
    if "layers_of" in args:
        f = args["layers_of"]
        _require(
            where,
            "layers_of",
            f,
            None if f is None or callable(f) else "must be a callable: chunk -> its layers",
            "pass e.g. layers_of=lambda chunk: chunk.blocks, or None for chunk.layers.values()",
        )
    stage, offload, dp_shard = (args.get(k) for k in ("zero_stage", "offload", "dp_shard"))
    fix = "pass offload=False, or zero_stage=1 or 2"
    _require(where, "offload", offload, rules.offload(offload, stage), fix)
    if "offload" in args and rules.offload_kind(offload) == "nvme":
        path = args.get("nvme_path")
        fix = "pass nvme_path= an existing writable directory on a fast local disk"
        _require(where, "nvme_path", path, rules.nvme_path(path), fix)
    fix = "pass zero_stage=1, 2 or 3, or dp_shard=None"
    _require(where, "dp_shard", dp_shard, rules.dp_shard_stage(dp_shard, stage), fix)


def check_optimizer(where: str, args: dict[str, Any]) -> None:
    """`optimizer` is an OptimizerSpec or a registered name; the hyperparameters passed are
    the spec's (betas, eps: when not None; weight_decay: when not 0; `optimizer_args`: the
    others) and in the spec's ranges (`OptimizerSpec.check`); a spec needing whole matrices
    runs without offload."""
    opt = args["optimizer"]
    named = isinstance(opt, str) and opt in optimizer_names()
    ok = isinstance(opt, OptimizerSpec) or named
    fix = f"pass one of {optimizer_names()} or an OptimizerSpec (register_optimizer adds one)"
    _require(where, "optimizer", opt, None if ok else "is not a registered optimizer", fix)
    spec = resolve_optimizer(opt)
    extra = args.get("optimizer_args") or {}
    fix = f"pass a dict of {spec.name!r}'s hyperparameters, e.g. {dict(spec.hyperparameters)}"
    ok = isinstance(extra, dict) and all(isinstance(k, str) for k in extra)
    _require(where, "optimizer_args", extra, None if ok else "must be a dict by name", fix)
    for name in set(extra) & set(NAMED_HYPERPARAMETERS):
        _require(where, "optimizer_args", extra, f"holds {name!r}", f"pass {name}= instead")
    for name, value in _given(args).items():
        if name not in spec.hyperparameters:
            _require(
                where, name if name in args else "optimizer_args", value,
                f"optimizer {spec.name!r} has no hyperparameter {name!r} (its own: "
                f"{sorted(spec.hyperparameters)})",
                f"leave {name} out, or pass optimizer= one that has it",
            )  # fmt: skip
    if spec.check is not None:
        try:
            spec.check({**spec.hyperparameters, **_given(args)})
        except ValueError as e:
            _require(where, "optimizer_args", extra, str(e), "pass a value in its range")
    fp32 = all(st.dtype == torch.float32 for st in spec.states)
    if rules.offload_kind(args.get("offload", False)) == "nvme" and not fp32:
        _require(
            where, "offload", args["offload"],
            f"NVMe offload swaps fp32 states; optimizer {spec.name!r} has others",
            'pass offload="cpu" or False',
        )  # fmt: skip
    if not spec.elementwise:  # whole_matrix.py assigns whole parameters to owner ranks
        value = args.get("offload", False)
        used = rules.offload_kind(value) != "none"
        _require(
            where, "offload", value,
            f"optimizer {spec.name!r} needs whole matrices: their owners step them on the "
            "device, without optimizer offload" if used else None,
            "pass offload=False",
        )  # fmt: skip


def check_nvme_buffer(where: str, mb: int, sizes: list[int], buffer_bytes: int) -> None:
    """NVMe offload at build time (the pieces are known): the host buffer holds the largest
    piece's master and states (`sizes`: each piece's bytes, nvme.swapped_bytes)."""
    from megatron_lite.parallel.data_parallel.nvme import largest_piece_problem

    need = -(-max(sizes, default=0) // 2**20)
    _require(
        where, "nvme_buffer_mb", mb, largest_piece_problem(sizes, buffer_bytes),
        f"pass nvme_buffer_mb >= {need} (train.nvme_buffer_mb; twice that lets the next piece "
        "read while this one steps), or shard the states further (a larger dp, zero_stage >= 1)",
    )  # fmt: skip


def _given(args: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters a call passes: lr; betas, eps unless None; weight_decay unless 0;
    optimizer_args."""
    out = {"lr": args["lr"]} if "lr" in args else {}
    out.update({k: args[k] for k in ("betas", "eps") if args.get(k) is not None})
    if args.get("weight_decay", 0.0) != 0.0:
        out["weight_decay"] = args["weight_decay"]
    return {**out, **(args.get("optimizer_args") or {})}


def optimizer_settings(args: dict[str, Any]) -> tuple[OptimizerSpec, dict[str, Any]]:
    """(spec, its hyperparameters) of checked arguments (`check_optimizer`)."""
    spec = resolve_optimizer(args["optimizer"])
    return spec, hyperparameters(spec, _given(args))


def _check_betas(where: str, betas) -> None:
    fix = "pass e.g. betas=(0.9, 0.95)"
    _require(where, "betas", betas, rules.betas_pair(betas), fix)
    for i, b in enumerate(betas):
        _require(where, f"betas[{i}]", b, rules.beta(b), fix)


def check_chunks(where: str, chunks) -> None:
    """A list of distinct modules holding trainable parameters of one dtype the weights may
    compute in (fp32 or bf16), and no integer parameters (FSDP2 would cast them)."""
    fix = "pass a list of the model's chunks, e.g. [model] (one per virtual pipeline stage)"
    ok = isinstance(chunks, Sequence) and not isinstance(chunks, str | torch.nn.Module)
    _require(where, "chunks", chunks, None if ok else "must be a list of torch.nn.Module", fix)
    _require(where, "chunks", chunks, None if chunks else "must hold at least one chunk", fix)
    seen: dict[int, int] = {}
    for i, c in enumerate(chunks):
        if not isinstance(c, torch.nn.Module):
            _require(where, f"chunks[{i}]", c, f"is of type {type(c).__name__}, not a Module", fix)
        if id(c) in seen:
            _require(where, f"chunks[{i}]", c, f"is chunks[{seen[id(c)]}] again", "give it once")
        seen[id(c)] = i
        for name, p in c.named_parameters():
            if not p.is_floating_point():
                _require(
                    where,
                    f"chunks[{i}].{name}",
                    p.dtype,
                    "parameters must be floating point (stage 3 would cast this one to fp32)",
                    "keep integer state in a buffer (module.register_buffer)",
                )
    trainable: dict[torch.dtype, tuple[int, str]] = {}  # dtype -> its first parameter
    for i, c in enumerate(chunks):
        for n, p in c.named_parameters():
            if p.requires_grad:
                trainable.setdefault(p.dtype, (i, n))
    _require(where, "chunks", chunks, None if trainable else "have no trainable parameter", fix)
    _require(
        where,
        "chunks",
        chunks,
        None
        if len(trainable) == 1
        else f"the trainable parameters must share one dtype, got {sorted(map(str, trainable))}",
        "cast the model first, e.g. model.to(torch.bfloat16) (the optimizer keeps fp32 masters)",
    )
    dtype, (i, name) = next(iter(trainable.items()))
    _require(
        where,
        f"chunks[{i}].{name}.dtype",
        dtype,
        rules.weight_dtype(dtype),
        "cast the model to bf16 (model.to(torch.bfloat16)) or fp32 (model.float())",
    )


def check_layers(where: str, chunks, layers_of) -> list[list[torch.nn.Module]]:
    """Stage 3's units: `layers_of(chunk)` for each chunk, which must list distinct submodules
    of that chunk (not the chunk itself)."""
    fix = "make layers_of(chunk) return the chunk's transformer layers, e.g. chunk.blocks"
    out = []
    for i, chunk in enumerate(chunks):
        got = layers_of(chunk)
        arg = f"layers_of(chunks[{i}])"
        iterable = isinstance(got, Iterable) and not isinstance(got, str)  # ModuleList: yes
        _require(where, arg, got, None if iterable else "must return an iterable of modules", fix)
        layers, inside = list(got), {id(m) for m in chunk.modules() if m is not chunk}
        for j, layer in enumerate(layers):
            problem = _layer_problem(layer, chunk, inside, layers[:j])
            _require(where, arg, layers, problem and f"element {j} {problem}", fix)
        out.append(layers)
    return out


def _layer_problem(layer, chunk, inside: set[int], earlier: list) -> str | None:
    if not isinstance(layer, torch.nn.Module):
        return f"is of type {type(layer).__name__}, not a Module"
    if layer is chunk:
        return "is the chunk itself (its own unit anyway)"
    if id(layer) not in inside:
        return f"({type(layer).__name__}) is not a submodule of the chunk"
    if any(layer is other for other in earlier):
        return "is listed twice"
    return None


def check_meta(where: str, chunks, stage) -> None:
    """Only stage 3 shards chunks on the meta device before giving them storage."""
    if stage != 3 and any(p.is_meta for c in chunks for p in c.parameters()):
        _require(
            where,
            "chunks",
            chunks,
            f"zero_stage={stage} with chunks on the meta device: only stage 3 shards them "
            "before giving them storage",
            "give them storage first (params.materialize), or pass zero_stage=3 and device=",
        )


def weights_dtype(chunks) -> torch.dtype:
    """The one dtype of the trainable parameters (after `check_chunks`)."""
    return next(p.dtype for c in chunks for p in c.parameters() if p.requires_grad)


def _check_device(where: str, device, chunks) -> None:
    """None, or a device torch knows that has storage; where the chunks have storage already
    it must be theirs (it only gives meta-device chunks their shards' storage)."""
    fix = "pass device='cuda' or 'cpu' (or None)"
    if device is None:
        return
    ok = isinstance(device, str | torch.device)
    _require(where, "device", device, None if ok else "must be a str or torch.device", fix)
    try:
        parsed = torch.device(device)
    except RuntimeError as e:
        _require(where, "device", device, f"is not a device torch knows ({e})", fix)
    meta = parsed.type == "meta"
    _require(where, "device", device, "must have storage, not meta" if meta else None, fix)
    have = {p.device.type for c in chunks for p in c.parameters() if not p.is_meta}
    _require(
        where,
        "device",
        device,
        None
        if have <= {parsed.type}
        else f"the chunks are on {sorted(have)} already; device "
        "only gives chunks on the meta device their shards' storage",
        f"move the chunks yourself (model.to({str(parsed)!r})) or pass device=None",
    )


def _check_dp_shard(where: str, dp_shard, chunks, mesh: ParallelMesh) -> None:
    experts = any(meta_of(p).is_expert for c in chunks for p in c.parameters())
    groups = {f"the {n} group": getattr(mesh, n).size for n in ("dp_cp", "edp")[: 1 + experts]}
    problem = rules.dp_shard_divides(dp_shard, groups)
    _require(where, "dp_shard", dp_shard, problem, "pass a divisor of it, or None")


def _check_tied(where: str, tie: bool, chunks, mesh: ParallelMesh) -> None:
    """With pp > 1 the input embedding (`embedding.weight` of the first stage's chunk) and its
    last-stage copy (marked tied_copy) are summed over the embedding group: what this rank can
    see of that is checked (the copy's rank depends on the schedule's placement)."""
    if mesh.pp.size == 1:
        return
    names = [[n for n, _ in c.named_parameters()] for c in chunks]
    copies = [n for c in chunks for n, p in c.named_parameters() if meta_of(p).tied_copy]
    if not tie:
        _require(
            where,
            "tie_embeddings",
            tie,
            f"parameter {copies[0]!r} is marked tied_copy, whose gradient then is never summed "
            "with the input embedding's"
            if copies
            else None,
            "pass tie_embeddings=True, or build the output layer without tied_copy",
        )
        return
    first = mesh.pp.rank == 0 and "embedding.weight" not in names[0]
    _require(
        where,
        "tie_embeddings",
        tie,
        f"with pp={mesh.pp.size} the first stage's chunk needs the input embedding as a "
        "parameter named 'embedding.weight'"
        if first
        else None,
        "name the input embedding module `embedding`, or pass tie_embeddings=False",
    )
    embeddings = sum(n.count("embedding.weight") for n in names)
    _require(
        where,
        "tie_embeddings",
        tie,
        f"this rank holds {embeddings} 'embedding.weight' and {len(copies)} tied_copy "
        "parameters; at most one of each"
        if max(embeddings, len(copies)) > 1
        else None,
        "mark only the output layer's copy of the embedding with set_meta(..., tied_copy=True)",
    )
