"""A hostile user's table for validation data and tokenizer files: every bad input ends in exit
code 2 with one message that names the key or the file, and no traceback, on every entry point
that reads it (train, plan, tools/preprocess_data.py; tools/convert_checkpoint.py reads no
tokenizer). Cases run in-process under capsys."""

import json
import os
import re

import numpy as np
import pytest

from megatron_lite import launch, train
from megatron_lite.data import IndexedDataset, IndexedDatasetBuilder
from megatron_lite.plan.__main__ import main as plan_main

# the autouse fixture that fails a case whose input passes validation and starts training
from tests.unit.test_bad_inputs import _fill, _no_training, preprocess_data  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")

# datasets the fixture writes: name -> documents (token counts) and the largest id + 1
DATASETS = {
    "good": ([100] * 20, 400),
    "low": ([100] * 20, 100),  # ids a 102-token tokenizer covers
    "empty": ([], 400),
    "big": ([100] * 20, 700),
    "one": ([100], 400),
    "tiny": ([10], 400),
}
EVAL = ["train.eval_interval=5"]


def _on(*names):
    return ["data.mock=false", f"data.paths=[{','.join('{tmp}/' + n for n in names)}]"]


# (case id, overrides after --config smoke.yaml, what the message names)
VALID_CASES = [
    # a dataset without documents, as training data, in a blend, as validation data
    ("train-empty", _on("empty"), ["data.paths", "{tmp}/empty.idx"]),
    ("blend-empty", _on("good", "empty"), ["data.paths", "{tmp}/empty.idx"]),
    ("blend-empty-weights", [*_on("good", "empty"), "data.weights=[1,1]"], ["{tmp}/empty.idx"]),
    ("valid-empty", [*_on("good"), "data.valid_paths=[{tmp}/empty]", *EVAL], ["data.valid_paths"]),
    (
        "valid-blend-empty",
        [*_on("good"), "data.valid_paths=[{tmp}/good,{tmp}/empty]", *EVAL],
        ["data.valid_paths", "{tmp}/empty.idx"],
    ),
    # validation ids checked against the vocabulary, as the training data's are
    (
        "valid-beyond-vocab",
        [*_on("good"), "data.valid_paths=[{tmp}/big]", *EVAL],
        ["data.valid_paths", "{tmp}/big.idx", "model.vocab_size"],
    ),
    (
        "valid-beyond-tokenizer",
        [
            *_on("low"),
            "data.valid_paths=[{tmp}/good]",
            "data.tokenizer_model={tmp}/tok/ok/tokenizer.json",
            "model.vocab_size=null",
            *EVAL,
        ],
        ["data.valid_paths", "{tmp}/good.idx"],
    ),
    ("valid-missing", [*_on("good"), "data.valid_paths=[{tmp}/nope]", *EVAL], ["data.valid_paths"]),
    (
        "valid-ext",
        [*_on("good"), "data.valid_paths=[{tmp}/good.idx]", *EVAL],
        ["data.valid_paths"],
    ),
    (
        "valid-bin-dir",
        [*_on("good"), "data.valid_paths=[{tmp}/bindir]", *EVAL],
        ["data.valid_paths", "{tmp}/bindir.bin"],
    ),
    ("valid-int", [*_on("good"), "data.valid_paths=[1]", *EVAL], ["data.valid_paths"]),
    ("valid-too-short", [*_on("good"), "data.valid_paths=[{tmp}/tiny]", *EVAL], ["{tmp}/tiny.bin"]),
    (
        "valid-with-split",
        [*_on("good"), "data.valid_paths=[{tmp}/good]", 'data.split="969,30,1"', *EVAL],
        ["data.split", "data.valid_paths"],
    ),
    ("eval-no-valid-data", [*_on("good"), *EVAL], ["train.eval_interval"]),
    ("eval-interval-negative", [*_on("good"), "train.eval_interval=-1"], ["train.eval_interval"]),
    ("eval-iters-zero", [*_on("good"), "train.eval_iters=0"], ["train.eval_iters"]),
    ("eval-iters-negative", [*_on("good"), "train.eval_iters=-3"], ["train.eval_iters"]),
    ("eval-iters-word", [*_on("good"), "train.eval_iters=all"], ["train.eval_iters"]),
    ("eval-iters-float", [*_on("good"), "train.eval_iters=2.5"], ["train.eval_iters"]),
    # data.split: malformed, or a part a run reads too short for one sample
    *[
        (f"split={s}", [*_on("good"), f"data.split={s}", *EVAL], ["data.split"])
        for s in "abc '' 1,2,3,4 -1,1 nan,1 inf,1 0,0,0 0 1,,1 1;1 0,100,0 0,1 99,1 999,1,0 "
        "1e9,1 100,0.01".split()
    ],
    ("split-one-doc", [*_on("one"), 'data.split="99,1"', *EVAL], ["data.split", "{tmp}/one"]),
    (
        "split-blend",
        [*_on("good", "big"), "model.vocab_size=700", 'data.split="99,1"', *EVAL],
        ["data.split"],
    ),
    ("split-no-eval-no-train", [*_on("good"), 'data.split="0,1"'], ["data.split"]),
    ("split-no-valid-part", [*_on("good"), 'data.split="1,0,1"', *EVAL], ["train.eval_interval"]),
]

# tokenizers: (case id, files written into {tmp}/tok/<id>/ (None: a directory, "->x": a
# dangling symbolic link), the path given (relative to that folder), the file to be named)
OK_JSON = "<ok tokenizer.json>"
TOKENIZER_CASES = [
    ("missing", {}, "tokenizer.json", "tokenizer.json"),
    ("directory", {"tokenizer.json": OK_JSON}, ".", "."),
    ("json-empty", {"tokenizer.json": ""}, "tokenizer.json", "tokenizer.json"),
    ("json-broken", {"tokenizer.json": '{"model": '}, "tokenizer.json", "tokenizer.json"),
    ("json-list", {"tokenizer.json": "[]"}, "tokenizer.json", "tokenizer.json"),
    ("json-no-model", {"tokenizer.json": '{"version": "1.0"}'}, "tokenizer.json", "tokenizer.json"),
    ("json-not-utf8", {"tokenizer.json": b"\xff\xfe{}"}, "tokenizer.json", "tokenizer.json"),
    ("vocab-empty", {"tokenizer.json": "<empty vocab>"}, "tokenizer.json", "tokenizer.json"),
    ("no-eos", {"tokenizer.json": "<no eos>"}, "tokenizer.json", "tokenizer.json"),
    *[
        (
            f"config-{name}",
            {"tokenizer.json": OK_JSON, "tokenizer_config.json": text},
            "tokenizer.json",
            "tokenizer_config.json",
        )
        for name, text in [
            ("garbage", "{not json"),
            ("empty", ""),
            ("list", "[1, 2]"),
            ("string", '"</s>"'),
            ("eos-int", '{"eos_token": 5}'),
            ("eos-empty", '{"eos_token": ""}'),
            ("eos-list", '{"eos_token": ["</s>"]}'),
            ("eos-dict-int", '{"eos_token": {"content": 7}}'),
            ("eos-unknown", '{"eos_token": "<|im_end|>"}'),
            ("eos-unknown-dict", '{"eos_token": {"content": "<eot>"}}'),
            ("not-utf8", b'{"eos_token": "\xff"}'),
            ("directory", None),
            ("dangling-link", "->nowhere.json"),
        ]
    ],
    ("sp-garbage", {"tok.model": "garbage"}, "tok.model", "tok.model"),
    ("sp-empty", {"tok.model": ""}, "tok.model", "tok.model"),
    ("sp-is-json", {"tok.model": OK_JSON}, "tok.model", "tok.model"),
]


def _vocab_json(vocab: dict) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def _write_tokenizers(root: str) -> None:
    words = {f"t{i}": i for i in range(100)}
    texts = {
        OK_JSON: _vocab_json({**words, "<unk>": 100, "</s>": 101}),
        "<empty vocab>": _vocab_json({}),
        "<no eos>": _vocab_json({**words, "<unk>": 100}),
    }
    for case, files, _, _ in [("ok", {"tokenizer.json": OK_JSON}, "", ""), *TOKENIZER_CASES]:
        folder = os.path.join(root, "tok", case)
        os.makedirs(folder)
        for name, content in files.items():
            path = os.path.join(folder, name)
            if content is None:
                os.mkdir(path)
            elif isinstance(content, str) and content.startswith("->"):
                os.symlink(content[2:], path)
            else:
                content = texts.get(content, content)
                with open(path, "wb") as f:
                    f.write(content if isinstance(content, bytes) else content.encode())


def _build(prefix: str, sizes: list[int], top: int) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix) as builder:
        for n in sizes:
            builder.add_document(rng.integers(0, top, n))
    if sizes:
        with IndexedDatasetBuilder(prefix) as builder:  # the largest id is top - 1 exactly
            for n in sizes:
                doc = rng.integers(0, top, n)
                doc[0] = top - 1
                builder.add_document(doc)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("bad_data")
    for name, (sizes, top) in DATASETS.items():
        _build(str(root / name), sizes, top)
    _build(str(root / "bindir"), [100], 400)
    os.remove(root / "bindir.bin")
    os.mkdir(root / "bindir.bin")
    (root / "text.txt").write_text("t1 t2 t3 t4\n" * 50)
    _write_tokenizers(str(root))
    return str(root)


def _train(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        train.main(["--config", SMOKE, *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return e.value.code, err


def _one_error(code: int, err: str) -> None:
    assert code == 2, (code, err)
    assert err.startswith("error: ") and err.strip().count("\n") == 0, err
    assert "Fix:" in err, err


@pytest.mark.parametrize("case, args, named", VALID_CASES, ids=[c[0] for c in VALID_CASES])
def test_bad_validation_data(tmp, capsys, case, args, named):
    code, err = _train(_fill(args, tmp), capsys)
    _one_error(code, err)
    assert all(n.replace("{tmp}", tmp) in err for n in named), err


@pytest.mark.parametrize("split", ["0,100,0", "0,1", "99,1", "999,1,0", "1e9,1"])
def test_the_split_a_message_offers_works(tmp, capsys, split):
    """The fix names a data.split that differs from the bad one, and a run with it starts."""
    code, err = _train([*_fill(_on("good"), tmp), f"data.split={split}", *EVAL], capsys)
    suggested = re.search(r'Fix: data\.split="([^"]+)"', err)
    assert code == 2 and suggested and suggested.group(1) != split, err
    argv = ["--config", SMOKE, *_fill(_on("good"), tmp), f"data.split={suggested[1]}", *EVAL]
    cfg, _, _ = train.prepare(argv)
    assert cfg.data.split == suggested[1]


def test_eval_iters_beyond_the_validation_set_are_capped_with_a_warning(tmp, capsys):
    """The rule (README "Validation loss"): at most the whole global batches the validation
    set holds, at least one; the warning names train.eval_iters and the count evaluated."""
    base = ["--config", SMOKE, *_fill(_on("good"), tmp), *EVAL, "data.split=50,50"]
    cfg, _, _ = train.prepare([*base, "train.eval_iters=100000"])
    err = capsys.readouterr().err
    # 10 validation documents of 100 tokens: 15 samples of 64 + 1, one global batch of 8
    assert cfg.train.eval_iters == 1 and "train.eval_iters=100000" in err, err
    cfg, _, _ = train.prepare([*base, "train.global_batch_size=4", "train.eval_iters=3"])
    assert cfg.train.eval_iters == 3 and capsys.readouterr().err == ""


def _tokenizer(tmp, case, given) -> str:
    return os.path.normpath(os.path.join(tmp, "tok", case, given))


TOK_IDS = [c[0] for c in TOKENIZER_CASES]


@pytest.mark.parametrize("case, files, given, named", TOKENIZER_CASES, ids=TOK_IDS)
def test_bad_tokenizer_in_train(tmp, capsys, case, files, given, named):
    path = _tokenizer(tmp, case, given)
    code, err = _train([*_fill(_on("low"), tmp), f"data.tokenizer_model={path}"], capsys)
    _one_error(code, err)
    assert _tokenizer(tmp, case, named) in err, err


@pytest.mark.parametrize("case, files, given, named", TOKENIZER_CASES, ids=TOK_IDS)
def test_bad_tokenizer_in_plan(tmp, capsys, case, files, given, named):
    path = _tokenizer(tmp, case, given)
    argv = [*_fill(_on("low"), tmp), "model.vocab_size=null", f"data.tokenizer_model={path}"]
    assert plan_main(["--config", SMOKE, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err, (out, err)
    _one_error(2, err)
    assert _tokenizer(tmp, case, named) in err, err


@pytest.mark.parametrize("case, files, given, named", TOKENIZER_CASES, ids=TOK_IDS)
def test_bad_tokenizer_in_preprocess(tmp, capsys, tmp_path, case, files, given, named):
    path = _tokenizer(tmp, case, given)
    out = tmp_path / "out" / "data"
    argv = ["--input", f"{tmp}/text.txt", "--tokenizer-model", path, "--output-prefix", str(out)]
    code = preprocess_data.main([*argv, "--quiet"])
    err = capsys.readouterr().err
    _one_error(code, err)
    assert _tokenizer(tmp, case, named) in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists(), "a failed preprocess must write nothing"


# the launcher prepares the data before torchrun: a sample of both tables through it
LAUNCHED = [c for c in VALID_CASES if c[0] in ("valid-empty", "valid-beyond-vocab", "split=99,1",
            "blend-empty", "valid-with-split")]  # fmt: skip
LAUNCHED += [
    (f"tokenizer-{case}", [*_on("low"), f"data.tokenizer_model={{tmp}}/tok/{case}/{given}"],
     [f"{{tmp}}/tok/{case}/{named}"])
    for case, _, given, named in TOKENIZER_CASES
    if case in ("directory", "vocab-empty", "config-garbage", "config-eos-unknown", "sp-empty")
]  # fmt: skip


@pytest.mark.parametrize("case, args, named", LAUNCHED, ids=[c[0] for c in LAUNCHED])
def test_bad_data_input_in_launch(tmp, capsys, case, args, named):
    with pytest.raises(SystemExit) as e:
        launch.main(["--config", SMOKE, *_fill(args, tmp)])
    err = capsys.readouterr().err
    _one_error(e.value.code, err)
    assert all(os.path.normpath(n.replace("{tmp}", tmp)) in err for n in named), err


def test_ids_beyond_uint16_are_stored_as_int32(tmp, tmp_path):
    """A tokenizer.json with a gap in its ids: the vocabulary is the largest id + 1, and a
    dataset of ids past 65535 is written as int32 and trains like any other."""
    words = {f"t{i}": i for i in range(100)}
    folder = tmp_path / "sparse"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(
        _vocab_json({**words, "<unk>": 100, "</s>": 101, "wide": 70000})
    )
    (tmp_path / "in.txt").write_text("t1 wide t2\n" * 100)
    prefix = str(tmp_path / "wide")
    argv = [
        "--input",
        str(tmp_path / "in.txt"),
        "--tokenizer-model",
        str(folder / "tokenizer.json"),
    ]
    assert preprocess_data.main([*argv, "--output-prefix", prefix, "--quiet"]) == 0
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32 and ds.max_token_id == 70000
    cfg_args = ["--config", SMOKE, "data.mock=false", f"data.paths=[{prefix}]"]
    cfg_args += [f"data.tokenizer_model={folder / 'tokenizer.json'}", "model.vocab_size=null"]
    cfg, _, vocab = train.prepare(cfg_args)
    assert vocab == 70001


def test_a_failed_preprocess_keeps_the_dataset_it_would_replace(tmp, capsys, tmp_path):
    """Tokens go to temporaries renamed into place at the end: a run that fails half-way
    (a bad JSON line after good ones) leaves the existing .bin/.idx byte for byte."""
    prefix = str(tmp_path / "kept")
    _build(prefix, [100] * 5, 100)
    bad = tmp_path / "docs.jsonl"
    bad.write_text(json.dumps({"text": "t1 t2"}) + "\n" + "{broken\n")
    before = {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx")}
    files = sorted(os.listdir(tmp_path))
    tok = _tokenizer(tmp, "ok", "tokenizer.json")
    argv = ["--input", str(bad), "--tokenizer-model", tok, "--output-prefix", prefix, "--quiet"]
    assert preprocess_data.main(argv) == 2
    assert f"{bad}:2" in capsys.readouterr().err
    assert {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx")} == before
    assert sorted(os.listdir(tmp_path)) == files, "temporaries left behind"


def test_a_tokenizer_without_eos_is_refused_unless_no_eos(tmp, capsys, tmp_path):
    import sentencepiece as spm

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"line {i} of words abc def" for i in range(200)))
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(tmp_path / "noeos"),
        vocab_size=40,
        eos_id=-1,
        minloglevel=2,
    )
    model = str(tmp_path / "noeos.model")
    argv = ["--input", str(text), "--tokenizer-model", model, "--quiet"]
    assert preprocess_data.main([*argv, "--output-prefix", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert model in err and "--no-eos" in err, err
    assert preprocess_data.main([*argv, "--no-eos", "--output-prefix", str(tmp_path / "b")]) == 0


def test_the_tables_are_large_enough():
    n = len(VALID_CASES) + 3 * len(TOKENIZER_CASES) + len(LAUNCHED)
    assert n >= 110, n
