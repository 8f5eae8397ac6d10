"""Sharded checkpoints with the real Trainer on forked gloo ranks.

An unbroken 10-step run saves at step 5; a second run resumes from that checkpoint and trains
steps 5..9. On the same layout its losses equal the unbroken run's bitwise (sync save with
dropout, async save); on another layout (tp, dp, sp, pp, cp, ep changed, world size 2 -> 1)
they match within 1e-4 relative. A crash between the DCP write and the rename leaves the
previous checkpoint usable; a damaged file is reported by name and resume=auto falls back past
it; SIGUSR1 on one rank stops every rank at the next step boundary after saving.
"""

import importlib.util
import os

import pytest

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY, max_rel_diff, structured_dataset

LLAMA = ["model.arch=llama"]  # tied embeddings, vocabulary 250 padded to 256 at tp=2
GPT = ["model.arch=gpt", "model.tie_embeddings=false"]  # biases in qkv segments, positions
MOE = ["model.arch=llama", "model.num_experts=4", "model.moe_router_topk=2"]
# the straight run: STEPS steps saving at AT (and after the last); a resume trains AT..STEPS-1
STEPS, AT = 10, 5
SAVE = [f"train.steps={STEPS}", f"train.save_interval={AT}"]


def _has(module: str) -> bool:
    """Feature present (pipeline, CP and MoE are written concurrently with checkpointing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its package is there but does not import
        return False


def _train(rank, world, overrides, out_dir, mode):
    """Train with the real Trainer; rank 0 returns [(step, loss, ckpt_blocked_s)].
    mode "crash10": the commit (rename) of step 10's checkpoint raises after the DCP write;
    mode "signal3": rank 1 sends itself SIGUSR1 during step index 3;
    mode "ioerror": rank 1 cannot read any checkpoint (PermissionError while verifying)."""
    import signal

    import torch.distributed as dist

    from megatron_lite.checkpoint import files as checkpoint_files
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    if mode == "crash10":
        commit = checkpoint_files.commit

        def crash(tmp, final, meta, table=None):
            if final.endswith("step_10"):
                raise RuntimeError("simulated crash after the DCP write, before the rename")
            commit(tmp, final, meta, table)

        checkpoint_files.commit = crash
    if mode == "ioerror" and rank == 1:

        def unreadable(path, *_):
            raise PermissionError(13, "Permission denied", path)

        checkpoint_files.verify_reads = unreadable
    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    p = cfg.parallel
    mesh = ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, order=p.order))
    trainer = Trainer(cfg, mesh, dataset, vocab)
    if mode == "signal3" and rank == 1:
        step = trainer.train_step

        def signalling_step():
            if trainer.step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)
            return step()

        trainer.train_step = signalling_step
    records = trainer.train()
    out = [(r["step"], r["loss"], r.get("ckpt_blocked_s")) for r in records]
    return out if dist.get_rank() == 0 or mode == "signal3" else None


def train(world, overrides, out_dir, mode="", timeout=120):
    data = f"data.paths=[{structured_dataset()}]"
    args = [*TINY, data, *overrides]
    return run_ranks(world, _train, args, str(out_dir), mode, timeout=timeout)


def ckpt(run_dir, step=AT) -> str:
    return f"train.resume={os.path.join(run_dir, 'checkpoints', f'step_{step}')}"


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory):
    """Unbroken STEPS steps on tp=2 (sync save at AT and STEPS): (run dir, records)."""
    d = tmp_path_factory.mktemp("llama_tp2")
    return d, train(2, [*LLAMA, "parallel.tp=2", *SAVE], d)[0]


@pytest.fixture(scope="module")
def gpt_dp2(tmp_path_factory):
    """Unbroken STEPS steps on dp=2 with async save at AT and STEPS."""
    d = tmp_path_factory.mktemp("gpt_dp2")
    return d, train(2, [*GPT, *SAVE, "train.async_save=true"], d)[0]


def losses(records):
    return [loss for _, loss, _ in records]


def check_resume(base, world, overrides, tmp_path, exact):
    run_dir, full = base
    got = train(world, [*overrides, f"train.steps={STEPS}", ckpt(run_dir)], tmp_path)[0]
    assert [s for s, _, _ in got] == list(range(AT, STEPS)), f"resume did not continue at {AT}"
    diff = max_rel_diff(losses(got), losses(full[AT:]))
    print(f"RESUME {overrides}: max rel diff {diff:.2e}")
    if exact:
        assert losses(got) == losses(full[AT:]), f"not bitwise: max rel diff {diff:.2e}"
    assert diff < 1e-4, f"{overrides}: resumed losses differ by {diff:.2e}"


def test_checkpoint_layout_on_disk(llama_tp2):
    run_dir, records = llama_tp2
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    assert sorted(os.listdir(ckpt_dir)) == ["latest", "step_10", "step_5"]
    assert open(os.path.join(ckpt_dir, "latest")).read().strip() == "step_10"
    files = set(os.listdir(os.path.join(ckpt_dir, "step_10")))
    assert {"metadata.json", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= files
    assert [b is not None for _, _, b in records] == [
        i in (AT - 1, STEPS - 1) for i in range(STEPS)
    ]


@pytest.mark.slow  # the suite's budget: CI's slow tier runs it
def test_exact_resume_with_dropout(tmp_path):
    """Same layout: AdamW state, step and every rank's RNG states (default generator and the
    TP tracker's, here drawing dropout masks under SP) continue exactly."""
    layout = [*LLAMA, "parallel.tp=2", "parallel.sequence_parallel=true"]
    layout += ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    base = tmp_path / "base"
    full = train(2, [*layout, *SAVE], base)[0]
    check_resume((base, full), 2, layout, tmp_path / "resumed", exact=True)


def test_exact_resume_after_async_save(gpt_dp2, tmp_path):
    _, records = gpt_dp2
    blocked = [b for _, _, b in records if b is not None]
    print(f"ASYNC SAVE blocked the step for {', '.join(f'{b * 1e3:.0f} ms' for b in blocked)}")
    check_resume(gpt_dp2, 2, GPT, tmp_path, exact=True)


def test_reshard_tp2_to_one_rank(llama_tp2, tmp_path):
    check_resume(llama_tp2, 1, LLAMA, tmp_path, exact=False)


def test_reshard_dp2_to_tp2_sp(gpt_dp2, tmp_path):
    layout = ["parallel.tp=2", "parallel.sequence_parallel=true"]
    check_resume(gpt_dp2, 2, [*GPT, *layout], tmp_path, exact=False)


@pytest.mark.skipif(not _has("megatron_lite.pipeline.engine"), reason="no pipeline engine")
def test_reshard_tp2_to_pp2(llama_tp2, tmp_path):
    check_resume(llama_tp2, 2, [*LLAMA, "parallel.pp=2"], tmp_path, exact=False)


@pytest.mark.slow  # the suite's budget: CI's slow tier runs it
def test_zb_v_resumes_exactly_and_on_one_rank(tmp_path):
    """ZB-V's V placement holds the tied embedding and its output-layer copy on one rank (both
    stored once, as the embedding): the same layout resumes bitwise, one rank within 1e-4, and
    ZeRO-3 on dp2 (both copies FSDP2 shards on rank 0 of each pipeline) within 1e-4."""
    layout = [*LLAMA, "parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_schedule=zb-v"]
    base = tmp_path / "zb_v"
    full = train(2, [*layout, *SAVE], base)[0]
    check_resume((base, full), 2, layout, tmp_path / "same", exact=True)
    check_resume((base, full), 1, LLAMA, tmp_path / "one", exact=False)
    zero3 = [*layout, "parallel.zero_stage=3"]
    check_resume((base, full), 4, zero3, tmp_path / "zero3", exact=False)


@pytest.mark.skipif(not _has("megatron_lite.context.ulysses"), reason="no context parallel")
def test_reshard_tp2_to_cp2(llama_tp2, tmp_path):
    check_resume(llama_tp2, 2, [*LLAMA, "parallel.cp=2"], tmp_path, exact=False)


@pytest.mark.skipif(not _has("megatron_lite.moe.layer"), reason="no MoE layer")
def test_reshard_moe_ep2_to_one_rank(tmp_path):
    base = tmp_path / "ep2"
    full = train(2, [*MOE, "parallel.ep=2", *SAVE], base)[0]
    check_resume((base, full), 1, MOE, tmp_path / "ep1", exact=False)


def test_crash_during_save_and_damaged_file(llama_tp2, tmp_path):
    """The step-10 save (tp=2, every 3 steps) dies on rank 0 before its rename: both ranks stop
    with an error (no hang), step_9 (`latest`) and step_6 survive. With step_9 damaged, an
    explicit resume names the file; resume=auto falls back to step_6 (resumed on one rank)."""
    run = tmp_path / "crashed"
    every_3 = [*LLAMA, "parallel.tp=2", f"train.steps={STEPS}", "train.save_interval=3"]
    with pytest.raises(RuntimeError, match="simulated crash|failed on another rank"):
        train(2, every_3, run, mode="crash10")
    ckpt_dir = run / "checkpoints"
    assert sorted(os.listdir(ckpt_dir)) == [".tmp-step_10", "latest", "step_6", "step_9"]
    os.truncate(ckpt_dir / "step_9" / "__1_0.distcp", 100)
    with pytest.raises(RuntimeError, match=r"step_9/__1_0\.distcp is truncated"):
        train(1, [*LLAMA, f"train.steps={STEPS}", ckpt(run, 9)], tmp_path / "explicit")
    got = train(
        1, [*LLAMA, f"train.steps={STEPS}", f"train.ckpt_dir={ckpt_dir}"], tmp_path / "auto"
    )[0]
    assert [s for s, _, _ in got] == list(range(6, STEPS)), "auto did not fall back to step 6"
    diff = max_rel_diff(losses(got), losses(llama_tp2[1][6:]))
    assert diff < 1e-4, f"resumed after the crash, losses differ by {diff:.2e}"


def test_unreadable_checkpoint_stops_resume_instead_of_falling_back(llama_tp2, tmp_path):
    """An I/O error on one rank is not damage: resume=auto must not skip the good checkpoints
    (or start from scratch); every rank stops with the error naming the rank."""
    ckpt_dir = llama_tp2[0] / "checkpoints"
    before = sorted(os.listdir(ckpt_dir))
    overrides = [*LLAMA, "parallel.tp=2", f"train.ckpt_dir={ckpt_dir}", "train.steps=30"]
    with pytest.raises(
        RuntimeError, match="CheckpointReadError: checksum check on rank 1: PermissionError"
    ):
        train(2, overrides, tmp_path, mode="ioerror")
    assert sorted(os.listdir(ckpt_dir)) == before


def test_signal_on_one_rank_saves_and_stops_all(tmp_path):
    out = train(2, [*LLAMA, "parallel.tp=2", "train.save_interval=100"], tmp_path, mode="signal3")
    for rank, records in enumerate(out):
        assert [s for s, _, _ in records] == [0, 1, 2, 3], f"rank {rank} did not stop after step 4"
    assert out[0][-1][2] is not None, "no checkpoint was saved on the signal"
    latest = open(tmp_path / "checkpoints" / "latest").read().strip()
    assert latest == "step_4"


def _second_dataset(directory) -> str:
    """Another learnable dataset (descending progressions) to blend with the structured one."""
    import numpy as np

    from megatron_lite.data import IndexedDatasetBuilder

    prefix = os.path.join(str(directory), "down")
    rng = np.random.default_rng(1)
    with IndexedDatasetBuilder(prefix) as builder:
        for _ in range(200):
            start, step, n = rng.integers(0, 249), rng.integers(1, 5), rng.integers(20, 90)
            builder.add_document((start - step * np.arange(n)) % 249)
    return prefix


def test_exact_resume_with_blending_and_validation(tmp_path):
    """Blended datasets, a train/valid split with evaluation every 5 steps and ZeRO-1 on dp=2:
    5 steps + resume + 5 steps give bitwise the losses of 10 straight steps."""
    from tests.parallel.parity import structured_dataset

    data = f"data.paths=[{structured_dataset()},{_second_dataset(tmp_path)}]"
    layout = [data, "data.weights=[0.7,0.3]", 'data.split="90,10,0"', "train.eval_interval=5",
              "parallel.zero_stage=1"]  # fmt: skip
    base = tmp_path / "base"
    full = train(2, [*layout, *SAVE], base)[0]
    check_resume((base, full), 2, layout, tmp_path / "resumed", exact=True)


def _slow_writes(rank, world, overrides, out_dir):
    """Rank 1 takes 3.5 s to write its checkpoint files, longer than parallel.timeout_s=2."""
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    if rank == 1:
        write = FileSystemWriter.write_data

        def slow(self, plan, planner):
            time.sleep(3.5)
            return write(self, plan, planner)

        FileSystemWriter.write_data = slow
    return _train(rank, world, overrides, out_dir, "")


@pytest.mark.slow  # in CI's slow tier (bash tests/run.sh -m slow): keeps the suite under 10 min
def test_async_save_slower_than_the_timeout_completes(tmp_path):
    """An async save whose writing outlasts parallel.timeout_s finishes on every rank (its
    collectives have train.async_save_timeout_s), and the checkpoint verifies and resumes."""
    from tests.parallel.parity import structured_dataset

    args = [*TINY, f"data.paths=[{structured_dataset()}]", *GPT, "train.save_interval=3",
            "train.steps=3", "train.async_save=true", "parallel.timeout_s=2"]  # fmt: skip
    records = run_ranks(2, _slow_writes, args, str(tmp_path), timeout=120)[0]
    assert [s for s, _, _ in records] == list(range(3)), records
    step4 = os.path.join(tmp_path, "checkpoints", "step_3")
    from megatron_lite.checkpoint import files

    files.verify(step4)  # every file's checksum, hashed by the rank that wrote it
    assert not [n for n in os.listdir(step4) if n.startswith(".sha256")]
