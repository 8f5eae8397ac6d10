"""Architectures as registered records: one `ArchitectureSpec` per value of `model.arch` holds
everything the rest of the code knows of it (TorchTitan's `TrainSpec`): the parts of its layer
and how they are built, the layer class, the init rule of its output projections, its FLOPs per
token for MFU, its default MLP width, the Hugging Face families the converter maps it to, the
config keys it does not read, and its own config rules. The model builder, config validation
and resolve, the trainer's MFU and the converter read the record; `register_architecture` adds
one. The shipped records (llama, gpt) are registered by models/llama.py and models/gpt.py,
imported with the package.

`_ARCHITECTURES` is module-level mutable state: registries are the one allowed exception (a
register call at import time fills it; nothing else writes it).

Constructor contracts of the parts (each a class or a builder function):
- attention(config, mesh, tracker) -> module; forward(x [s(/tp), b, h], ctx: TokenContext) ->
  [s(/tp), b, h]. It declares its head dims as a classmethod `head_dims(config) -> HeadDims`
  (q/k and v widths per head, and how many of each q/k head's dims RoPE rotates: 0 = none;
  which ones is the part's: all of them for RotaryAttention, the last ones for MLA);
  the model chunk builds RoPE's tables at the rotary dim, context parallelism reads the q/k
  and v widths from the tensors it is handed.
- mlp(config, mesh) -> module; forward(x [s(/tp), b, h]) -> [s(/tp), b, h]: the dense MLP.
- moe(config, mesh, layer_number) -> module with the same forward, on the layers
  `config.moe_layer_pattern` marks (None: the architecture has no MoE layers).
- norm(size, eps, sequence_parallel) -> module; forward(x) -> norm(x), and forward(x,
  residual=r) -> (norm(x + r), x + r), which the default layer uses (parallel/norms.py).
- layer(config, mesh, tracker, layer_number) -> module; forward(x, ctx) -> x, built from the
  parts above (default: the pre-norm sequential residual `TransformerLayer`). Whoever builds
  a layer (the model chunk; the planner for one layer alone) calls
  models/transformer.build_layer, which builds the entry's.
`config` is the resolved `TransformerConfig` (its `spec` is this record), `mesh` the
`ParallelMesh` whose groups a part uses, `tracker` the RNG tracker (dropout, recompute).

Parameter initialization: every parameter is drawn layout-independently by
parallel/params.init_parameters from (seed, its name) with the std its part recorded in its
metadata (the parallel layers' `init_std`, or `set_meta`); the shipped parts use
`config.init_method_std` for input projections and `config.output_std` (this record's
`output_std` rule) for the residual branches' output projections.

Parts may be given as "module:attribute" strings, loaded on first use, so that config
validation and the planner read a record without loading the layers (torch.distributed's
DTensor, the kernels: ~1 s per process).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_lite.registry import Registry

__all__ = [
    "ArchitectureSpec", "FlopsPerToken", "HeadDims", "architecture_names", "get_architecture",
    "hf_architecture", "register_architecture", "unregister_architecture",
]  # fmt: skip

Part = Callable[..., Any] | str  # a class or builder, or "module:attribute" loaded on first use
PARTS = ("attention", "mlp", "moe", "norm", "layer")


@dataclass(frozen=True)
class HeadDims:
    """What an attention part declares of its heads: q/k width, v width, rotary width."""

    qk: int  # width of each query and key head (the scores' dot product)
    v: int  # width of each value head (and of the attention output per head)
    rotary: int  # dims of each q/k head RoPE rotates (the tables' width): 0 = no RoPE


@dataclass(frozen=True)
class FlopsPerToken:
    """Model FLOPs of one token, forward + backward (the MFU convention, training/flops.py):
    6·matmul_params + attention."""

    matmul_params: float  # N_active: weights each token multiplies in one forward
    attention: float  # the scores and weighted sums over the keys, forward + backward

    @property
    def total(self) -> float:
        return 6.0 * self.matmul_params + self.attention


@dataclass(frozen=True)
class ArchitectureSpec:
    """One architecture (the value of `model.arch`); the parts' contracts are the module
    docstring's.

    ffn_hidden_size(hidden_size): the dense MLP width when model.ffn_hidden_size is null.
    output_std(init_method_std, num_layers): the std of the residual branches' output
    projections (None: Megatron's std / sqrt(2L), parallel/params.scaled_std).
    flops(model, vocab_size) -> FlopsPerToken: per token, model a `ModelConfig` (resolve's
    functions give its derived sizes), vocab_size the unpadded vocabulary.
    validate(cfg): the architecture's own config rules on the resolved `Config`, run by
    validation after the model ranges; raises `ConfigError` naming key, value, rule and fix.
    unused_keys: (model key, why, fix) of keys this architecture never reads: a value other
    than the default is warned about as having no effect.
    learned_positions: a learned absolute position table on the first stage (GPT).
    bias, gated_mlp: options of the shipped parts (biases in every linear layer; SwiGLU or
    GeLU in the MLP and the experts). hf_families: the Hugging Face model types
    tools/convert_checkpoint.py converts this architecture to and from (empty: none).
    """

    name: str
    attention: Part
    mlp: Part
    norm: Part
    ffn_hidden_size: Callable[[int], int]
    flops: Callable[[Any, int], FlopsPerToken]
    moe: Part | None = None
    layer: Part = "megatron_lite.models.transformer:TransformerLayer"
    output_std: Callable[[float, int], float] | None = None
    validate: Callable[[Any], None] | None = None
    unused_keys: tuple[tuple[str, str, str], ...] = ()
    learned_positions: bool = False
    bias: bool = False
    gated_mlp: bool = True
    hf_families: tuple[str, ...] = ()

    def part(self, name: str) -> Callable[..., Any]:
        """The class or builder of part `name` (one of PARTS), loaded if given by name."""
        if name not in PARTS:
            raise ValueError(f"architecture part {name!r} is not one of {PARTS}")
        ref = getattr(self, name)
        if ref is None:
            raise ValueError(f"architecture {self.name!r} has no {name} part")
        return _load(ref) if isinstance(ref, str) else ref

    def head_dims(self, config: Any) -> HeadDims:
        """The attention part's head dims for the resolved `config`."""
        return self.part("attention").head_dims(config)


@functools.cache
def _load(ref: str) -> Any:
    module, sep, attribute = ref.partition(":")
    if not sep:
        raise ValueError(f"architecture part {ref!r}: give 'module:attribute'")
    obj = importlib.import_module(module)
    for name in attribute.split("."):
        obj = getattr(obj, name)
    return obj


_ARCHITECTURES: Registry[ArchitectureSpec] = Registry("architecture")


def register_architecture(spec: ArchitectureSpec) -> ArchitectureSpec:
    """Add an architecture under `spec.name` (a name taken is an error); returns the spec."""
    return _ARCHITECTURES.add(spec)


def unregister_architecture(name: str) -> None:
    """Remove a registered architecture (tests that register a toy one)."""
    _ARCHITECTURES.remove(name)


def architecture_names() -> tuple[str, ...]:
    """The registered architectures, in registration order."""
    return _ARCHITECTURES.names()


def get_architecture(name: str) -> ArchitectureSpec:
    """The record of `name`; a ValueError names model.arch, the value and the registered
    ones."""
    spec = _ARCHITECTURES.get(name)
    if spec is None:
        raise ValueError(
            f"model.arch={name!r}: not a registered architecture (registered: "
            f"{', '.join(_ARCHITECTURES.names())}). Fix: use one of them, or register it with "
            "megatron_lite.models.registry.register_architecture"
        )
    return spec


def hf_architecture(family: str) -> str | None:
    """The registered architecture whose `hf_families` holds the HF model type `family`."""
    return next((s.name for s in _ARCHITECTURES if family in s.hf_families), None)
