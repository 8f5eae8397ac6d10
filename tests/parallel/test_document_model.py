"""Document masking on one rank, against independent references: a packed window's per-token
logits under data.reset_attention_mask + reset_position_ids equal those of each document run
alone as its own unpacked sequence (llama: RoPE; gpt: learned positions; float64), and
data.eod_mask_loss drops exactly the labels after EOD inputs, the loss then being the mean over
the remaining tokens."""

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY

EOD, SEQ = 249, 32
DOCS = ["data.mock=true", f"data.eod_token_id={EOD}", "data.reset_attention_mask=true",
        "data.reset_position_ids=true"]  # fmt: skip


def packed_window() -> tuple[torch.Tensor, list[list[tuple[int, int]]]]:
    """Token ids [2, SEQ] with EODs (one at position 0, two in a row, one last) and each row's
    documents as (start, end) spans, the EOD ending a document belonging to it."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, EOD, (2, SEQ), generator=g)
    tokens[0, [0, 9, 10, 20]] = EOD
    tokens[1, [13, SEQ - 1]] = EOD
    spans = []
    for row in tokens.tolist():
        ends = [i + 1 for i, t in enumerate(row) if t == EOD]
        cuts = sorted({0, *ends, SEQ})
        spans.append(list(zip(cuts[:-1], cuts[1:], strict=True)))
    return tokens, spans


def _chunk(overrides, world=1):
    from megatron_lite.models import build_model
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.train import prepare

    cfg, _, vocab = prepare([*TINY, "train.micro_batch_size=1", *overrides], world_size=world)
    mesh = ParallelMesh(RankLayout(world))
    tracker = model_parallel_seed(cfg.train.seed, mesh.tp.rank, mesh.pp.rank)
    (chunk,) = build_model(cfg, mesh, tracker, vocab)
    chunk.double()
    chunk.init_buffers()  # RoPE's tables in fp32, as the per-token ones are
    return chunk.eval()


def _logits(chunk, ids, tokens=None):
    """Logits [b, s, V] of a forward through the whole chunk (captured at its output layer)."""
    seen = []
    hook = chunk.output_layer.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        chunk(ids, torch.zeros_like(ids), tokens=tokens)
    hook.remove()
    return seen[0][..., : EOD + 1].transpose(0, 1)


def _packed_vs_separate(rank, world, arch):
    packed = _chunk([f"model.arch={arch}", *DOCS])
    plain = _chunk([f"model.arch={arch}", "data.mock=true"])  # same seed: the same weights
    tokens, spans = packed_window()
    got = _logits(packed, tokens, tokens)
    worst, filler = 0.0, torch.full((1, SEQ), 5)
    for r, row in enumerate(spans):
        for a, b in row:  # the document alone at positions 0.., padded after its end
            alone = filler.clone()
            alone[0, : b - a] = tokens[r, a:b]
            want = _logits(plain, alone)[0, : b - a]
            worst = max(worst, float((got[r, a:b] - want).abs().max()))
    scale = float(got.abs().max())
    dropped = float((_logits(plain, tokens) - got).abs().max())  # without the masking
    return worst, scale, dropped


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_packed_window_equals_documents_run_alone(arch):
    ((worst, scale, dropped),) = run_ranks(1, _packed_vs_separate, arch, timeout=120)
    print(f"DOCUMENTS {arch}: max |packed - alone| {worst:.1e} (max |logit| {scale:.2f})")
    assert scale > 0.1, "logits too small to test anything"
    assert dropped > 1e-3, f"masking changed nothing ({dropped:.1e}): the test cannot see it"
    assert worst < 1e-10, f"{arch}: packed logits differ from each document alone by {worst:.2e}"


def test_split_sample_masks_the_labels_after_eod_inputs():
    from megatron_lite.data.sampler import split_sample
    from megatron_lite.parallel.cross_entropy import IGNORE_INDEX

    sample = torch.tensor([[EOD, 3, 4, EOD, EOD, 6, 7], [1, 2, 3, 4, 5, 6, EOD]])
    inputs, labels = split_sample(sample, EOD)
    plain_inputs, plain = split_sample(sample)
    assert torch.equal(inputs, plain_inputs) and torch.equal(plain, sample[:, 1:])
    masked = labels == IGNORE_INDEX
    assert torch.equal(masked, inputs == EOD), (inputs, labels)
    assert torch.equal(labels[~masked], plain[~masked])
    assert masked.sum() == 3  # the EOD as the last label is a target; as the last input, gone


def _step1_loss(rank, world, out_dir, overrides):
    from megatron_lite.data.sampler import microbatches_at, split_sample
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare([*TINY, "train.steps=1", f"train.out_dir={out_dir}",
                                   *overrides], world_size=world)  # fmt: skip
    trainer = Trainer(cfg, ParallelMesh(RankLayout(world)), dataset, vocab)
    chunk = trainer.chunks[0]
    t = cfg.train
    micro = microbatches_at(dataset, 0, t.global_batch_size, t.micro_batch_size, 0, 1)
    with torch.no_grad():  # the per-token losses of the untrained model, by hand
        per_token = [chunk(*split_sample(mb, EOD), tokens=split_sample(mb)[0]) for mb in micro]
    by_hand = torch.cat([p.flatten() for p in per_token])
    kept = torch.cat([(split_sample(mb)[0] != EOD).t().flatten() for mb in micro])
    (record,) = trainer.train()
    return record["loss"], float(by_hand.sum() / kept.sum()), float(by_hand.mean()), int(kept.sum())


def test_eod_mask_loss_is_the_mean_over_the_kept_tokens(tmp_path):
    from tests.parallel.parity import structured_dataset

    data = f"data.paths=[{structured_dataset(eod=EOD)}]"
    overrides = [data, f"data.eod_token_id={EOD}", "data.eod_mask_loss=true"]
    ((loss, kept_mean, all_mean, kept),) = run_ranks(1, _step1_loss, str(tmp_path), overrides)
    total = 8 * SEQ
    assert 0 < kept < total, f"the batch should hold EOD inputs: {total - kept} of {total}"
    assert abs(all_mean - kept_mean) > 1e-3 * kept_mean, "the count makes no difference here"
    assert abs(loss - kept_mean) < 1e-6 * kept_mean, (loss, kept_mean, all_mean)
