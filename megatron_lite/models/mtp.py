"""Multi-token prediction (MTP): DeepSeek-V3 §2.2's D sequential modules, as Megatron-Core's
`MultiTokenPredictionBlock`, on the model chunk that computes the loss.

Module k (1..D) at position i takes h_{k-1} (h_0: the main model's last hidden state BEFORE its
final norm) and the embedding of token t_{i+k}:

    h'_k = M_k [norm_e(emb(t_{i+k})); norm_h(h_{k-1})]     (concatenation, then 2h -> h)
    h_k  = TRM_k(h'_k)                                      (one transformer layer)
    loss_k(i) = CE(OutHead(final_norm_k(h_k)), t_{i+k+1})

with the embedding and the output head shared with the main model. The embedding comes first
in the concatenation, as in Megatron-Core (`torch.cat((decoder_input, hidden_states), -1)`
after enorm/hnorm) and the published DeepSeek-V3 MTP inference code (`eh_proj(cat[enorm(e),
hnorm(h)])`). h_k (the layer's output, before final_norm_k) feeds module k + 1, as the paper
writes it; Megatron chains the normalized output instead, which differs only when D >= 2.

The norms are the architecture's norm part (RMSNorm for llama, LayerNorm for gpt); the
transformer layer is the architecture's layer built by `models.transformer.build_layer` with
global number num_layers + k - 1, dense or MoE as the main model's LAST layer is (Megatron
builds its MTP layer from the decoder's last layer spec; DeepSeek-V3's MTP layer is MoE). Only
the word embedding is looked up (DeepSeek's Emb(t)): validation refuses MTP on an architecture
with learned absolute positions, as Megatron-Core does.

Targets (pure functions of the full [b, s] tokens and labels, before each CP rank keeps its
own positions, so every CP layout sees the same shift): the input token of position i is
tokens[i + k] and its target labels[i + k] = t_{i+k+1}; positions with i + k >= s have no
target (ignored: Megatron's roll-and-mask), nor have positions whose label is ignored
(data.eod_mask_loss) or, under document masking (data.reset_attention_mask), whose target
lies in another document than position i: no MTP target crosses a document boundary (a
stricter rule than Megatron's packed-sequence roll, which keeps a target right after the
document's last token, as the main loss does).

Loss (DeepSeek-V3 eq. 24-25 with T the main loss's token count, Megatron's per-token loss):
    L_MTP = λ/D · Σ_k Σ_i loss_k(i) / N
where N is the global count of the main loss's tokens; the trained objective is L_main + L_MTP
(training/lm_step.py adds λ/D · Σ loss_k to the summed main loss with the main loss's scale).
The logged `mtp_loss` is (1/D) Σ_k Σ_i loss_k(i) / N, without λ.

Parameters of module k (0-based index j = k - 1), and the Hugging Face DeepSeek-V3 names of
layer 61 (the MTP module of the 61-layer model) they map onto when mtp_num_layers = 1:
    mtp.layers.j.enorm.weight        <- model.layers.61.enorm.weight   (norm of the embedding)
    mtp.layers.j.hnorm.weight        <- model.layers.61.hnorm.weight   (norm of h_{k-1})
    mtp.layers.j.eh_proj.weight      <- model.layers.61.eh_proj.weight [h, 2h], columns
                                        [embedding | hidden]; column-parallel (rows over TP)
    mtp.layers.j.layer.*             <- model.layers.61.{input_layernorm, self_attn, ...,
                                        post_attention_layernorm, mlp}: the same mapping as
                                        a main layer's
    mtp.layers.j.final_norm.weight   <- model.layers.61.shared_head.norm.weight
    (shared)  embedding.weight       == model.layers.61.embed_tokens.weight (a copy of
                                        model.embed_tokens.weight)
    (shared)  output_layer.weight    == model.layers.61.shared_head.head.weight (a copy of
                                        lm_head.weight)
On a chunk without the embedding (pp > 1) and with untied embeddings, `mtp.embed_tokens.weight`
is the last stage's copy of embedding.weight (ParamMeta.tied_copy: same init, gradients summed
over the embedding group, not written to checkpoints), as the tied output layer's copy is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron_lite.context.documents import document_ids
from megatron_lite.models.token_context import TokenContext
from megatron_lite.models.transformer import build_layer
from megatron_lite.models.transformer_config import TransformerConfig
from megatron_lite.parallel import mappings
from megatron_lite.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from megatron_lite.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.random import RNGStatesTracker
from megatron_lite.parallel.recompute import is_recomputing, recompute


def mtp_targets(
    tokens: torch.Tensor, labels: torch.Tensor, k: int, eod_id: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Module k's inputs and targets over the full sequence: tokens, labels [b, s] ->
    (ids [b, s]: tokens[i + k], 0 where i + k >= s; targets [b, s]: labels[i + k], IGNORE_INDEX
    where i + k >= s, and with `eod_id` (document masking) where the target t_{i+k+1} is in
    another document than position i)."""
    s = tokens.shape[1]
    ids = torch.zeros_like(tokens)
    targets = torch.full_like(labels, IGNORE_INDEX)
    if k < s:
        ids[:, : s - k] = tokens[:, k:]
        targets[:, : s - k] = labels[:, k:]
    if eod_id is not None:  # doc of position j = EODs among tokens[0..j-1], j = 0..s
        eod = (tokens == eod_id).long()
        docs = torch.cat([document_ids(tokens, eod_id), eod.sum(1, keepdim=True)], dim=1)
        target_doc = torch.full_like(tokens, -1)  # the doc of t_{i+k+1}, position i + k + 1
        if k < s:
            target_doc[:, : s - k] = docs[:, k + 1 :]
        targets = targets.masked_fill(target_doc != docs[:, :s], IGNORE_INDEX)
    return ids, targets


class MTPModule(nn.Module):
    """One MTP module (module docstring): [s/cp(/tp), b, h] hidden and embedding -> its
    output h_k [s/cp(/tp), b, h] before final_norm."""

    def __init__(
        self, config: TransformerConfig, mesh: ParallelMesh, tracker: RNGStatesTracker, k: int
    ):
        super().__init__()
        c, norm = config, config.spec.part("norm")
        self.sp, self.tp_group = c.sequence_parallel, mesh.tp.group
        self.enorm = norm(c.hidden_size, c.norm_eps, c.sequence_parallel)
        self.hnorm = norm(c.hidden_size, c.norm_eps, c.sequence_parallel)
        self.eh_proj = ColumnParallelLinear(
            2 * c.hidden_size,
            c.hidden_size,
            mesh.tp.group,
            bias=False,
            sequence_parallel=c.sequence_parallel,
            gather_output=True,
            init_std=c.init_method_std,
            gemm=c.linear_backend,
        )
        self.layer = build_layer(c, mesh, tracker, c.num_layers + k - 1)
        self.final_norm = norm(c.hidden_size, c.norm_eps, c.sequence_parallel)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        x = torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1)  # [s/cp(/tp), b, 2h]
        x = self.eh_proj(x)  # [s/cp, b, h] (gathered over TP)
        if self.sp:
            x = mappings.scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/cp/tp]
        return self.layer(x.to(h.dtype), ctx)


class MultiTokenPrediction(nn.Module):
    """D MTP modules (module docstring) on the loss chunk.

    forward(h0, tokens, labels, ctx, embed, logits, local) -> per-token MTP losses [D, s/cp, b]
    (0 where there is no target). h0: the main model's last hidden state [s/cp(/tp), b, h]
    before its final norm; tokens, labels [b, s]: the microbatch's; embed(ids [s/cp, b]) ->
    [s/cp(/tp), b, h]: the shared word embedding; logits(x) -> [s/cp, b, V/tp]: the shared
    output head; local([s, ...]) -> this CP rank's positions. Each forward records its
    per-module loss sums (`pop_stats`, for the logged mtp_loss). `recompute_layers`: run each
    module's transformer layer under full recompute (model.recompute_granularity=full);
    `embedding_copy`: hold a copy of the input embedding (`embed_tokens`, for a chunk without
    the embedding and without a tied output weight).
    `loss_scale` = λ/D, the weight of Σ_k Σ_i loss_k(i) in the objective (lm_step.py)."""

    def __init__(
        self,
        config: TransformerConfig,
        mesh: ParallelMesh,
        tracker: RNGStatesTracker,
        recompute_layers: bool = False,
        embedding_copy: bool = False,
    ):
        super().__init__()
        c = config
        self.layers = nn.ModuleList(
            MTPModule(c, mesh, tracker, k) for k in range(1, c.mtp_num_layers + 1)
        )
        self.embed_tokens = None  # the last stage's copy of the input embedding (module doc)
        if embedding_copy:
            self.embed_tokens = VocabParallelEmbedding(
                c.vocab_size, c.padded_vocab_size, c.hidden_size, mesh.tp.group,
                init_std=c.init_method_std,
            )  # fmt: skip
            meta = self.embed_tokens.weight.meta
            meta.tied_copy, meta.init_name = True, "embedding.weight"
        self.tp_group, self.tracker = mesh.tp.group, tracker
        self.recompute_layers = recompute_layers
        self.loss_scale = c.mtp_loss_scaling_factor / c.mtp_num_layers  # λ/D
        self.eod_id = c.eod_token_id if c.reset_attention_mask else None
        self.stats: list[torch.Tensor] = []  # per forward: [D] float64 loss sums

    def forward(
        self,
        h0: torch.Tensor,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        ctx: TokenContext,
        embed: Callable[[torch.Tensor], torch.Tensor],
        logits: Callable[[torch.Tensor], torch.Tensor],
        local: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        h, losses = h0, []
        for k, module in enumerate(self.layers, start=1):
            ids, targets = mtp_targets(tokens, labels, k, self.eod_id)  # [b, s] each
            emb = embed(local(ids.t()))  # [s/cp(/tp), b, h]
            if self.recompute_layers:
                h = recompute(module, h, emb, ctx, tracker=self.tracker)
            else:
                h = module(h, emb, ctx)
            out = logits(module.final_norm(h))  # [s/cp, b, V/tp]
            target = local(targets.t())  # [s/cp, b]
            losses.append(vocab_parallel_cross_entropy(out.float(), target, self.tp_group))
        losses = torch.stack(losses)  # [D, s/cp, b]
        if not is_recomputing():
            self.stats.append(losses.detach().sum(dim=(1, 2)).double())
        return losses

    def pop_stats(self) -> torch.Tensor | None:
        """The per-module loss sums [D] (float64) of the forwards since the last pop."""
        stats, self.stats = self.stats, []
        return torch.stack(stats).sum(0) if stats else None
