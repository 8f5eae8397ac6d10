"""model.compile: every transformer layer and every loss head (output layer + vocab-parallel
cross-entropy) compiled as its own torch.compile region, as TorchTitan compiles per block, so
compile time does not grow with depth (the layers share TransformerLayer.forward's code, so a
stack of like layers compiles once) and hooks keep seeing the same modules: only the bound
`forward` (and the chunk's `loss`) is replaced, the module objects, their names, parameters and
hooks are unchanged (FSDP2's and ZeRO's hooks run eagerly around the region).

What runs eagerly inside a compiled layer, on purpose (each a graph break, counted):
- the MoE block (`MoELayer.forward`): the dispatcher's token counts are data (the all-to-all's
  split sizes come from `.tolist()`, the grouped GEMM's per-expert rows too), so it is
  excluded rather than marked dynamic, which would recompile per routing pattern;
- ring attention (cp_comm_type p2p / a2a+p2p): its batched isend/irecv are not traceable;
- the parallel linears under a schedule that splits B and W (zero-bubble): the deferred wgrad
  closures are Python state captured at forward, which a compiled backward cannot queue.
Everything else (TP/SP collectives, Ulysses' all-to-all, the loss's all-reduces) is traced as
functional collectives (parallel/compiled_comm.py), and our Triton kernels give way to
inductor inside a region (kernels/dispatch.py).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megatron_lite.models.transformer import AttentionCore
from megatron_lite.moe.layer import MoELayer

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _eager(fn, reason: str):
    """`fn` run eagerly when a compiled region calls it (a graph break, reported with
    `reason`; torch < 2.8 has no reason argument)."""
    try:
        return torch.compiler.disable(fn, recursive=True, reason=reason)
    except TypeError:
        return torch.compiler.disable(fn, recursive=True)


def _exclude(layer: nn.Module, split_wgrad: bool) -> None:
    """Mark the parts of `layer` a region runs eagerly (module docstring)."""
    for m in layer.modules():
        if isinstance(m, MoELayer):
            m.forward = _eager(m.forward, "MoE block runs eagerly: data-dependent token counts")
        elif isinstance(m, AttentionCore) and m.ring_ranges is not None:
            m.attention_over_cp = _eager(m.attention_over_cp, "ring attention runs eagerly")
        elif split_wgrad and hasattr(m, "wgrad_queue"):
            m.forward = _eager(m.forward, "parallel linear runs eagerly: deferred wgrad")


def compile_chunks(chunks: list[nn.Module], mode: str | None, split_wgrad: bool) -> int:
    """Compile each layer's forward and each loss chunk's `loss` in place (lazily: the first
    call traces); mode: torch.compile's (None: inductor's default); split_wgrad: the pipeline
    schedule defers weight gradients (zero-bubble). Returns the number of regions."""
    kw = {} if mode in (None, "default") else {"mode": mode}
    regions = 0
    for chunk in chunks:
        for layer in chunk.layers.values():
            _exclude(layer, split_wgrad)
            layer.forward = torch.compile(layer.forward, **kw)
            layer.compiled_region = True  # the data-parallel wrapper's gather waits: ddp.py
            regions += 1
        if chunk.post_process:
            _exclude(chunk.output_layer, split_wgrad)
            chunk.loss = torch.compile(chunk.loss, **kw)
            regions += 1
    return regions


@dataclasses.dataclass
class CompileReport:
    """What dynamo did so far in this process: graphs compiled, graph breaks (reason -> count),
    recompiles (guard failures) and the frames it compiled."""

    graphs: int
    graph_breaks: dict[str, int]
    recompiles: int
    frames: int

    def lines(self) -> list[str]:
        """Human-readable summary for the trainer's log."""
        out = [
            f"compile: {self.graphs} graphs, {sum(self.graph_breaks.values())} graph breaks, "
            f"{self.recompiles} recompiles"
        ]
        for reason, n in sorted(self.graph_breaks.items(), key=lambda kv: -kv[1]):
            out.append(f"compile: graph break x{n}: {_summary(reason)}")
        return out


def _summary(reason: str) -> str:
    """What a dynamo graph-break message says broke: the disable() reason where one was given,
    else its first line."""
    if "(reason: " in reason:  # ours: "... disable` (reason: <what runs eagerly>)"
        return reason.split("(reason: ", 1)[1].split(")", 1)[0]
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    return (lines[0] if lines else "?")[:160]


def compile_report() -> CompileReport:
    """The counters of torch._dynamo.utils (the one private API this reads, here only)."""
    from torch._dynamo import utils

    c = utils.counters
    breaks = {str(k): int(v) for k, v in c["graph_break"].items()}
    recompiles = sum(len(v) for v in utils.guard_failures.values())
    return CompileReport(
        int(c["stats"]["unique_graphs"]), breaks, recompiles, int(c["frames"]["total"])
    )
