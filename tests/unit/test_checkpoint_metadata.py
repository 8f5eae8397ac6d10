"""A hostile user's table of `metadata.json` contents that parse (or nearly) but are not what a
save writes: each is damage like a truncated data file. Named explicitly (verify, as
train.resume=<path> does, and tools/convert_checkpoint.py) it is a CheckpointError (exit 2)
naming the file and the rule, never an AttributeError/KeyError/TypeError; under resume=auto
the checkpoint is passed over for the previous good one and kept. The forked-rank Trainer
cases are in tests/parallel/test_checkpoint_faults.py."""

import copy
import importlib.util
import json
import os

import pytest

from megatron_lite.checkpoint import files
from megatron_lite.checkpoint.errors import CheckpointError
from tests.unit.test_checkpoint_files import fake_save

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "convert_checkpoint", os.path.join(ROOT, "tools", "convert_checkpoint.py")
)
convert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert)


def _set(path, value):
    """A change to the good metadata: set the key at `path` (a tuple) to `value`."""

    def change(meta):
        *parents, last = path
        node = meta
        for key in parents:
            node = node[key]
        node[last] = value
        return meta

    return change


def _drop(key):
    return lambda meta: {k: v for k, v in meta.items() if k != key}


def _first_file(change):
    """Apply `change` to the first row of `files`."""

    def apply(meta):
        name = sorted(meta["files"])[0]
        meta["files"][name] = change(meta["files"][name])
        return meta

    return apply


SHA = "0" * 64
# (case id, how the good metadata.json becomes bad (a function of the dict, or raw bytes), the
# rule the message must name)
CASES = [
    ("json-array", lambda m: [m], "JSON array, not an object"),
    ("json-string", lambda m: "step_4", "JSON string"),
    ("json-null", lambda m: None, "JSON null"),
    ("json-number", lambda m: 4, "JSON number"),
    ("empty-object", lambda m: {}, "has no format, kind, step, files, config, layout"),
    ("no-step", _drop("step"), "has no step"),
    ("no-files", _drop("files"), "has no files"),
    ("no-kind", _drop("kind"), "has no kind"),
    ("no-config", _drop("config"), "has no config"),
    ("no-format", _drop("format"), "has no format"),
    ("format-other", _set(("format",), "megatron_lite.dcp/9"), "format 'megatron_lite.dcp/9'"),
    ("format-number", _set(("format",), 1), "format 1"),
    ("kind-other", _set(("kind",), "optimizer"), "kind='optimizer'"),
    ("kind-null", _set(("kind",), None), "kind=None"),
    ("step-string", _set(("step",), "4"), "step='4'"),
    ("step-negative", _set(("step",), -4), "step=-4"),
    ("step-float", _set(("step",), 4.0), "step=4.0"),
    ("step-bool", _set(("step",), True), "step=True"),
    ("step-other-dir", _set(("step",), 7), "step=7 in the directory step_4"),
    ("consumed-string", _set(("consumed_samples",), "many"), "consumed_samples='many'"),
    ("consumed-negative", _set(("consumed_samples",), -1), "consumed_samples=-1"),
    ("files-list", _set(("files",), ["__0_0.distcp"]), "files is ['__0_0.distcp']"),
    ("files-null", _set(("files",), None), "files is None"),
    ("config-list", _set(("config",), []), "config is [], not an object"),
    ("layout-string", _set(("layout",), "tp2"), "layout is 'tp2'"),
    ("file-row-number", _first_file(lambda row: 1000), "is 1000, not an object"),
    ("file-bytes-string", _first_file(lambda row: {**row, "bytes": "1000"}), "bytes='1000'"),
    ("file-bytes-missing", _first_file(lambda row: {"sha256": SHA}), "bytes=None"),
    ("file-bytes-negative", _first_file(lambda row: {**row, "bytes": -1}), "bytes=-1"),
    ("file-sha-short", _first_file(lambda row: {**row, "sha256": "abc"}), "no valid sha256"),
    ("file-sha-number", _first_file(lambda row: {**row, "sha256": 5}), "no valid sha256"),
    ("file-items-list", _first_file(lambda row: {"bytes": 1, "items": [1]}), "items is [1]"),
    (
        "file-item-shape",
        _first_file(lambda row: {"bytes": 1, "items": {"0": [1]}}),
        "items['0']=[1], which must be [length, sha256]",
    ),
    (
        "file-item-offset",
        _first_file(lambda row: {"bytes": 1, "items": {"x": [1, SHA]}}),
        "items['x']",
    ),
    ("file-name-path", _set(("files", "../../etc/passwd"), {"bytes": 1, "sha256": SHA}), "../"),
    ("file-name-empty", _set(("files", ""), {"bytes": 1, "sha256": SHA}), "files lists ''"),
    ("model-list", _set(("config", "model"), [1]), "config.model is [1]"),
    ("model-layers-string", _set(("config", "model", "num_layers"), "two"), "num_layers='two'"),
    ("model-arch-number", _set(("config", "model", "arch"), 5), "model.arch=5"),
    ("model-tie-string", _set(("config", "model", "tie_embeddings"), "yes"), "tie_embeddings"),
    ("model-eps-inf", _set(("config", "model", "norm_eps"), "inf"), "model.norm_eps"),
    ("train-gbs-string", _set(("config", "train", "global_batch_size"), "8"), "global_batch"),
    ("train-section-number", _set(("config", "train"), 8), "config.train is 8"),
    ("not-json", b'{"kind": "train", "step": 4,', "is not JSON"),
    ("not-utf8", b"\xff\xfe{}", "is not JSON"),
    ("deep-nesting", b"[" * 100000 + b"]" * 100000, "is not JSON"),
]


def _good_meta(step: int) -> dict:
    return {
        "kind": "train",
        "step": step,
        "consumed_samples": 8 * step,
        "layout": {"world_size": 1, "tp": 1},
        "config": {"model": {"arch": "llama", "num_layers": 2}, "train": {"global_batch_size": 8}},
    }


@pytest.fixture
def ckpt(tmp_path) -> str:
    """Checkpoints step_2 and step_4 with whole, real metadata (config, layout)."""
    d = str(tmp_path / "checkpoints")
    for step in (2, 4):
        final = fake_save(d, step)
        meta_file = os.path.join(final, files.METADATA)
        meta = json.load(open(meta_file))
        meta.update(_good_meta(step))
        with open(meta_file, "w") as f:
            json.dump(meta, f)
    files.verify(files.step_dir(d, 4))  # the good one reads
    return d


def _damage(final: str, how) -> str:
    meta_file = os.path.join(final, files.METADATA)
    if isinstance(how, bytes):
        data = how
    else:
        data = json.dumps(how(copy.deepcopy(json.load(open(meta_file))))).encode()
    with open(meta_file, "wb") as f:
        f.write(data)
    return meta_file


@pytest.mark.parametrize("case, how, needle", CASES, ids=[c[0] for c in CASES])
def test_misshapen_metadata_is_damage_named_or_passed_over(ckpt, capsys, case, how, needle):
    newest = files.step_dir(ckpt, 4)
    meta_file = _damage(newest, how)
    with pytest.raises(CheckpointError) as e:  # named explicitly: train.resume=<path>
        files.verify(newest)
    msg = str(e.value)
    assert meta_file in msg and needle in msg and "Fix:" in msg, msg
    assert files.quick_check(newest) is not None  # pruning keeps it for inspection
    path, notes = files.select_auto(ckpt)  # resume=auto: the previous good checkpoint
    assert path == files.step_dir(ckpt, 2), notes
    assert "skipping damaged checkpoint" in notes[0] and meta_file in notes[0], notes
    assert os.path.isfile(meta_file), "the damaged checkpoint was removed"
    # tools/convert_checkpoint.py: exit 2 with the same message, no traceback
    out = os.path.join(os.path.dirname(ckpt), "hf")  # outside the run's checkpoints/
    assert convert.main(["dcp-to-hf", newest, out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and meta_file in err and needle in err, err
    assert not os.path.exists(out), "convert wrote output"


LATEST_CASES = [
    ("garbage", b"\x00\xffnot a step", "not the name of a checkpoint"),
    ("a-path", b"../../elsewhere/step_3\n", "not the name of a checkpoint"),
    ("a-directory", "mkdir", "cannot be read"),
]


@pytest.mark.parametrize("case, how, needle", LATEST_CASES, ids=[c[0] for c in LATEST_CASES])
def test_damaged_latest_is_named_and_auto_does_not_read_it(ckpt, case, how, needle):
    latest = os.path.join(ckpt, files.LATEST)
    os.remove(latest)
    if how == "mkdir":
        os.mkdir(latest)
    else:
        with open(latest, "wb") as f:
            f.write(how)
    with pytest.raises(CheckpointError) as e:  # train.resume=<the checkpoint folder>
        files.resolve(ckpt)
    assert latest in str(e.value) and needle in str(e.value) and "Fix:" in str(e.value)
    assert files.select_auto(ckpt)[0] == files.step_dir(ckpt, 4)


def test_metadata_table_is_large_enough():
    assert len(CASES) + len(LATEST_CASES) >= 40


def test_a_model_checkpoint_may_live_in_any_directory_name(tmp_path):
    """tools/convert_checkpoint.py writes kind "model", step 0, wherever it is told (even a
    directory named step_5): only a train save's step must match its step_<N>."""
    final = fake_save(str(tmp_path), 5)
    meta_file = os.path.join(final, files.METADATA)
    meta = json.load(open(meta_file))
    meta.update(kind="model", step=0, config={"model": {}}, layout={"world_size": 1})
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    assert files.verify(final)["step"] == 0


@pytest.mark.parametrize(
    "key, saved, now",
    [
        ("moe_router_norm_topk", True, None),  # a converted Mixtral loaded without the key
        ("moe_router_score_function", "sigmoid", "softmax"),
        ("moe_router_topk_scaling_factor", 2.5, None),
        ("moe_router_group_topk", 2, None),
        ("moe_router_group_score", "top2", "topk_per_group"),
    ],
)
def test_routing_settings_must_match_the_checkpoint(key, saved, now):
    """Routing settings change what the same weights compute: a mismatch with the saved
    model config is an error naming the key and the saved value (shapes cannot show it)."""
    from types import SimpleNamespace

    from megatron_lite.checkpoint.load import Loader
    from megatron_lite.config import load_config

    cfg = load_config(None, [f"model.{key}={json.dumps(now)}"])
    with pytest.raises(CheckpointError, match=rf"model\.{key}=.*Fix: set model\.{key}="):
        Loader._check_model_config(SimpleNamespace(cfg=cfg), "ckpt/step_5", {key: saved})
    Loader._check_model_config(SimpleNamespace(cfg=cfg), "ckpt/step_5", {key: now})  # equal
