"""Tokenizer training, preprocessing (function and CLIs), build_dataset's vocabulary checks."""

import json
import os
import random
import subprocess
import sys

import pytest

from megatron_lite.config import Config
from megatron_lite.data import (
    BlendedDataset,
    DataFileError,
    GPTDataset,
    IndexedDataset,
    MockDataset,
    Tokenizer,
    build_dataset,
    train_tokenizer,
)
from megatron_lite.data.preprocess import preprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 320


def _write_text(path, seed=0, lines=1500):
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 7)))
        for _ in range(200)
    ]
    text = "\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(lines))
    path.write_text(text + "\n")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(text file, tokenizer model path) shared by the tests of this module."""
    root = tmp_path_factory.mktemp("tok")
    text = _write_text(root / "train.txt")
    return text, train_tokenizer([text], str(root / "tok"), VOCAB)


def test_tokenizer_round_trip_and_ids(corpus):
    tok = Tokenizer(corpus[1])
    assert tok.vocab_size == VOCAB and tok.eos_id == 2
    text = "abc  def\nghij\tklm ünï 42\n"  # spaces, newlines, tabs and unseen characters
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < VOCAB for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, "ab"]) == [ids, tok.encode("ab")]


def test_tokenizer_training_is_deterministic(corpus, tmp_path):
    again = train_tokenizer([corpus[0]], str(tmp_path / "again"), VOCAB)
    with open(corpus[1], "rb") as f, open(again, "rb") as g:
        assert f.read() == g.read(), "same inputs must give a byte-identical model"
    assert os.path.isfile(tmp_path / "again.vocab")


def test_tokenizer_errors(corpus, tmp_path):
    with pytest.raises(DataFileError, match="lower the vocabulary size"):
        train_tokenizer([corpus[0]], str(tmp_path / "big"), 50000)
    assert not os.path.exists(tmp_path / "big.model")
    with pytest.raises(DataFileError, match="does not exist"):
        Tokenizer(str(tmp_path / "missing.model"))


@pytest.mark.parametrize(
    "split, expected",
    [
        ("file", ["a b\nc d\n\ne f\n"]),
        ("line", ["a b", "c d", "e f"]),
        ("blank_line", ["a b\nc d", "e f"]),
    ],
)
def test_preprocess_split_modes(corpus, tmp_path, split, expected):
    src = tmp_path / "in.txt"
    src.write_text("a b\nc d\n\ne f\n")
    tok = Tokenizer(corpus[1])
    stats = preprocess([str(src)], tok, str(tmp_path / "out"), split=split, progress=False)
    ds = IndexedDataset(str(tmp_path / "out"))
    assert stats.documents == len(ds) == len(expected)
    for i, text in enumerate(expected):
        assert ds[i].tolist() == tok.encode(text) + [tok.eos_id], f"document {i} ({split})"
    assert stats.tokens == ds.num_tokens and stats.max_token_id == ds.max_token_id


def test_preprocess_cli_on_jsonl(corpus, tmp_path):
    texts = ["abc def", "ghij klm nop\nsecond line", "x"]
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(texts)))
    out = tmp_path / "out" / "docs"
    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "preprocess_data.py"),
        "--input",
        str(src),
        "--tokenizer-model",
        corpus[1],
        "--output-prefix",
        str(out),
        "--json-key",
        "body",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "3 documents" in result.stdout
    tok, ds = Tokenizer(corpus[1]), IndexedDataset(str(out))
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) + [tok.eos_id] for t in texts]
    bad = subprocess.run(cmd[:-1] + ["text"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and f"{src}:1: no string field 'text'" in bad.stderr


def test_train_tokenizer_cli(corpus, tmp_path):
    from tools.train_tokenizer import main

    assert (
        main(["--input", corpus[0], "--output-prefix", str(tmp_path / "t"), "--vocab-size", "300"])
        == 0
    )
    assert Tokenizer(str(tmp_path / "t.model")).vocab_size == 300


def _config(**data):
    cfg = Config()
    cfg.model.seq_length = 16
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


@pytest.fixture
def dataset_prefix(corpus, tmp_path):
    preprocess([corpus[0]], corpus[1], str(tmp_path / "d"), split="line", progress=False)
    return str(tmp_path / "d")


def test_build_dataset_paths_and_tokenizer(corpus, dataset_prefix):
    ds, vocab = build_dataset(_config(paths=[dataset_prefix], tokenizer_model=corpus[1]))
    assert isinstance(ds, GPTDataset) and vocab == VOCAB
    assert ds[0].shape == (17,)
    ds, vocab = build_dataset(_config(paths=[dataset_prefix]))  # no tokenizer: max id + 1
    assert vocab == IndexedDataset(dataset_prefix).max_token_id + 1
    ds, _ = build_dataset(_config(paths=[dataset_prefix, dataset_prefix], weights=[1.0, 3.0]))
    assert isinstance(ds, BlendedDataset) and ds.weights == [0.25, 0.75]


def test_build_dataset_mock():
    cfg = _config(mock=True)
    cfg.model.vocab_size = 77
    ds, vocab = build_dataset(cfg)
    assert isinstance(ds, MockDataset) and vocab == 77


def test_model_vocab_smaller_than_tokenizer_is_an_error(corpus, dataset_prefix):
    cfg = _config(paths=[dataset_prefix], tokenizer_model=corpus[1])
    cfg.model.vocab_size = VOCAB - 1
    with pytest.raises(DataFileError) as err:
        build_dataset(cfg)
    msg = str(err.value)
    assert corpus[1] in msg and str(VOCAB - 1) in msg and str(VOCAB) in msg
    assert "Fix: set model.vocab_size" in msg


def test_model_vocab_smaller_than_data_is_an_error(dataset_prefix):
    top = IndexedDataset(dataset_prefix).max_token_id
    cfg = _config(paths=[dataset_prefix])
    cfg.model.vocab_size = top
    with pytest.raises(DataFileError, match=f"{dataset_prefix}.idx.*{top}"):
        build_dataset(cfg)


def test_data_from_another_tokenizer_is_an_error(tmp_path, dataset_prefix):
    small = train_tokenizer([_write_text(tmp_path / "s.txt", seed=1)], str(tmp_path / "s"), 280)
    assert IndexedDataset(dataset_prefix).max_token_id >= 280, "precondition: ids beyond 280"
    with pytest.raises(DataFileError, match="another tokenizer"):
        build_dataset(_config(paths=[dataset_prefix], tokenizer_model=small))


def test_preprocess_keeps_old_dataset_on_bad_input(corpus, tmp_path, dataset_prefix):
    before = IndexedDataset(dataset_prefix)[0].tolist()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataFileError, match=f"{bad}:2"):
        preprocess([str(bad)], corpus[1], dataset_prefix, progress=False)
    assert IndexedDataset(dataset_prefix)[0].tolist() == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "d.bin", "d.idx", "d.maxid.json"]
