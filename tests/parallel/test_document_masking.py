"""Document masking (data.reset_attention_mask, reset_position_ids, eod_mask_loss) on several
ranks: loss parity against one rank on the structured dataset whose documents end with EOD 249.
Ulysses cp=2 (the full sequence's document ids after the all-to-all; RoPE at per-document
positions of each rank's slice), tp2 + sequence parallelism on GPT (learned positions gathered
for each TP rank's sequence slice) and pp2 with full recompute (the token ids reach every stage;
the recomputed layers see the microbatch's context), and the ring: p2p cp=2 on GPT and
a2a+p2p cp=4 (Ulysses pairs handing the ring their documents). The one-rank reference runs
SDPA with the explicit block-diagonal causal mask."""

import pytest

from tests.parallel.parity import DOCS, SHORT, assert_parity, reference_losses, train_losses

EOD = 249
MASKED = [*SHORT, *DOCS, "data.eod_mask_loss=true"]
MODELS = {"llama": ["model.arch=llama", *MASKED], "gpt": ["model.arch=gpt", *MASKED]}
FULL_RECOMPUTE = ["model.recompute_granularity=full", "model.recompute_method=uniform",
                  "model.recompute_num_layers=1"]  # fmt: skip
CASES = {
    "cp2_llama": (2, "llama", ["parallel.cp=2"]),
    "tp2_sp_gpt": (2, "gpt", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2_recompute_llama": (2, "llama", ["parallel.pp=2", *FULL_RECOMPUTE]),
    # the ring: each sub-block masked by documents, blocks with no shared document skipped
    "p2p_cp2_gpt": (2, "gpt", ["parallel.cp=2", "parallel.cp_comm_type=p2p"]),
    "hybrid_cp4_llama": (
        4,
        "llama",
        ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", "parallel.cp_a2a_size=2"],
    ),
}


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_document_masking_loss_parity(case, tmp_path):
    world, model, overrides = CASES[case]
    ref = reference_losses(tuple(MODELS[model]), eod=EOD)
    got = train_losses(world, MODELS[model] + overrides, str(tmp_path), eod=EOD)
    assert_parity(got, ref, f"documents {case}")
