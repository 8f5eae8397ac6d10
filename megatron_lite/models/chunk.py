"""`ModelChunk`: the layers of one pipeline (virtual) stage, plus the embedding on the first stage
and the final norm, output layer and loss on the last. The layers and the norm are the
architecture's (`config.spec`, models/registry.py); RoPE's tables are built at the rotary width
its attention part declares (none when 0), a learned position table when it says so."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from megatron_lite.context.documents import document_ids, document_position_ids
from megatron_lite.context.layout import cp_ranges, positions
from megatron_lite.models.fp8 import apply_fp8
from megatron_lite.models.token_context import TokenContext
from megatron_lite.models.transformer import build_layer, rope_tables_at
from megatron_lite.models.transformer_config import TransformerConfig
from megatron_lite.parallel import mappings
from megatron_lite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.parallel.fp8 import LOCAL_RECIPES
from megatron_lite.parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_lookup,
)
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import set_meta
from megatron_lite.parallel.random import RNGStatesTracker, dropout
from megatron_lite.parallel.recompute import recompute
from megatron_lite.parallel.te_linear import fp8_autocast, fp8_recipe


class ModelChunk(nn.Module):
    """Layers `layer_ids` (global numbers) plus the embedding on the first stage and the final
    norm, output layer and loss on the last.

    forward(x, labels, tokens): x is token ids [b, s] on the first stage, else the hidden state
    [s/cp(/tp), b, h] from the previous stage; returns the per-token loss [s/cp, b] on the last
    stage (with multi-token prediction also the MTP modules' [D, s/cp, b]: models/mtp.py),
    else the hidden state for the next one. tokens: the microbatch's input ids [b, s],
    which every stage needs under document masking (data.reset_attention_mask,
    reset_position_ids: `token_context`).

    Full recompute (model.recompute_granularity=full) keeps only the input of each recomputed
    layer group and reruns the group in backward: `uniform` splits this chunk's layers into
    groups of recompute_num_layers, `block` recomputes its first recompute_num_layers layers one
    by one and keeps the rest (Megatron's methods, per pipeline (virtual) stage).
    """

    def __init__(
        self,
        config: TransformerConfig,
        mesh: ParallelMesh,
        tracker: RNGStatesTracker,
        layer_ids: list[int],
        pre_process: bool,
        post_process: bool,
    ):
        super().__init__()
        c = config
        self.pre_process, self.post_process = pre_process, post_process
        rotary_dim = c.spec.head_dims(c).rotary
        self.rotary, self.sp, self.tracker = rotary_dim > 0, c.sequence_parallel, tracker
        self.learned_positions = c.spec.learned_positions
        self.tp_group, self.tp_rank = mesh.tp.group, mesh.tp.rank
        self.hidden_dropout = c.hidden_dropout
        self.fp32_residual = c.fp32_residual_connection
        full = c.recompute_granularity == "full"
        self.full_recompute = (c.recompute_method, c.recompute_num_layers) if full else (None, 0)
        self.padded_vocab, self.vocab_size = c.padded_vocab_size, c.vocab_size
        te_fp8 = c.fp8 is not None and c.fp8 not in LOCAL_RECIPES  # else parallel/fp8.py
        self.fp8_recipe = fp8_recipe(c.fp8, c.fp8_recipe) if te_fp8 else None
        self.fp8_group = mesh.tp_dp_cp.group  # FP8 amax reduction: one pipeline stage
        s_local = c.seq_length // mesh.cp.size
        # this rank's global token positions (context/layout.py): one contiguous slice under
        # Ulysses, chunks j and 2·ring−1−j of the sequence (or a part of them) under the ring
        a2a, ring = mesh.cp_a2a.size, mesh.cp_ring.size
        self.cp_ranges = cp_ranges(c.seq_length, a2a, ring, mesh.cp.rank)
        if pre_process:
            self.embedding = VocabParallelEmbedding(
                c.vocab_size, c.padded_vocab_size, c.hidden_size, mesh.tp.group,
                init_std=c.init_method_std,
            )  # fmt: skip
            if self.learned_positions:
                max_pos = c.max_position_embeddings
                self.position_embeddings = set_meta(
                    nn.Parameter(torch.empty(max_pos, c.hidden_size)),
                    full_shape=(max_pos, c.hidden_size),
                    std=c.init_method_std,
                    sequence_parallel=c.sequence_parallel,
                )
        self.layers = nn.ModuleDict({str(i): build_layer(c, mesh, tracker, i) for i in layer_ids})
        if post_process:
            self._build_output(c, mesh, tied_here=c.tie_embeddings and pre_process)
        self.mtp = None  # multi-token prediction on the loss chunk (models/mtp.py)
        if post_process and c.mtp_num_layers > 0:
            self._build_mtp(c, mesh, tracker)
        self.s_local = s_local
        self._rope_args = (rotary_dim, c.rope_theta, c.rope_scaling) if self.rotary else None
        self.reset_attention_mask, self.reset_position_ids = (
            c.reset_attention_mask,
            c.reset_position_ids,
        )
        self.eod_token_id = c.eod_token_id
        if c.fp8 in LOCAL_RECIPES:
            apply_fp8(self, c.fp8, c.fp8_skip, c.fp8_unaligned, c.fp8_all_gather)
        self.init_buffers()

    def init_buffers(self, device: torch.device | None = None) -> None:
        """(Re)compute the non-persistent buffers: RoPE's cos/sin tables and the vocabulary
        padding mask (after a build on the meta device, on `device`)."""
        if self._rope_args is not None:
            cos, sin = rope_tables_at(positions(self.cp_ranges), *self._rope_args)
            self.register_buffer("rope_cos", cos.to(device), persistent=False)
            self.register_buffer("rope_sin", sin.to(device), persistent=False)
        if self.post_process:
            v_local = self.padded_vocab // self._tp_size
            cols = torch.arange(v_local, device=device) + self.tp_rank * v_local
            self.register_buffer("vocab_pad_mask", cols >= self.vocab_size, persistent=False)

    def _build_output(self, c: TransformerConfig, mesh: ParallelMesh, tied_here: bool) -> None:
        """Final norm and output layer; the output weight is the embedding's when tied here."""
        self.final_norm = c.spec.part("norm")(c.hidden_size, c.norm_eps, c.sequence_parallel)
        self.output_layer = ColumnParallelLinear(
            c.hidden_size,
            c.padded_vocab_size,
            mesh.tp.group,
            bias=False,
            sequence_parallel=c.sequence_parallel,
            init_std=c.init_method_std,
            skip_weight=tied_here,
        )
        if self.output_layer.weight is not None:  # its own weight, vocabulary-padded
            meta = self.output_layer.weight.meta
            meta.full_shape, meta.padded, meta.segments = (
                (c.vocab_size, c.hidden_size),
                c.padded_vocab_size,
                None,
            )
            if c.tie_embeddings:  # tied copy on the last stage: same init, synced grads
                meta.tied_copy, meta.init_name = True, "embedding.weight"
        self._tp_size = mesh.tp.size
        v_local = c.padded_vocab_size // mesh.tp.size  # padding rows on this rank: a mask
        self.has_vocab_pad = (mesh.tp.rank + 1) * v_local > c.vocab_size

    def _build_mtp(self, c: TransformerConfig, mesh: ParallelMesh, tracker) -> None:
        """The MTP modules, and where this chunk has no embedding and no tied output weight,
        a copy of the input embedding for them (same init, gradients summed over the
        embedding group: ParamMeta.tied_copy, as the tied output layer's)."""
        from megatron_lite.models.mtp import MultiTokenPrediction

        full = c.recompute_granularity == "full"
        copy = not self.pre_process and not c.tie_embeddings
        self.mtp = MultiTokenPrediction(c, mesh, tracker, full, embedding_copy=copy)

    def fp8(self):
        """Context for the transformer layers: FP8 GEMMs in TE linears when model.fp8 is set
        (the embedding, output layer and loss stay outside it, in bf16/fp32)."""
        if self.fp8_recipe is None:
            return contextlib.nullcontext()
        return fp8_autocast(self.fp8_recipe, self.fp8_group)

    def embed(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """ids [b, s] -> [s/cp(/tp), b, h]; positions [s/cp, b]: the learned position of each
        local token (TokenContext.positions), None for consecutive ones."""
        x = self.word_embedding(self.local_tokens(ids.t()), self.embedding)
        if self.learned_positions:
            pe, n = self.local_tokens(self.position_embeddings), x.shape[0]  # [s/cp, h]
            if self.sp:
                pe = pe[self.tp_rank * n : (self.tp_rank + 1) * n]
                if positions is not None:  # this rank's rows of the local sequence
                    positions = positions[self.tp_rank * n : (self.tp_rank + 1) * n]
            if positions is None:
                x = x + pe.unsqueeze(1)
            else:
                x = x + self.position_embeddings[positions]  # [s/cp(/tp), b, h]
        if self.fp32_residual:  # the residual stream starts in fp32 (bf16 params otherwise)
            x = x.float()
        return dropout(x, self.hidden_dropout, self.tracker, self.sp)

    def word_embedding(
        self, ids: torch.Tensor, source: VocabParallelEmbedding | torch.Tensor
    ) -> torch.Tensor:
        """ids [s/cp, b] -> [s/cp(/tp), b, h]: the vocab-parallel lookup (this rank's rows),
        reduced over TP (reduce-scattered into sequence shards under SP). `source`: an
        embedding module, called, so that its forward pre-hooks run (ZeRO-1/2 wait there for
        the all-gather of its updated weight; reading its weight without the call raced
        with that all-gather), or a weight whose module already ran in this forward."""
        if isinstance(source, torch.Tensor):
            x = vocab_parallel_lookup(ids, source, self.tp_rank)  # [s/cp, b, h] partial sums
        else:
            x = source(ids)
        if self.sp:
            return mappings.reduce_scatter_to_sequence_parallel_region(x, self.tp_group)
        return mappings.reduce_from_tensor_parallel_region(x, self.tp_group)

    def mtp_embedding_source(self) -> VocabParallelEmbedding | torch.Tensor:
        """What the MTP modules look up: the MTP's own copy (untied, pp > 1), else this
        chunk's embedding, else the tied output weight (the embedding's copy: the output layer
        has run by then, the main loss coming first, so its weight's all-gather is waited
        for)."""
        if self.mtp.embed_tokens is not None:
            return self.mtp.embed_tokens
        return self.embedding if self.pre_process else self.output_layer.weight

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Module docstring; with MTP (model.mtp_num_layers > 0) the last stage returns
        (per-token loss [s/cp, b], per-token MTP losses [D, s/cp, b])."""
        ctx = self.token_context(tokens)
        if self.pre_process:
            x = self.embed(x, ctx.positions)
        with self.fp8():
            x = self.run_layers(x, ctx)
        if not self.post_process:
            return x
        loss = self.loss(self.final_norm(x), labels)
        if self.mtp is None:
            return loss
        return loss, self.run_mtp(x, tokens, labels, ctx)

    def run_mtp(
        self, x: torch.Tensor, tokens: torch.Tensor | None, labels: torch.Tensor, ctx
    ) -> torch.Tensor:
        """The MTP modules (models/mtp.py) on the main model's last hidden state x
        [s/cp(/tp), b, h] (before the final norm) -> per-token MTP losses [D, s/cp, b]."""
        if tokens is None:
            raise ValueError(
                "ModelChunk: multi-token prediction (model.mtp_num_layers) needs the token "
                "ids on the last stage: call chunk(x, labels, tokens=inputs [b, s])"
            )
        source = self.mtp_embedding_source()
        with self.fp8():
            return self.mtp(
                x,
                tokens,
                labels,
                ctx,
                embed=lambda ids: self.word_embedding(ids, source),
                logits=self.logits,
                local=self.local_tokens,
            )

    def token_context(self, tokens: torch.Tensor | None = None) -> TokenContext:
        """The layers' context of one microbatch: RoPE's tables, and under document masking
        the document ids [b, s] and per-document positions [s/cp, b], from tokens [b, s]."""
        rope = (self.rope_cos, self.rope_sin) if self.rotary else None
        if not (self.reset_attention_mask or self.reset_position_ids):
            return TokenContext(rope)
        if tokens is None:
            raise ValueError(
                "ModelChunk: data.reset_attention_mask / reset_position_ids need the token "
                "ids on every stage: call chunk(x, labels, tokens=inputs [b, s])"
            )
        docs = document_ids(tokens, self.eod_token_id) if self.reset_attention_mask else None
        positions = None
        if self.reset_position_ids:
            positions = document_position_ids(tokens, self.eod_token_id).t()  # [s, b]
            positions = self.local_tokens(positions)  # [s/cp, b]
            if self.rotary:
                rope = rope_tables_at(positions, *self._rope_args)  # [s/cp, b, d] each
        return TokenContext(rope, docs, positions)

    def run_layers(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        """The transformer layers, with full recompute of the groups the method names."""
        layers = list(self.layers.values())
        method, n = self.full_recompute
        if method == "uniform":  # (layers, recomputed) groups
            groups = [(layers[i : i + n], True) for i in range(0, len(layers), n)]
        elif method == "block":
            groups = [([layer], True) for layer in layers[:n]] + [(layers[n:], False)]
        else:
            groups = [(layers, False)]
        for group, recomputed in groups:
            run = functools.partial(_run_group, group)
            x = recompute(run, x, ctx, tracker=self.tracker) if recomputed else run(x, ctx)
        return x

    def local_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """[s, ...] -> this CP rank's [s/cp, ...] (its positions, in local order)."""
        if len(self.cp_ranges) == 1:
            ((start, end),) = self.cp_ranges
            return t[start:end]
        return torch.cat([t[s:e] for s, e in self.cp_ranges])

    def output_weight(self) -> torch.Tensor:
        w = self.output_layer.weight
        return self.embedding.weight if w is None else w

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [s/cp(/tp), b, h] (after the final norm) -> this TP rank's logits [s/cp, b, V/tp],
        -inf in the vocabulary padding."""
        logits = self.output_layer(x, self.output_weight())  # [s/cp, b, V/tp]
        if self.has_vocab_pad:  # padded vocabulary never takes probability mass
            logits = logits.masked_fill(self.vocab_pad_mask, float("-inf"))
        return logits

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE's cos, sin [..., r] at integer `positions` [...] (generation's per-row
        positions), None when the architecture has no RoPE."""
        if not self.rotary:
            return None
        return rope_tables_at(positions, *self._rope_args)

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """x [s/cp(/tp), b, h], labels [b, s] -> per-token loss [s/cp, b]."""
        logits = self.logits(x)  # [s/cp, b, V/tp]
        labels = self.local_tokens(labels.t())  # [s/cp, b]
        return vocab_parallel_cross_entropy(logits.float(), labels, self.tp_group)


def _run_group(layers: list[nn.Module], x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
    for layer in layers:
        x = layer(x, ctx)
    return x
