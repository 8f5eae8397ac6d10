"""HF Mixtral and Qwen3-MoE checkpoints through tools/convert_checkpoint.py, against
transformers' own MixtralForCausalLM / Qwen3MoeForCausalLM (tiny random models built offline):

- import: hf-to-dcp, then train.init_from on one rank and on tp2 (+SP), pp2 and ep2 layouts;
  our logits (gathered over TP, from the last pipeline stage) equal HF's within 1e-4 in fp32;
- export: ep2 trains two steps from that start and saves (experts sharded over EP), dcp-to-hf
  writes HF files, and transformers' logits of them equal our trained model's within 1e-4.

Each layout runs both families in one launch (a launch costs seconds on 2 cores)."""

import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402

from tests.dist_harness import run_ranks  # noqa: E402
from tests.unit.test_convert_hf import SEQ, moe_hf_model, token_ids  # noqa: E402
from tools.convert_checkpoint import dcp_to_hf, hf_to_dcp  # noqa: E402

VOCAB = 128
FAMILIES = ("mixtral", "qwen3_moe")
RUN = [
    f"model.seq_length={SEQ}",
    "model.make_vocab_size_divisible_by=128",  # tp2 pads 128 -> 256: padding dropped
    "data.mock=true",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.lr=1e-3",
    "log.progress=false",
]
LAYOUTS = {
    "one_rank": (1, []),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "ep2": (2, ["parallel.ep=2"]),  # ep folds into dp=2
}
EXPORT_STEPS = 2


def model_overrides(ckpt: str) -> list[str]:
    """model.* overrides that match a converted checkpoint (its metadata.json, as a user reads
    it), plus train.init_from."""
    with open(os.path.join(ckpt, "metadata.json")) as f:
        model = json.load(f)["config"]["model"]
    return [f"model.{k}={json.dumps(v)}" for k, v in model.items()] + [f"train.init_from={ckpt}"]


def _logits(trainer, mesh, ids):
    """Our model's float32 logits [b, s, V] for ids (a no-grad forward through this rank's
    chunk, the hidden state sent between pipeline stages, the vocabulary gathered over TP), on
    the last stage's TP rank 0 of each data-parallel rank; None elsewhere."""
    import torch.distributed as dist

    chunk = trainer.chunks[0]
    ctx = chunk.token_context()  # RoPE's tables
    pp_ranks, pp_rank = mesh.pp.ranks, mesh.pp.rank
    with torch.no_grad():
        if chunk.pre_process:
            x = chunk.embed(ids)  # [s(/tp), b, h]
        else:
            s = SEQ // mesh.tp.size if trainer.cfg.parallel.sequence_parallel else SEQ
            x = torch.empty(s, ids.shape[0], trainer.cfg.model.hidden_size)
            dist.recv(x, pp_ranks[pp_rank - 1])
        for layer in chunk.layers.values():
            x = layer(x, ctx)
        if not chunk.post_process:
            dist.send(x.contiguous(), pp_ranks[pp_rank + 1])
            return None
        logits = chunk.output_layer(chunk.final_norm(x), chunk.output_weight())  # [s, b, V/tp]
        if mesh.tp.size > 1:
            parts = [torch.empty_like(logits) for _ in range(mesh.tp.size)]
            dist.all_gather(parts, logits.contiguous(), group=mesh.tp.group)
            logits = torch.cat(parts, dim=-1)  # [s, b, V]
    if mesh.tp.rank != 0:
        return None
    return logits[..., :VOCAB].transpose(0, 1).numpy()  # numpy: a tensor can't cross the queue


def _run(rank, world, cases, out_dir, ids, export: bool):
    """Per family: build the Trainer from the converted checkpoint, our logits; with `export`,
    train EXPORT_STEPS and save, and the trained model's logits too."""
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    out = {}
    for family, overrides in cases.items():
        run_dir = os.path.join(out_dir, family)
        cfg, dataset, vocab = prepare(["train.out_dir=" + run_dir, *overrides], world_size=world)
        p = cfg.parallel
        mesh = ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep))
        trainer = Trainer(cfg, mesh, dataset, vocab)
        out[family] = [_logits(trainer, mesh, ids)]
        if export:
            trainer.train()
            out[family].append(_logits(trainer, mesh, ids))
    return out


def hf_models_and_checkpoints(tmp_path):
    """{family: (HF model, converted checkpoint)}, the HF files written and converted once."""
    out = {}
    for family in FAMILIES:
        model = moe_hf_model(family)
        model.save_pretrained(tmp_path / f"hf_{family}")
        ckpt = str(tmp_path / f"ckpt_{family}")
        hf_to_dcp(str(tmp_path / f"hf_{family}"), ckpt)
        out[family] = (model, ckpt)
    return out


def assert_close(ours, hf: torch.Tensor, what: str) -> None:
    diff = (torch.from_numpy(ours) - hf).abs().max().item()
    scale = hf.abs().max().item()
    print(f"LOGITS {what}: max abs diff {diff:.2e} (max |logit| {scale:.2f})")
    assert scale > 1.0, "logits too small to test anything"
    assert diff < 1e-4, f"{what}: our logits differ from transformers' by {diff:.2e}"


def results(ranks_out, family: str, index: int) -> list:
    """The logits the ranks returned (one per data-parallel rank: each ran the same ids)."""
    found = [r[family][index] for r in ranks_out if r[family][index] is not None]
    assert found, f"{family}: no rank returned logits"
    return found


@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=pytest.mark.slow) if k == "ep2" else k for k in LAYOUTS]
)  # ep2 (and its export) in the slow tier: the suite's budget
def test_hf_moe_logits_after_import(layout, tmp_path):
    world, parallel = LAYOUTS[layout]
    sources = hf_models_and_checkpoints(tmp_path)
    ids = token_ids() % VOCAB
    export = layout == "ep2"  # also train, save and export from the expert-sharded layout
    steps = [f"train.steps={EXPORT_STEPS}", f"train.save_interval={EXPORT_STEPS}"]
    cases = {
        f: [*RUN, *model_overrides(ckpt), *parallel, *(steps if export else [])]
        for f, (_, ckpt) in sources.items()
    }
    got = run_ranks(world, _run, cases, str(tmp_path / "run"), ids, export, timeout=150)
    for family, (model, _) in sources.items():
        with torch.no_grad():
            hf = model(ids).logits
        for ours in results(got, family, 0):
            assert_close(ours, hf, f"hf->ours {family} {layout}")
        if not export:
            continue
        ckpts = os.path.join(tmp_path, "run", family, "checkpoints")
        dcp_to_hf(ckpts, str(tmp_path / f"export_{family}"))
        trained = type(model).from_pretrained(
            tmp_path / f"export_{family}", attn_implementation="eager"
        )
        with torch.no_grad():
            hf_trained = trained.float().eval()(ids).logits
        moved = (hf_trained - hf).abs().max().item()
        assert moved > 1e-3, f"{family}: {EXPORT_STEPS} steps did not change the logits"
        for ours in results(got, family, 1):
            assert_close(ours, hf_trained, f"ours->hf {family} {layout}")
