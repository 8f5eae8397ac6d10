"""HF Qwen3 (dense) and Qwen2-MoE checkpoints through tools/convert_checkpoint.py, trained from
outside against transformers' own classes (tiny random models of tests/unit/test_convert_qwen.py,
whose sensitivity test shows a shuffled expert, a dropped bias or a missing gate moves the loss
by more than 1e-3 relative):

- hf-to-dcp, then train.init_from on one rank and on tp2+SP (the Qwen2-MoE with ep2: 4 ranks),
  pp2 and cp2 (p2p ring), three steps of the real Trainer on mock data;
- the same tokens through the HF model in float64 with plain torch: the mean cross-entropy over
  the global batch, clip_grad_norm_, torch.optim.AdamW (weight decay on the matrices, the
  router's and the shared expert gate's included, as ours and Megatron's);
- step 1's loss (the converted weights) within 1e-5 relative of HF's, and the losses after one
  and two optimizer steps and the three gradient norms within 1e-6 relative.

Each layout runs both families in one launch (the parity harness of test_convert_moe.py: its
model_overrides, a launch per layout)."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.dist_harness import run_ranks  # noqa: E402
from tests.parallel.test_convert_moe import model_overrides  # noqa: E402
from tests.unit.test_convert_qwen import SEQ, VOCAB, qwen_hf_model  # noqa: E402
from tools.convert_checkpoint import hf_to_dcp  # noqa: E402

FAMILIES = ("qwen3", "qwen2_moe")
# adam_eps 1e-5: AdamW's first update lr·g/(|g| + eps) turns the fp32 rounding of a gradient
# element near 0 into an update error of up to lr·noise/eps; at 1e-8 that shows in step 2's
# gradient norm at 1e-6 (HF's own fp32 run against its float64 run: 1.3e-6), at 1e-5 not
STEPS, GBS, LR, WD, BETAS, EPS, CLIP = 3, 4, 1e-3, 0.1, (0.9, 0.95), 1e-5, 1.0
RUN = [
    f"model.seq_length={SEQ}",
    "model.make_vocab_size_divisible_by=128",  # tp2 pads 128 -> 256: padding dropped
    "data.mock=true",
    "train.micro_batch_size=2",
    f"train.global_batch_size={GBS}",
    f"train.steps={STEPS}",
    f"train.lr={LR}",
    f"train.min_lr={LR}",  # a constant learning rate
    "train.warmup_steps=1",
    f"train.weight_decay={WD}",
    f"train.adam_beta1={BETAS[0]}",
    f"train.adam_beta2={BETAS[1]}",
    f"train.adam_eps={EPS}",
    f"train.grad_clip={CLIP}",
    "log.progress=false",
    "log.memory_steps=0",
]
TP_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
LAYOUTS = {  # name: (ranks, {family: overrides})
    "one_rank": (1, {f: [] for f in FAMILIES}),
    "tp2_sp_ep2": (4, {"qwen3": TP_SP, "qwen2_moe": [*TP_SP, "parallel.ep=2"]}),
    "pp2": (2, {f: ["parallel.pp=2"] for f in FAMILIES}),
    "cp2_p2p": (2, {f: ["parallel.cp=2", "parallel.cp_comm_type=p2p"] for f in FAMILIES}),
}


def _train(rank, world, cases, out_dir):
    """Per family: the Trainer from the converted checkpoint, STEPS steps -> rank 0's (loss,
    grad_norm) per step and the tokens of those steps' global batches."""
    import torch.distributed as dist

    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.resolve import rank_layout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    out = {}
    for family, overrides in cases.items():
        run = ["train.out_dir=" + f"{out_dir}/{family}", *overrides]
        cfg, dataset, vocab = prepare(run, world_size=world)
        records = Trainer(cfg, ParallelMesh(rank_layout(cfg.parallel, world)), dataset, vocab)
        records = records.train()
        if dist.get_rank() == 0:
            tokens = np.stack([dataset[i] for i in range(STEPS * GBS)]).astype(np.int64)
            out[family] = ([(r["loss"], r["grad_norm"]) for r in records], tokens)
    return out if dist.get_rank() == 0 else None


def hf_train(model, tokens: torch.Tensor) -> list[tuple[float, float]]:
    """(loss, grad norm) of STEPS steps of `model` on global batches tokens[k·GBS:(k+1)·GBS]
    [GBS, s + 1]: mean cross-entropy, clip_grad_norm_, torch AdamW (decay on matrices)."""
    model.train()
    params = [p for p in model.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    out = []
    for step in range(STEPS):
        batch = tokens[step * GBS : (step + 1) * GBS]
        logits = model(batch[:, :-1]).logits  # [b, s, V]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        out.append((loss.item(), norm.item()))
    return out


def assert_parity(ours, hf, what: str) -> None:
    for step, ((loss, norm), (hf_loss, hf_norm)) in enumerate(zip(ours, hf, strict=True)):
        dl, dn = abs(loss - hf_loss) / hf_loss, abs(norm - hf_norm) / hf_norm
        print(f"PARITY {what} step {step}: loss {loss:.7f} vs HF {hf_loss:.7f} ({dl:.1e}), "
              f"grad norm {norm:.6f} vs {hf_norm:.6f} ({dn:.1e})")  # fmt: skip
        bound = 1e-5 if step == 0 else 1e-6  # step 0: the converted weights' loss
        assert dl < bound, f"{what} step {step}: loss {loss} vs HF {hf_loss} ({dl:.1e})"
        assert dn < 1e-6, f"{what} step {step}: grad norm {norm} vs HF {hf_norm} ({dn:.1e})"


# every layout in the slow tier (the suite's budget): test_convert_deepseek's tp2+SP·ep2 run
# of the same path stays in the suite
SLOW_LAYOUTS = {"one_rank", "pp2", "cp2_p2p", "tp2_sp_ep2"}


@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_LAYOUTS else k for k in LAYOUTS],
)
def test_converted_qwen_trains_as_hf(layout, tmp_path):
    world, parallel = LAYOUTS[layout]
    cases, models = {}, {}
    for family in FAMILIES:
        model = qwen_hf_model(family, aux=0.0)  # HF adds no aux loss without router logits
        model.save_pretrained(tmp_path / f"hf_{family}")
        ckpt = str(tmp_path / f"ckpt_{family}")
        hf_to_dcp(str(tmp_path / f"hf_{family}"), ckpt)
        cases[family] = [*RUN, *model_overrides(ckpt), *parallel[family]]
        models[family] = model
    got = run_ranks(world, _train, cases, str(tmp_path / "run"), timeout=240)[0]
    for family, model in models.items():
        ours, tokens = got[family]
        hf = hf_train(model.double(), torch.from_numpy(tokens))  # the reference in float64
        assert_parity(ours, hf, f"{family} {layout}")
