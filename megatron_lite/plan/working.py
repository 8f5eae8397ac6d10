"""Working sets: what a layer's forward or backward holds for a moment beyond what it saves for
backward (plan/activations.py), at the moments a pipeline rank's memory can peak — measured,
not typed: the real layer runs forward and backward on plan/saved.py's fake stage at the
layout's local shapes under plan/layer_trace.py's sampling tracker (one run per key and micro
batch, the same run as the saved bytes'; fitted in the micro batch as they are).

- forward: the largest sample of the layer's forward (its input, what it has saved so far and
  what its ops hold at that moment) less all it saves: the walk adds its saved rows itself;
- backward: for each state of the gradient buffers (the parameter group and how many of its
  gradients have arrived: ZeRO-2's buckets follow it), the largest sample, as (working bytes,
  saved bytes freed by then, group, arrived, the index of the one arriving when its bucket is
  allocated in that state, else None), the tuples plan/peak.py's walk takes. Under ZeRO-0/1
  the buckets do not move and only the largest moment is kept; under ZeRO-3 (FSDP2: no
  main_grad) every gradient made so far is held too (and, in fp32, the GEMM's own beside it)
  until the layer's backward ends.

In a dry run the fake process group completes each collective at once, so a buffer handed to
an asynchronous collective is freed as soon as the code drops it (the reduce-scatter input of
fc1's input gradient); NCCL keeps it until the wait, a few T·h·A more on a GPU. The fake
tensors are the CPU's: an op whose CPU kernel keeps something else than the GPU's is counted
as the CPU keeps it (plan/saved.py).
"""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.plan.activations import LayerShape
from megatron_lite.plan.saved import layer_saves, layer_trace


def forward_working(cfg: Config, x: LayerShape, moe: bool = False) -> float:
    """Working bytes at a layer's forward peak beyond all it saves (module docstring)."""
    forward, _, _ = layer_trace(cfg, moe, x.kernels)
    return forward - sum(layer_saves(cfg, moe, x.kernels).values())


def backward_moments(cfg: Config, x: LayerShape, moe: bool = False,
                     accumulated: bool = False) -> list[tuple]:  # fmt: skip
    """(working bytes, saved bytes freed by then, gradient buffer (0 dense, 1 experts), how
    many of that buffer's parameters of the layer have their gradients in, the index of the
    one being added or None) at the moments a layer's backward can peak (module docstring);
    `accumulated`: ZeRO-3's unsharded gradients exist already (a later microbatch: each new
    gradient is added into them, the walk counts them in its grads term)."""
    _, states, zero3 = layer_trace(cfg, moe, x.kernels)
    zero = cfg.parallel.zero_stage
    if zero == 3:
        return [(*zero3[2:4], 0, 0, None)] if accumulated else [(*zero3[:2], 0, 0, None)]
    moments = [(w, freed, g, n, n if arriving else None)
               for (g, n), (w, freed, arriving) in states.items()]  # fmt: skip
    if zero == 2:
        return moments
    return [max(moments, key=lambda m: m[0] - m[1], default=(0.0, 0.0, 0, 0, None))]
