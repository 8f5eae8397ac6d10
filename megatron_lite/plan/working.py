"""Working sets: what a layer's forward or backward holds for a moment beyond what it saves for
backward (plan/activations.py), at the moments a pipeline rank's memory can peak.

Derived from the code as a dry run runs it (models/transformer.py, parallel/linear_async.py,
parallel/mappings.py, moe/, the fused kernels), per microbatch on one rank, same notation as
plan/activations.py (T = (s/cp)·b tokens, u = 1/tp under sequence parallelism, A the compute
dtype's bytes, f the MLP width, N the MoE rows a rank sends and receives):

- forward, at fc2's reduction (a layer's forward peak): the attention's output T·u·h·A (alive
  to the end of the layer's forward), fc1's output 2·T·f/tp·A (SwiGLU's gate and up are views
  of it, alive to the end of the MLP's forward), fc2's output T·h·A and its reduction's output
  (SP: the reduce-scattered T·h·A/tp; TP without SP: the all-reduced copy T·h·A);
- backward, at fc2's weight gradient (the layer's first GEMMs): the MLP output's gradient (SP:
  all-gathered, T·h·A), fc2's input gradient T·f/tp·A and its weight gradient h·f/tp·A;
- backward, at SwiGLU's: fc2's input gradient and SwiGLU's two, 3·T·f/tp·A, fc2's saved
  input freed and its weight gradient added into its bucket (ZeRO-2: allocated by then);
- backward, at fc1's weight gradient: its output gradient 2·T·f/tp·A, SP: the re-gathered
  input T·h·A and the input gradient's reduce-scattered shard T·h·A/tp (else the input
  gradient T·h·A), and its weight gradient 2·f/tp·h·A; fc2's and SwiGLU's saved inputs
  (3·T·f/tp·A) freed;
- MoE forward (E_l = E/ep local experts of N/E_l rows each), the larger of: at the cat of the
  expert outputs, the attention's output and the MoE input (2·T·u·h·A), the last expert's fc1
  output 2·(N/E_l)·f·A, and the expert outputs and their cat (2·N·h·A) where the combine's
  saved rows (2·N·h·A) are not made yet; at the combine's sum, those two, the expert output
  and its reordered copy (2·N·h·A) and the [T·u, h] zeros and sum (2·T·u·h·A);
- MoE backward, the larger of: the combine's gradients, 3·N·h·A (its saved product N·h·A
  freed); the last expert's SwiGLU backward, 3·(N/E_l)·f·A, and with E_l > 1 the other experts'
  output gradients N·h·A and the stacked fc2 weight gradient E_l·h·f·A (the combine's saved
  2·N·h·A and that expert's fc2 input freed);
- loss backward (the last stage): the fp32 gradient of the logits [T, V/tp] beside the saved
  logits (torch kernels: also exp of them), plan/activations.py head_terms.

With gradient buffers (ZeRO 0-2) a dense layer's weight gradient goes into main_grad inside
the linear's backward (parallel/linear_async.py): ZeRO-2 allocates the bucket first, then the
GEMM adds into it (fp32: `addmm_` in place, no temporary; bf16: the bf16 product, then the
add; autograd gets the buffer's zero-stride placeholder, one 0-dim element per buffer, as the
weight's gradient), while the layer's output gradient, input gradient and re-gathered input are
alive. Under ZeRO-3 (FSDP2, no main_grad) the weight gradient is returned to autograd and the
moments are those listed above.

In a dry run the fake process group completes each collective at once, so a buffer handed to
an asynchronous collective is freed as soon as the code drops it (the reduce-scatter input of
fc1's input gradient); NCCL keeps it until the wait, a few T·h·A more on a GPU.
"""

from __future__ import annotations

from megatron_lite.plan.activations import LayerShape, moe_assignments


def _reduction(x: LayerShape) -> float:
    """A row-parallel layer's reduced output: SP reduce-scatter [s/tp], TP all-reduce of a
    copy (mappings._ReduceFromRegion clones), nothing on one rank."""
    T, h, A = x.tokens, x.h, x.act_bytes
    if x.tp == 1:
        return 0.0
    return T * h * A / x.tp if x.sp else T * h * A


def forward_working(x: LayerShape, moe: bool = False) -> float:
    """Working bytes at a layer's forward peak (see the module docstring)."""
    T, h, A, t, u = x.tokens, x.h, x.act_bytes, x.tp, x.u
    attn = T * u * h * A  # the attention's output, alive to the end of the layer's forward
    if moe:
        n = moe_assignments(x)
        rows = n * x.ep / x.experts  # one local expert's
        experts = attn + T * u * h * A + 2 * rows * x.moe_f * A  # (+ 2·N·h·A - 2·N·h·A)
        combine = attn + T * u * h * A + 2 * n * h * A + 2 * T * u * h * A
        return max(experts, combine)
    fc1_out = (2 if x.gated else 0) * T * x.f / t * A  # GeLU saves it (the act term)
    return attn + fc1_out + T * h * A + _reduction(x)


def backward_moments(x: LayerShape, moe: bool = False) -> list[tuple]:
    """(working bytes, saved bytes freed by then, gradient buffer (0 dense, 1 experts), how
    many of the layer's parameters have their gradients in its buckets, the index of the one
    being added or None) at the moments a layer's backward can peak, its own saved
    activations all alive before the first; parameters in backward order (see the module
    docstring)."""
    T, h, A, t, f = x.tokens, x.h, x.act_bytes, x.tp, x.f
    if moe:  # the combine's gradients; the last local expert's SwiGLU backward
        n = moe_assignments(x)
        rows, local = n * x.ep / x.experts, x.experts // x.ep
        freed = 2 * n * h * A + rows * x.moe_f * A  # the combine's, the expert's fc2 input
        combine = (3 * n * h * A, n * h * A, 1, 0, None)
        swiglu = 3 * rows * x.moe_f * A  # fc2's input gradient, SwiGLU's two
        if local > 1:  # the other experts' output gradients and the stacked fc2 gradient
            return [combine, (swiglu + n * h * A + local * h * x.moe_f * A, freed, 1, 0, None)]
        # one local expert: its fc2 gradient reaches the bucket before SwiGLU's backward
        fc2 = (rows * x.moe_f * A + h * x.moe_f * A, freed, 1, 0, 0)
        return [combine, fc2, (swiglu, freed, 1, 1, None)]
    sp = x.sp and t > 1
    cast = x.residual_bytes != A  # the residual stream's gradient cast to the branch's dtype
    g_out = T * h * A if sp or cast else 0.0
    up = 2 if x.gated else 1
    fc2_in, act, fc1_in = T * f / t * A, up * T * f / t * A, T * h * A / (t if sp else 1)
    fc2_w, fc1_w = h * f / t * A, up * f / t * h * A  # weight gradients (bf16 in bf16)
    in_grad = T * h * A / t if sp else T * h * A  # fc1's input gradient (SP: its shard)
    swiglu = ((up + 1) * T * f / t * A if x.gated else 2 * T * f / t * A, fc2_in, 0, 1, None)
    if x.main_grad:  # fused into main_grad; fp32: no temporary (module docstring)
        own = 0.0 if A == 4 else 1.0
        return [
            (g_out + T * f / t * A + own * fc2_w, 0.0, 0, 0, 0),  # fc2's, into its bucket
            swiglu,
            (act + (T * h * A if sp else 0.0) + in_grad + own * fc1_w, fc2_in + act, 0, 1, 1),
        ]
    return [
        (g_out + T * f / t * A + fc2_w, 0.0, 0, 0, None),  # fc2's weight gradient
        (T * f / t * A + fc2_w, fc2_in, 0, 0, 0),  # it goes into its bucket
        swiglu,
        (act + (T * h * A if sp else 0.0) + in_grad + fc1_w, fc2_in + act, 0, 1, None),
        (in_grad + fc1_w, fc2_in + act + fc1_in, 0, 1, 1),  # fc1's into its bucket
    ]
