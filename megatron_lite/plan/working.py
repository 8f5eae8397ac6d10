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
- MoE forward (E_l = E/ep local experts, N rows in all), the larger of: at SwiGLU (grouped
  GEMM, the default), the attention's output and the MoE input (2·T·u·h·A) and every expert's
  fc1 output at once 2·N·f·A, the combine's saved rows (2·N·h·A) not made yet; with the loop,
  at the cat of the expert outputs, those two, the last expert's fc1 output 2·(N/E_l)·f·A, and
  the expert outputs and their cat (2·N·h·A) where the combine's saved rows are not made yet;
  at the combine's sum, those two, the expert output and its reordered copy (2·N·h·A) and the
  [T·u, h] zeros and sum (2·T·u·h·A); with a shared expert (width f_s, run after the combine:
  its saved terms are not made at those moments), also its dense-MLP forward moment beside the
  routed output T·u·h·A;
- MoE backward: first the shared expert's (a dense MLP's moments; its input gradient T·u·h·A
  then stays alive through the rest), then the combine's gradients, 3·N·h·A (its saved product
  N·h·A freed); grouped GEMM: fc2's input and stacked weight gradients with its output's
  (N·h·A + N·f·A + E_l·h·f·A), the weight gradient into its bucket, SwiGLU's (3·N·f·A), the
  [gate, up] gradient (4·N·f·A, SwiGLU's saved inputs freed), fc1's input and stacked weight
  gradients with its output's (2·N·f·A + N·h·A + 2·E_l·h·f·A) and that weight gradient into
  its bucket; the loop: the last expert's SwiGLU backward, 3·(N/E_l)·f·A, and with E_l > 1 the
  other experts' output gradients N·h·A and the stacked fc2 weight gradient E_l·h·f·A (the
  combine's saved 2·N·h·A and that expert's fc2 input freed);
- ring attention's backward (ring > 1, dense layers; context/ring.py), its largest moment: a
  sub-block's three fp32 score-sized tensors at once (probabilities, dO·Vᵀ minus delta, dS),
  3·b·(n/(tp·a2a))·c²·4 and its causal bool mask c² with c = min(s/(2·ring),
  ring.tile_size) (a chunk, cut into runs of at most that), beside the output's gradient T·n·d/tp·A,
  dQ 4·T·n·d/tp, the K/V block and its receive 2·E·A, dK/dV and the dK/dV message and its
  receive 3·4·E (E = T·a2a·2·g_r·d K/V elements of the ring rank, g_r its KV heads), and in
  bf16 the fp32 copies of q, dO (2·4·T·n·d/tp) and K/V (4·E); the layer's MLP and proj inputs
  freed by then. Its forward holds the same three score tensors with fewer copies and the
  layer's MLP not yet made, so the backward is the larger;
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

from dataclasses import replace

from megatron_lite.context.ring import tile_size
from megatron_lite.plan.activations import MLP, LayerShape, moe_assignments
from megatron_lite.plan.saved import subtree

SHARED = MLP + ".shared_expert"  # the MoE layer's shared expert (moe/layer.py)
Rows = dict[str, float]  # {module path: bytes} the layer saves (plan/saved.py)


def _reduction(x: LayerShape) -> float:
    """A row-parallel layer's reduced output: SP reduce-scatter [s/tp], TP all-reduce of a
    copy (mappings._ReduceFromRegion clones), nothing on one rank."""
    T, h, A = x.tokens, x.h, x.act_bytes
    if x.tp == 1:
        return 0.0
    return T * h * A / x.tp if x.sp else T * h * A


def forward_working(x: LayerShape, moe: bool = False, rows: Rows | None = None) -> float:
    """Working bytes at a layer's forward peak (see the module docstring); `rows` the layer's
    measured saves (an MoE layer's: its shared expert's are made last)."""
    T, h, A, t, u = x.tokens, x.h, x.act_bytes, x.tp, x.u
    attn = T * u * h * A  # the attention's output, alive to the end of the layer's forward
    if moe:
        n, f = moe_assignments(x), x.moe_f
        combine = attn + T * u * h * A + 2 * n * h * A + 2 * T * u * h * A
        if x.grouped_gemm:  # every expert's fc1 output at once, the combine's not made yet
            experts = attn + T * u * h * A + (2 * n * f * A if x.gated else 0) - 2 * n * h * A
        else:
            rows = n * x.ep / x.experts  # one local expert's
            experts = attn + T * u * h * A + 2 * rows * f * A  # (+ 2·N·h·A - 2·N·h·A)
        if not x.shared_f:
            return max(experts, combine)
        # the shared expert runs after the combine: its saved terms are not made before; then
        # the routed output beside a dense MLP's forward moment
        later = _shared_saves(x, rows or {})
        shared = forward_working(replace(x, f=x.shared_f)) + T * u * h * A
        return max(experts - later, combine - later, shared)
    fc1_out = (2 if x.gated else 0) * T * x.f / t * A  # GeLU saves it (the act term)
    return attn + fc1_out + T * h * A + _reduction(x)


def _shared_saves(x: LayerShape, rows: Rows) -> float:
    """What the shared expert saves first (its fc1's input, the MoE input, is the router's
    fp32 copy's storage in fp32 training: not its own row then)."""
    return subtree(rows, SHARED) if x.shared_f else 0.0


def backward_moments(x: LayerShape, moe: bool = False, rows: Rows | None = None) -> list[tuple]:
    """(working bytes, saved bytes freed by then, gradient buffer (0 dense, 1 experts), how
    many of the layer's parameters have their gradients in its buckets, the index of the one
    being added or None) at the moments a layer's backward can peak, its own saved
    activations all alive before the first; parameters in backward order (see the module
    docstring)."""
    if moe:
        return _moe_backward_moments(x, rows or {})
    ring = ring_backward_moment(x, rows or {})
    return _dense_backward_moments(x) + ([ring] if ring else [])


def _dense_backward_moments(x: LayerShape) -> list[tuple]:
    T, h, A, t, f = x.tokens, x.h, x.act_bytes, x.tp, x.f
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


def ring_backward_moment(x: LayerShape, rows: Rows) -> tuple | None:
    """The ring attention's backward moment (module docstring), as backward_moments' tuples,
    or None without a ring."""
    if x.ring == 1:
        return None
    T, A, t, d, a2a = x.tokens, x.act_bytes, x.tp, x.d, x.a2a
    c = min(x.s / (2 * x.ring), tile_size(x.b, x.n // (t * a2a)))
    scores = 3 * x.b * x.n / (t * a2a) * c * c * 4 + c * c  # and the causal mask
    g_r = max(x.g // t, a2a) // a2a if a2a > 1 else x.g // t
    e, q = T * a2a * 2 * g_r * d, T * x.n * d / t  # K/V elements of the block, q's
    copies = 0.0 if A == 4 else 2 * 4 * q + 4 * e
    w = scores + q * A + 4 * q + 2 * e * A + 3 * 4 * e + copies
    # freed by then: the MLP's saves, the output projection's input, the pre-MLP norm's
    freed = sum(subtree(rows, k) for k in (MLP, "self_attention.linear_proj", "pre_mlp_norm"))
    return (w, freed, 0, 2, None)


def _moe_backward_moments(x: LayerShape, rows: Rows) -> list[tuple]:
    """An MoE layer's backward moments: the shared expert's first (a dense MLP's, created
    last), its saved terms then freed and its input gradient alive; the combine's gradients;
    then the experts' (grouped GEMM: all at once; the loop: the last local expert's)."""
    T, h, A, u = x.tokens, x.h, x.act_bytes, x.u
    out: list[tuple] = []
    freed_shared, held = 0.0, 0.0
    if x.shared_f:
        shared = replace(x, f=x.shared_f)
        out = backward_moments(shared)
        freed_shared = _shared_saves(x, rows)
        out = [(w, min(fr, freed_shared), g, a, i) for w, fr, g, a, i in out]
        held = T * u * h * A  # its input gradient, summed with the routed one's at the end
    routed = _routed_moments(x)
    return out + [(w + held, fr + freed_shared, g, a, i) for w, fr, g, a, i in routed]


def _routed_moments(x: LayerShape) -> list[tuple]:
    h, A, f = x.h, x.act_bytes, x.moe_f
    n, local = moe_assignments(x), x.experts // x.ep
    combine = (3 * n * h * A, n * h * A, 1, 0, None)  # the combine's gradients
    if x.grouped_gemm:  # each projection's input and weight gradients at once
        up = 2 if x.gated else 1
        saved = 2 * n * h * A  # the combine's
        w2, w1 = local * h * f * A, up * local * h * f * A  # the stacked weight gradients
        return [
            combine,
            (n * h * A + n * f * A + w2, saved, 1, 0, None),  # fc2's
            (n * f * A + w2, saved + n * f * A, 1, 0, 0),  # its weight gradient into the bucket
            ((up + 1) * n * f * A, saved + n * f * A, 1, 1, None),  # SwiGLU's
            (2 * up * n * f * A, saved + (up + 1) * n * f * A, 1, 1, None),  # [gate, up] grad
            (up * n * f * A + n * h * A + w1, saved + (up + 1) * n * f * A, 1, 1, None),  # fc1
            (n * h * A + w1, saved + (up + 1) * n * f * A, 1, 1, 1),  # its into the bucket
        ]
    rows = n * x.ep / x.experts
    freed = 2 * n * h * A + rows * f * A  # the combine's, the expert's fc2 input
    swiglu = 3 * rows * f * A  # fc2's input gradient, SwiGLU's two
    if local > 1:  # the other experts' output gradients and the stacked fc2 gradient
        return [combine, (swiglu + n * h * A + local * h * f * A, freed, 1, 0, None)]
    # one local expert: its fc2 gradient reaches the bucket before SwiGLU's backward
    fc2 = (rows * f * A + h * f * A, freed, 1, 0, 0)
    return [combine, fc2, (swiglu, freed, 1, 1, None)]
