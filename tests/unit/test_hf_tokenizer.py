"""Hugging Face tokenizer.json: a BPE built here (no hub), through preprocessing in 1 or 2
worker processes (identical output) and through build_dataset (vocabulary from the file)."""

import json
import os
import random
import subprocess
import sys

import pytest

from megatron_lite.config import Config
from megatron_lite.data import DataFileError, GPTDataset, IndexedDataset, Tokenizer, build_dataset
from megatron_lite.data import preprocess as preprocess_module
from megatron_lite.data.preprocess import preprocess

tokenizers = pytest.importorskip("tokenizers")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 300


def _texts(seed=0, n=400):
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 6))) for _ in range(80)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) for _ in range(n)]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(tokenizer.json path, jsonl corpus path): a byte-level BPE trained on local text."""
    root = tmp_path_factory.mktemp("hf")
    texts = _texts()
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(root / "tokenizer.json"))
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(root / "tokenizer.json"), str(corpus)


def test_tokenizer_json_round_trip(hf):
    tok = Tokenizer(hf[0])
    assert tok.is_hf and tok.vocab_size == VOCAB and tok.eos_id == 0
    text = "abc  def\nghi\tünï 42"
    ids = tok.encode(text)
    assert all(0 <= i < VOCAB for i in ids) and tok.decode(ids) == text
    assert tok.encode_batch([text, "ab"]) == [ids, tok.encode("ab")]


def test_workers_give_identical_files(hf, tmp_path, monkeypatch):
    monkeypatch.setattr(preprocess_module, "_BATCH_CHARS", 2000)  # ~30 batches over 2 workers
    one = preprocess([hf[1]], hf[0], str(tmp_path / "w1"), progress=False, workers=1)
    two = preprocess([hf[1]], hf[0], str(tmp_path / "w2"), progress=False, workers=2)
    for ext in (".bin", ".idx"):
        a, b = (tmp_path / f"w1{ext}").read_bytes(), (tmp_path / f"w2{ext}").read_bytes()
        assert a == b, f"{ext} differs between --workers 1 and 2"
    assert one.documents == two.documents == 400 and one.tokens == two.tokens
    tok, ds = Tokenizer(hf[0]), IndexedDataset(str(tmp_path / "w2"))
    texts = _texts()
    for i in (0, 199, 399):
        assert ds[i].tolist() == tok.encode(texts[i]) + [tok.eos_id], f"document {i}"


def test_build_dataset_takes_vocab_from_tokenizer_json(hf, tmp_path):
    preprocess([hf[1]], hf[0], str(tmp_path / "d"), progress=False)
    cfg = Config()
    cfg.model.seq_length = 16
    cfg.data.paths, cfg.data.tokenizer_model = [str(tmp_path / "d")], hf[0]
    ds, vocab = build_dataset(cfg)
    assert isinstance(ds, GPTDataset) and vocab == VOCAB
    for i in range(0, 50, 7):
        assert ds[i].shape == (17,) and 0 <= ds[i].min() and ds[i].max() < VOCAB


def test_cli_workers_and_tokens_per_second(hf, tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", hf[1]]
    cmd += ["--tokenizer-model", hf[0], "--output-prefix", str(tmp_path / "c"), "--workers", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "400 documents" in r.stdout and "tokens/s" in r.stdout, r.stdout
    assert "100%" in r.stderr, "the progress bar goes to stderr"


def test_tokenizer_json_without_eos_is_an_error(tmp_path):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(special_tokens=["<doc_end>"], show_progress=False)
    tok.train_from_iterator(_texts(n=20), trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataFileError, match="eos_token"):
        Tokenizer(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": {"content": "<doc_end>"}}  # as transformers writes it
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer(str(tmp_path / "tokenizer.json")).eos_id == tok.token_to_id("<doc_end>")
