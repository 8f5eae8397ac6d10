"""Pipeline engine: loss parity of PP layouts against a single rank (6 steps, fp32), the
microbatch-count rules, and the measured pipeline timeline.

Microbatch sizes differ from the reference where that exercises the steady state of the
interleaved schedule (m > pp): the loss is the token-weighted mean of the same global batch, so
only float rounding changes.
"""

import importlib.util
import json
import os

import pytest

from megatron_lite.config import ConfigError, load_config
from megatron_lite.validation import validate
from tests.dist_harness import run_ranks
from tests.parallel.parity import SHORT, assert_parity, reference_losses, train_losses
from tests.parallel.test_moe import MOE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIED, UNTIED = ("model.arch=llama",), ("model.arch=llama", "model.tie_embeddings=false")
LAYERS8 = (*TIED, "model.num_layers=8")
SP_PP2 = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2"]  # dp=2 on 8

# name: (world, reference model, layout overrides); microbatches per rank in the comment
LAYOUTS = {
    "pp2": (2, TIED, ["parallel.pp=2"]),  # m=4
    "pp2_untied": (2, UNTIED, ["parallel.pp=2"]),
    "pp4": (4, TIED, ["parallel.pp=4"]),  # m=4
    "pp2_vpp2": (2, TIED, ["parallel.pp=2", "parallel.vpp=2"]),  # m=4, steady state
    "pp4_vpp2": (4, LAYERS8, ["parallel.pp=4", "parallel.vpp=2", "train.micro_batch_size=1"]),
    "tp2_sp_pp2_dp2": (8, TIED, SP_PP2),  # m=2
    "tp2_sp_pp2_dp2_untied": (8, UNTIED, SP_PP2),
    "tp2_sp_pp2_vpp2_dp2": (8, TIED, [*SP_PP2, "parallel.vpp=2", "train.micro_batch_size=1"]),
}  # pp4_vpp2: m=8; tp2_sp_pp2_vpp2_dp2: m=4 (both reach the interleaved steady state)


# ZB-H1 and ZB-V: each backward split into B (input grad, the linear layers' weight GEMMs
# queued) and W (the queue); batches posted. m = pp, 2·pp and an odd count; with tp2+SP
ZB_H1 = ["parallel.pipeline_schedule=zb-h1"]
ZB_V = ["parallel.pipeline_schedule=zb-v", "parallel.vpp=2"]
DUALPIPEV = ["parallel.pipeline_schedule=dualpipev", "parallel.vpp=2"]
M5 = (*UNTIED, "train.micro_batch_size=1", "train.global_batch_size=5")
FULL = ["model.recompute_granularity=full", "model.recompute_method=uniform",
        "model.recompute_num_layers=1"]  # fmt: skip
M3 = (*UNTIED, "train.micro_batch_size=1", "train.global_batch_size=3")
ZB_LAYOUTS = {
    "zb_h1_pp2_m4": (2, TIED, ["parallel.pp=2", *ZB_H1]),
    "zb_h1_pp4_m4": (4, TIED, ["parallel.pp=4", *ZB_H1]),
    "zb_h1_pp4_m8": (4, TIED, ["parallel.pp=4", "train.micro_batch_size=1", *ZB_H1]),
    "zb_h1_pp4_m5": (4, M5, ["parallel.pp=4", *ZB_H1]),
    "zb_h1_pp2_m3": (2, M3, ["parallel.pp=2", *ZB_H1]),
    "zb_h1_tp2_sp_pp2_dp2": (8, TIED, [*SP_PP2, *ZB_H1]),
    "zb_h1_pp2_dp2_zero1": (4, TIED, ["parallel.pp=2", "parallel.zero_stage=1", *ZB_H1]),
    # full recompute: the rerun in B computes its weight gradients there (nothing queued)
    "zb_h1_pp2_full_recompute": (2, TIED, ["parallel.pp=2", *FULL, *ZB_H1]),
    "zb_h1_moe_ep2_pp2": (4, MOE, ["parallel.ep=2", "parallel.pp=2", *ZB_H1]),
    # ZB-V: two chunks per rank in the V placement, so the tied embedding and its output-layer
    # copy are both on rank 0 (summed there); m = 2·pp, pp (dp2), odd
    "zb_v_pp2_m4": (2, TIED, ["parallel.pp=2", *ZB_V]),
    "zb_v_pp4_m4": (4, LAYERS8, ["parallel.pp=4", *ZB_V]),
    "zb_v_pp4_m5": (4, (*M5, "model.num_layers=8"), ["parallel.pp=4", *ZB_V]),
    "zb_v_pp2_m3_full_recompute": (2, M3, ["parallel.pp=2", *FULL, *ZB_V]),
    "zb_v_tp2_sp_pp2_dp2": (8, TIED, [*SP_PP2, *ZB_V]),
    "zb_v_pp2_dp2_zero1": (4, TIED, ["parallel.pp=2", "parallel.zero_stage=1", *ZB_V]),
    "zb_v_pp2_dp2_zero2_selective": (4, TIED, ["parallel.pp=2", "parallel.zero_stage=2",
                                               "model.recompute_granularity=selective", *ZB_V]),
    "zb_v_moe_ep2_pp2": (4, MOE, ["parallel.ep=2", "parallel.pp=2", *ZB_V]),
    # ZeRO-3: FSDP2 reduce-scatters each chunk after its last W (not in B's post-backward)
    "zb_v_pp2_dp2_zero3": (4, TIED, ["parallel.pp=2", "parallel.zero_stage=3", *ZB_V]),
    "zb_h1_pp2_dp2_zero3": (4, TIED, ["parallel.pp=2", "parallel.zero_stage=3", *ZB_H1]),
    "dualpipev_pp2_dp2_zero3_m4": (4, TIED, ["parallel.pp=2", "parallel.zero_stage=3",
                                             "train.micro_batch_size=1", *DUALPIPEV]),
    # ring context parallelism inside each chunk; uneven virtual stages
    "zb_v_p2p_cp2_pp2": (4, TIED, ["parallel.pp=2", "parallel.cp=2",
                                   "parallel.cp_comm_type=p2p", *ZB_V]),
    "zb_h1_pp2_uneven": (2, TIED, ["parallel.pp=2", "parallel.pipeline_layers=[1,3]", *ZB_H1]),
    # DualPipeV (m >= 2·pp): F0 B1 / F1 B0 pairs in its main phase, the later backwards split
    "dualpipev_pp2_m4": (2, TIED, ["parallel.pp=2", *DUALPIPEV]),
    "dualpipev_pp2_m5_full_recompute": (2, M5, ["parallel.pp=2", *FULL, *DUALPIPEV]),
    "dualpipev_pp4_m8": (4, LAYERS8, ["parallel.pp=4", "train.micro_batch_size=1", *DUALPIPEV]),
    "dualpipev_tp2_sp_pp2_dp2_m4": (8, TIED, [*SP_PP2, "train.micro_batch_size=1", *DUALPIPEV]),
}  # fmt: skip


@pytest.mark.parity
@pytest.mark.parametrize("layout", [*LAYOUTS, *ZB_LAYOUTS])
def test_pipeline_loss_parity(layout, tmp_path):
    world, model, overrides = {**LAYOUTS, **ZB_LAYOUTS}[layout]
    model = (*model, *SHORT)
    ref = reference_losses(model)
    got = train_losses(world, [*model, *overrides], str(tmp_path))
    assert ref[-1] < ref[0] - 0.05, f"reference loss did not fall: {ref}"
    assert_parity(got, ref, layout)


# world = pp (dp=1), micro batch 2, global batch 6: 3 microbatches per step
BAD_COUNTS = {
    "fewer_than_pp": (4, ["parallel.pp=4"], "fewer than the 4 pipeline stages"),
    "interleaved_not_multiple": (2, ["parallel.pp=2", "parallel.vpp=2"], "multiple of pp=2"),
}


@pytest.mark.parametrize("case", BAD_COUNTS)
def test_bad_microbatch_count_is_a_config_error(case):
    world, overrides, rule = BAD_COUNTS[case]
    base = ["data.mock=true", "model.vocab_size=64", "train.global_batch_size=6"]
    cfg = load_config(None, [*base, "model.num_layers=4", "train.micro_batch_size=2", *overrides])
    with pytest.raises(ConfigError, match=rule) as err:
        validate(cfg, world_size=world)
    assert "train.global_batch_size=6" in str(err.value) and "Fix:" in str(err.value)


def _engine_bad_count(rank, world):
    import torch
    import torch.distributed as dist

    from megatron_lite.pipeline.engine import forward_backward

    chunks = [torch.nn.Identity(), torch.nn.Identity()]  # vpp=2
    try:
        forward_backward(
            chunks,
            [torch.zeros(1, 5, dtype=torch.long)] * 3,
            lambda chunk, mb, x: chunk(x),
            pp_group=dist.group.WORLD,
            tensor_shape=(4, 1, 8),
            timeout_s=5,
        )
    except ValueError as e:
        return str(e)
    return "no error"


def test_engine_rejects_bad_microbatch_count_without_communicating():
    messages = run_ranks(2, _engine_bad_count, timeout=30)
    for message in messages:
        assert "num_microbatches=3 must be a multiple of pp=2" in message, message


def test_pipeline_trace_and_timeline_tool(tmp_path, capsys):
    out = tmp_path / "run"
    profile = ["train.steps=2", "train.profile_pipeline=true", f"train.out_dir={out}"]
    train_losses(2, [*TIED, "parallel.pp=2", "parallel.vpp=2", *profile], str(tmp_path))
    with open(out / "pipeline_trace.json") as f:
        trace = json.load(f)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert trace["otherData"] == {
        "pp": 2,
        "vpp": 2,
        "step": 1,
        "num_microbatches": 4,
        "schedule": "interleaved",
        "world_size": 2,
    }
    # rank 0 holds virtual stages 0 and 2, rank 1 stages 1 and 3; m=4 microbatches
    p2p = {
        0: {"send_forward": 8, "recv_forward": 4, "send_backward": 4, "recv_backward": 8},
        1: {"send_forward": 4, "recv_forward": 8, "send_backward": 8, "recv_backward": 4},
    }
    for pid, expected in p2p.items():
        kinds = [e["cat"] for e in spans if e["pid"] == pid]
        counts = {k: kinds.count(k) for k in expected}
        assert kinds.count("forward") == kinds.count("backward") == 8, kinds
        assert counts == expected, f"rank {pid}: {counts} != {expected}"
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)

    spec = importlib.util.spec_from_file_location(
        "pipeline_timeline", os.path.join(REPO, "tools", "pipeline_timeline.py")
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(out / "pipeline_trace.json")]) == 0
    text = capsys.readouterr().out
    for part in ("busy", "idle", "measured bubble", "simulated", "(pp-1)/(vpp*m) = 0.1250"):
        assert part in text, f"{part!r} missing from the timeline report:\n{text}"
