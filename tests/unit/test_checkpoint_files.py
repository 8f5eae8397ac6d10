"""Checkpoint files without processes: atomic commit, `latest`, pruning, checksum verification
(damaged / truncated files reported by name), resume=auto fallback, and how parameter shards
map to logical tensors (every element stored exactly once, by exactly one rank)."""

import math
import os
from types import SimpleNamespace

import pytest
import torch

from megatron_lite.checkpoint import files
from megatron_lite.checkpoint.chunks import chunks_of, flat_boxes
from megatron_lite.checkpoint.errors import CheckpointError
from megatron_lite.checkpoint.state import param_pieces, writer_names
from megatron_lite.parallel.mesh import RankLayout
from megatron_lite.parallel.params import ParamMeta, shard


def fake_save(ckpt_dir: str, step: int, keep: int = 2) -> str:
    """What rank 0 does after the DCP write: two data files, commit, latest, prune."""
    tmp, final = files.tmp_dir(ckpt_dir, step), files.step_dir(ckpt_dir, step)
    os.makedirs(tmp)
    for rank in range(2):
        with open(os.path.join(tmp, f"__{rank}_0.distcp"), "wb") as f:
            f.write(os.urandom(1000 + rank))
    files.commit(tmp, final, {"kind": "train", "step": step, "config": {}, "layout": {}})
    files.set_latest(ckpt_dir, final)
    files.prune(ckpt_dir, keep)
    return final


def test_commit_latest_and_keep(tmp_path):
    d = str(tmp_path)
    for step in (10, 20, 30):
        fake_save(d, step)
    assert [s for s, _ in files.list_checkpoints(d)] == [30, 20]
    assert files.read_latest(d) == files.step_dir(d, 30)
    assert sorted(os.listdir(d)) == ["latest", "step_20", "step_30"]
    meta = files.verify(files.step_dir(d, 30))
    assert meta["step"] == 30 and set(meta["files"]) == {"__0_0.distcp", "__1_0.distcp"}
    assert files.resolve(d) == files.step_dir(d, 30)


def test_checksums_split_across_ranks_cover_every_file_once(tmp_path):
    """Each rank hashes / verifies a round-robin share: the shares partition the files, and
    a damaged file is caught by exactly the rank whose share holds it."""
    final = fake_save(str(tmp_path), 10)
    full = files.file_table(final)
    for world in (1, 2, 3):
        parts = [files.file_table(final, (r, world)) for r in range(world)]
        assert sum(len(p) for p in parts) == len(full)
        assert {k: v for p in parts for k, v in p.items()} == full
    damaged = files.share(full, (1, 2))[0]
    with open(os.path.join(final, damaged), "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))  # same size, one byte flipped
    files.verify(final, (0, 2))
    with pytest.raises(CheckpointError, match=f"{damaged} is damaged: sha256 mismatch"):
        files.verify(final, (1, 2))


def test_crash_before_rename_leaves_previous_checkpoint(tmp_path):
    d = str(tmp_path)
    fake_save(d, 10)
    os.makedirs(files.tmp_dir(d, 20))  # a save that died after writing its data
    with open(os.path.join(files.tmp_dir(d, 20), "__0_0.distcp"), "wb") as f:
        f.write(b"partial")
    path, notes = files.select_auto(d)
    assert path == files.step_dir(d, 10) and notes == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_file_is_named_and_auto_falls_back(tmp_path, damage):
    d = str(tmp_path)
    fake_save(d, 10)
    newest = fake_save(d, 20)
    victim = os.path.join(newest, "__1_0.distcp")
    if damage == "truncate":
        os.truncate(victim, 10)
    elif damage == "flip":
        data = bytearray(open(victim, "rb").read())
        data[500] ^= 0xFF
        open(victim, "wb").write(bytes(data))
    else:
        os.remove(victim)
    with pytest.raises(CheckpointError, match="__1_0.distcp"):
        files.verify(newest)
    path, notes = files.select_auto(d)
    assert path == files.step_dir(d, 10)
    assert "__1_0.distcp" in notes[0] and "falling back" in notes[-1], notes


def test_missing_metadata_and_nothing_valid(tmp_path):
    d = str(tmp_path)
    os.makedirs(os.path.join(d, "step_5"))
    with pytest.raises(CheckpointError, match="metadata.json does not exist"):
        files.verify(os.path.join(d, "step_5"))
    with pytest.raises(CheckpointError, match=r"none of the 1 checkpoints .* step_5: .*metadata"):
        files.select_auto(d)  # starting from scratch would save over it
    assert os.path.isdir(os.path.join(d, "step_5")), "the damaged checkpoint was removed"
    assert files.select_auto(str(tmp_path / "nothing-here")) == (None, [])


# ------------------------------------------------------------------ shards -> logical tensors
def metas(tp: int, rank: int) -> dict[str, ParamMeta]:
    kw = dict(tp_rank=rank, tp_size=tp)
    return {
        "layers.0.self_attention.linear_qkv.weight": ParamMeta(
            (16 + 8 + 8, 16), tp_dim=0, segments=(16, 8, 8), **kw
        ),
        "layers.0.mlp.linear_fc1.bias": ParamMeta((24,), tp_dim=0, segments=(12, 12), **kw),
        "layers.0.mlp.linear_fc2.weight": ParamMeta((16, 12), tp_dim=1, **kw),
        "layers.0.input_norm.weight": ParamMeta((16,)),
        "embedding.weight": ParamMeta((13, 16), tp_dim=0, padded=16, **kw),  # 3 pad rows
        "layers.1.mlp.experts.weight1": ParamMeta((4, 6, 16), tp_dim=0, is_expert=True, **kw),
    }


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_pieces_reassemble_the_full_tensor(tp):
    """Each rank's pieces, cut from its real shard (params.shard), land at their offsets of the
    logical tensors; together they cover each logical tensor exactly once."""
    logical: dict[str, torch.Tensor] = {}
    count: dict[str, torch.Tensor] = {}
    fulls = {}
    for rank in range(tp):
        for name, meta in metas(tp, rank).items():
            if meta.tp_dim is None and rank > 0:  # replicated: rank 0's copy suffices
                continue
            full = fulls.setdefault(name, torch.randn(meta.full_shape))
            local = shard(full, meta)
            for piece in param_pieces(name, meta):
                out = logical.setdefault(piece.key, torch.full(piece.global_shape, float("nan")))
                seen = count.setdefault(piece.key, torch.zeros(piece.global_shape))
                block = tuple(
                    slice(o, o + n)
                    for o, n in zip(piece.offsets, piece.local(local).shape, strict=True)
                )
                out[block] = piece.local(local)
                seen[block] += 1
    qkv = fulls["layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(logical["layers.0.self_attention.linear_qkv.weight/k"], qkv[16:24])
    assert torch.equal(
        logical["layers.0.mlp.linear_fc1.bias/up"], fulls["layers.0.mlp.linear_fc1.bias"][12:]
    )
    assert torch.equal(logical["embedding.weight"], fulls["embedding.weight"])  # no padding
    assert torch.equal(
        logical["layers.0.mlp.linear_fc2.weight"], fulls["layers.0.mlp.linear_fc2.weight"]
    )
    assert torch.equal(
        logical["layers.1.mlp.experts.weight1"], fulls["layers.1.mlp.experts.weight1"]
    )
    for key, seen in count.items():
        assert torch.all(seen == 1), f"{key}: elements stored {seen.unique().tolist()} times"


@pytest.mark.parametrize("tp", [1, 2])
def test_chunks_of_any_flat_ranges_tile_the_logical_tensors(tp):
    """Cut each rank's flattened shard at arbitrary points (ZeRO's bucket shards, FSDP2's
    rows): the chunks of the ranges, as views of the ranges' tensors, land at their offsets of
    the logical tensors and cover each exactly once (padding in none)."""
    gen = torch.Generator().manual_seed(0)
    logical, count, fulls = {}, {}, {}
    for rank in range(tp):
        for name, meta in metas(tp, rank).items():
            if meta.tp_dim is None and rank > 0:
                continue
            full = fulls.setdefault(name, torch.randn(meta.full_shape))
            local = shard(full, meta)
            n = local.numel()
            cuts = sorted({0, n, *torch.randint(0, n, (3,), generator=gen).tolist()})
            for lo, hi in zip(cuts, cuts[1:], strict=False):
                held = local.reshape(-1)[lo:hi].clone()  # what a rank holds of the range
                for c in chunks_of(name, meta, tuple(local.shape), lo, hi):
                    out = logical.setdefault(c.key, torch.full(c.global_shape, float("nan")))
                    seen = count.setdefault(c.key, torch.zeros(c.global_shape))
                    box = tuple(slice(o, o + z) for o, z in zip(c.offsets, c.sizes, strict=True))
                    out[box] = c.view(held, lo)  # as_strided refuses a view past `held`
                    seen[box] += 1
    for name, full in fulls.items():
        if name.endswith("qkv.weight"):
            got = torch.cat([logical[f"{name}/{s}"] for s in "qkv"])
        elif name.endswith("fc1.bias"):
            got = torch.cat([logical[f"{name}/{s}"] for s in ("gate", "up")])
        else:
            got = logical[name]
        assert torch.equal(got, full), f"{name}: chunks do not reassemble the logical tensor"
    for key, seen in count.items():
        assert torch.all(seen == 1), f"{key}: elements stored {seen.unique().tolist()} times"


def test_flat_boxes_are_few_and_in_order():
    """A flat range of a [4, 3, 5] tensor is at most 2·ndim - 1 boxes, in element order."""
    shape = (4, 3, 5)
    for lo in range(60):
        for hi in range(lo + 1, 61):
            boxes = flat_boxes(shape, lo, hi)
            assert len(boxes) <= 5, (lo, hi, boxes)
            flat = []
            for start, sizes in boxes:
                idx = torch.arange(60).reshape(shape)
                block = idx[tuple(slice(s, s + z) for s, z in zip(start, sizes, strict=True))]
                flat += block.reshape(-1).tolist()
            assert flat == list(range(lo, hi)), (lo, hi, boxes)


def _mesh(tp_rank: int, dp_cp_rank: int, edp_rank: int, tp=2, dp_cp=2, edp=1) -> SimpleNamespace:
    """The coordinates of ParallelMesh that the writer rules read."""
    return SimpleNamespace(
        tp=SimpleNamespace(rank=tp_rank, size=tp),
        dp_cp=SimpleNamespace(rank=dp_cp_rank, size=dp_cp),
        edp=SimpleNamespace(rank=edp_rank, size=edp),
    )


def test_one_writer_per_piece():
    """On tp2 x dp2 x pp2 with ep2, each (stage, piece) is written by exactly one rank, and every
    rank writes a share (Megatron's fully parallel save)."""
    layout = RankLayout(8, tp=2, pp=2, ep=2)
    writers: dict[tuple, list[int]] = {}
    written = [0] * 8
    for rank in range(8):
        c = layout.coords(rank)
        mesh = _mesh(c["tp"], c["dp_cp"], c["edp"])
        stage = metas(2, c["tp"])
        for meta in stage.values():
            if meta.is_expert:
                meta.tp_rank, meta.tp_size = c["ep"], 2
        sizes = [(n, m, math.prod(m.full_shape)) for n, m in stage.items()]
        mine = writer_names(sizes, mesh)
        for name, meta in stage.items():
            if name in mine:
                written[rank] += 1
                for piece in param_pieces(name, meta):
                    writers.setdefault((c["pp"], piece.key, piece.offsets), []).append(rank)
    tied = ParamMeta((13, 16), tp_dim=0, padded=16, tied_copy=True, init_name="embedding.weight")
    assert not writer_names([("output_layer.weight", tied, 128)], _mesh(0, 0, 0))
    assert all(len(r) == 1 for r in writers.values()), writers
    assert len({k for _, k, _ in writers}) == 9  # qkv 3, fc1 bias 2, fc2, norm, emb, experts
    assert all(n >= 1 for n in written), written


# ------------------------------------------------------------------ config keys
@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.save_interval=-1", "train.save_interval=-1: must be >= 0"),
        ("train.keep_checkpoints=0", "train.keep_checkpoints=0: must be >= 1"),
        ("train.resume=/no/such/ckpt", "must be auto, none or an existing checkpoint path"),
        ("train.init_from=/no/such/ckpt", "must be an existing checkpoint directory"),
    ],
)
def test_checkpoint_config_errors(override, needle):
    from megatron_lite.config import ConfigError, load_config
    from megatron_lite.validation import validate

    cfg = load_config(None, ["data.mock=true", "model.vocab_size=128", override])
    with pytest.raises(ConfigError, match="Fix: ") as e:
        validate(cfg, 1)
    assert needle in str(e.value)


def test_init_from_a_hf_directory_says_convert_first(tmp_path):
    from megatron_lite.config import ConfigError, load_config
    from megatron_lite.validation import validate

    (tmp_path / "config.json").write_text("{}")
    cfg = load_config(
        None, ["data.mock=true", "model.vocab_size=128", f"train.init_from={tmp_path}"]
    )
    with pytest.raises(ConfigError, match="convert_checkpoint.py hf-to-dcp"):
        validate(cfg, 1)


def test_each_rank_checksums_the_file_it_wrote():
    names = [".metadata", *(f"__{r}_0.distcp" for r in range(4))]
    shares = [files.share(names, (r, 4)) for r in range(4)]
    assert all(f"__{r}_0.distcp" in shares[r] for r in range(4)), shares
    assert sorted(n for s in shares for n in s) == sorted(names)  # each file once


def test_item_checksums_check_exactly_what_a_rank_reads(tmp_path):
    """Per-item sha256 (DCP's stored items): verify_reads hashes only the ranges it is given,
    so damage is caught by the rank that reads the damaged item, and by a whole verify."""
    d = str(tmp_path / "step_1")
    os.makedirs(d)
    data = os.path.join(d, "__0_0.distcp")
    with open(data, "wb") as f:
        f.write(os.urandom(300))
    ranges = {"__0_0.distcp": [(0, 100), (100, 150), (250, 50)]}
    table = files.file_table(d, ranges=ranges)
    assert set(table["__0_0.distcp"]["items"]) == {"0", "100", "250"}
    os.rename(d, d + ".tmp")
    files.commit(d + ".tmp", d, {"kind": "train", "step": 1, "config": {}, "layout": {}}, table)
    with open(data, "r+b") as f:
        f.seek(120)
        byte = f.read(1)
        f.seek(120)
        f.write(bytes([byte[0] ^ 0xFF]))  # inside the item at 100
    files.verify_reads(d, {"__0_0.distcp": [(0, 100), (250, 50)]})  # reads around the damage
    with pytest.raises(CheckpointError, match="sha256 mismatch in the item at byte 100"):
        files.verify_reads(d, {"__0_0.distcp": [(100, 150)]})
    with pytest.raises(CheckpointError, match="item at byte 100"):
        files.verify(d)
    with pytest.raises(CheckpointError, match="no checksummed item of 10 bytes at 5"):
        files.verify_reads(d, {"__0_0.distcp": [(5, 10)]})
