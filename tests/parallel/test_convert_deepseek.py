"""HF DeepSeek-V3 checkpoints through tools/convert_checkpoint.py, trained from outside against
transformers' own DeepseekV3ForCausalLM (the tiny random model of
tests/unit/test_convert_deepseek.py, whose sensitivity test shows a shuffled expert, a wrong
RoPE split or layout, a wrong softmax scale, a dropped bias, shared expert or scaling factor
moves the loss by more than 1e-3 relative), with its MTP module as layer N:

- hf-to-dcp (layer N imported as our MTP), then train.init_from on one rank and on tp2+SP·ep2
  (4 ranks), pp2 and cp2 (p2p ring), three steps of the real Trainer on mock data;
- the same tokens through the HF model in float64 with plain torch: the mean cross-entropy,
  clip_grad_norm_, torch.optim.AdamW (the parity harness of test_convert_qwen.py);
- step 1's loss within 1e-5 relative of HF's, the losses after one and two optimizer steps and
  the three gradient norms within 1e-6 relative;
- step 1's mtp_loss (the imported layer-N weights) within 1e-6 relative of a plain-torch
  computation of DeepSeek-V3's MTP module from the HF tensors (transformers' decoder layer and
  RMSNorm, float64);
- generation from the HF directory (--hf, its MTP layer dropped): greedy tokens equal
  transformers' generate, with and without the KV cache;
- the converted e_score_correction_bias (main and MTP layer) is the routers' expert bias and
  moves by ±model.moe_router_bias_update_rate after a step.

HF trains without an aux loss, without moving e_score_correction_bias and without MTP: the
converted model runs with moe_aux_loss_coeff=0 (the converter's, as the tiny config has no
aux_loss_alpha), model.moe_router_bias_update_rate=0 and mtp_loss_scaling_factor=0 (the main
loss and every gradient then as without MTP; mtp_loss still logged)."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.dist_harness import run_ranks  # noqa: E402
from tests.parallel.test_convert_moe import model_overrides  # noqa: E402
from tests.parallel.test_convert_qwen import (  # noqa: E402
    GBS,
    RUN,
    STEPS,
    TP_SP,
    assert_parity,
    hf_train,
)
from tests.unit.test_convert_deepseek import deepseek_hf_model, save_with_mtp  # noqa: E402
from tools.convert_checkpoint import hf_to_dcp  # noqa: E402

AS_HF = [  # what HF's training does not do (module docstring)
    "model.moe_router_bias_update_rate=0",
    "model.moe_aux_loss_coeff=0",
    "model.mtp_loss_scaling_factor=0",
]
LAYOUTS = {  # name: (ranks, overrides)
    "one_rank": (1, []),
    "tp2_sp_ep2": (4, [*TP_SP, "parallel.ep=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "cp2_p2p": (2, ["parallel.cp=2", "parallel.cp_comm_type=p2p"]),
}


def _train(rank, world, overrides, out_dir):
    """The Trainer from the converted checkpoint, STEPS steps -> rank 0's (loss, grad_norm)
    per step, step 1's mtp_loss and the tokens of those steps' global batches."""
    import torch.distributed as dist

    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.resolve import rank_layout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare([f"train.out_dir={out_dir}", *overrides], world_size=world)
    records = Trainer(cfg, ParallelMesh(rank_layout(cfg.parallel, world)), dataset, vocab)
    records = records.train()
    if dist.get_rank() != 0:
        return None
    tokens = np.stack([dataset[i] for i in range(STEPS * GBS)]).astype(np.int64)
    return [(r["loss"], r["grad_norm"]) for r in records], records[0]["mtp_loss"], tokens


WEIGHTS = ("gate", "up", "down")


def hf_mtp_loss(model, layer_n: dict[str, torch.Tensor], batch: torch.Tensor) -> float:
    """DeepSeek-V3's MTP module 1 (§2.2) from the HF tensors of layer N, in float64: with h0 the
    last decoder layer's output (before model.norm), position i < s - 1 of each sequence
    predicts t_{i+2} from eh_proj([enorm(emb(t_{i+1})); hnorm(h0_i)]) through the layer,
    shared_head.norm and the output head; the summed cross-entropy over the main loss's token
    count b·s (our mtp_loss, models/mtp.py)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    c, n = model.config, model.config.num_hidden_layers
    p = {k.removeprefix(f"model.layers.{n}."): v.double() for k, v in layer_n.items()}
    layer = DeepseekV3DecoderLayer(c, layer_idx=n).double().eval()
    f, experts = c.moe_intermediate_size, c.n_routed_experts
    names = [[f"mlp.experts.{e}.{w}_proj.weight" for e in range(experts)] for w in WEIGHTS]
    gate_up = [torch.cat([p[g], p[u]]) for g, u in zip(names[0], names[1], strict=True)]
    stacked = {
        "mlp.experts.gate_up_proj": torch.stack(gate_up),  # [E, 2f, h]
        "mlp.experts.down_proj": torch.stack([p[d] for d in names[2]]),  # [E, h, f]
    }
    assert stacked["mlp.experts.gate_up_proj"].shape[1] == 2 * f
    own = {k: v for k, v in p.items() if k in layer.state_dict()}
    layer.load_state_dict(own | stacked, strict=True)
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = DeepseekV3RMSNorm(c.hidden_size, c.rms_norm_eps).double()
        norms[name].weight.data.copy_(p[f"{name}.weight"])
    model = model.double().eval()
    captured = []
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.append(o))
    s = batch.shape[1] - 1
    with torch.no_grad():
        model(batch[:, :s])
        hook.remove()
        h0 = captured[0][:, : s - 1]  # [b, s - 1, h]
        emb = model.model.embed_tokens(batch[:, 1:s])  # t_{i+1}
        x = torch.cat([norms["enorm"](emb), norms["hnorm"](h0)], dim=-1) @ p["eh_proj.weight"].T
        positions = torch.arange(s - 1)[None]
        rope = model.model.rotary_emb(x, positions)
        causal = torch.full((s - 1, s - 1), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        h1 = layer(x, attention_mask=causal, position_ids=positions, position_embeddings=rope)
        logits = model.lm_head(norms["shared_head.norm"](h1))  # [b, s - 1, V]
        targets = batch[:, 2:]  # t_{i+2}
        summed = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        )
    return summed.item() / (batch.shape[0] * s)  # fmt: skip


# one rank, pp2 and cp2 (p2p) in the slow tier (the suite's budget): tp2+SP·ep2 here
SLOW_LAYOUTS = {"one_rank", "pp2", "cp2_p2p", "tp2_sp_ep2"}  # all (the suite's budget)


@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_LAYOUTS else k for k in LAYOUTS],
)
def test_converted_deepseek_v3_trains_as_hf(layout, tmp_path):
    world, parallel = LAYOUTS[layout]
    model = deepseek_hf_model()
    layer_n = save_with_mtp(model, tmp_path / "hf")
    ckpt = str(tmp_path / "ckpt")
    hf_to_dcp(str(tmp_path / "hf"), ckpt)
    overrides = [*RUN, *model_overrides(ckpt), *AS_HF, *parallel]
    ours, mtp_loss, tokens = run_ranks(
        world, _train, overrides, str(tmp_path / "run"), timeout=300
    )[0]
    tokens = torch.from_numpy(tokens)
    want_mtp = hf_mtp_loss(deepseek_hf_model(), layer_n, tokens[:GBS])
    d = abs(mtp_loss - want_mtp) / want_mtp
    print(f"PARITY deepseek_v3 {layout} mtp_loss {mtp_loss:.7f} vs {want_mtp:.7f} ({d:.1e})")
    assert d < 1e-6, f"{layout}: mtp_loss {mtp_loss} vs the plain-torch MTP {want_mtp} ({d:.1e})"
    hf = hf_train(model.double(), tokens)  # the reference in float64
    assert_parity(ours, hf, f"deepseek_v3 {layout}")


@pytest.mark.slow  # the suite's budget
def test_generate_from_hf_deepseek_equals_transformers(tmp_path):
    """megatron_lite.generate --hf on the DeepSeek-V3 directory (MLA's KV-cached decoding,
    YaRN, the routing): transformers' greedy tokens, prompts batched with left padding."""
    from tests.parallel.test_generate import NEW, PROMPTS, _generate, hf_generate

    model = deepseek_hf_model()
    save_with_mtp(model, tmp_path / "hf")  # the MTP layer is dropped for decoding
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    config["max_position_embeddings"] = 64  # the context to decode in (YaRN reads the original)
    with open(tmp_path / "hf" / "config.json", "w") as f:
        json.dump(config, f)
    expected = hf_generate(model, PROMPTS, NEW)
    got = run_ranks(1, _generate, "hf", str(tmp_path / "hf"), PROMPTS, NEW, True, timeout=120)[0]
    assert got["cached"] == expected, f"ours {got['cached']} vs HF {expected}"
    assert got["full"] == got["cached"], "the KV cache changed the tokens"


def _biases(rank, world, overrides, out_dir):
    """The routers' expert biases after loading the converted checkpoint and after one step."""
    from megatron_lite.moe.layer import moe_layers
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare([f"train.out_dir={out_dir}", *overrides], world_size=world)
    trainer = Trainer(cfg, ParallelMesh(RankLayout(world)), dataset, vocab)
    routers = [layer.router for layer in moe_layers(trainer.chunks)]
    before = [r.expert_bias.detach().clone() for r in routers]
    trainer.train_step()
    return before, [r.expert_bias.detach().clone() for r in routers]


def test_converted_expert_bias_keeps_updating(tmp_path):
    """e_score_correction_bias (layer 1's and the MTP layer's) loads as the routers' expert
    bias and moves by ±model.moe_router_bias_update_rate after a step, as DeepSeek-V3 trains."""
    model = deepseek_hf_model()
    layer_n = save_with_mtp(model, tmp_path / "hf")
    ckpt = str(tmp_path / "ckpt")
    hf_to_dcp(str(tmp_path / "hf"), ckpt)
    rate = 0.01
    overrides = [*RUN, *model_overrides(ckpt), f"model.moe_router_bias_update_rate={rate}"]
    before, after = run_ranks(1, _biases, overrides, str(tmp_path / "run"), timeout=120)[0]
    hf_biases = [model.model.layers[1].mlp.gate.e_score_correction_bias]
    hf_biases.append(layer_n["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert len(before) == 2, "the main MoE layer and the MTP layer"
    for mine, theirs, moved in zip(before, hf_biases, after, strict=True):
        assert torch.equal(mine, theirs), "the converted bias is not HF's"
        steps = (moved - mine) / rate  # -1, 0 or +1 each
        assert torch.allclose(steps, steps.round(), atol=1e-4), steps
        assert steps.round().abs().max() == 1, "the expert bias did not move"
