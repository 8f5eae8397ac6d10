"""Preprocessing speed and peak memory: about 1 GB of Parquet beside the same JSON lines.

    python tools/bench_preprocess.py                 # 1 GB of Parquet
    python tools/bench_preprocess.py --gb 0.2 --workers 2

Builds deterministic synthetic documents (Zipf-distributed pseudo-words, lengths log-normal
around 3 KB, each a distinct slice of a 64 MB pool) in a temporary directory that it deletes at
the end: Parquet shards (snappy, row groups of --row-group-mb MB of text, so much larger than
what the reader holds) until they reach --gb GB, and the same documents as one plain .jsonl.
It trains a byte-level BPE tokenizer on the pool, then, each in a child process:
  - reads every document without tokenizing (the readers' own speed),
  - runs tools/preprocess_data.py on the Parquet glob and on the .jsonl,
and prints wall time, MB/s (of the text, the same for both, and of the files), tokens/s and
peak RSS, both the largest process's (getrusage of the reaped child: its own peak or a worker's)
and the peak of the process tree's sum (sampled from /proc every 0.2 s), and checks that both
datasets are byte-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing

import numpy as np  # noqa: E402

POOL_BYTES = 64 << 20  # the text documents are sliced from
VOCAB_WORDS = 30000
MEAN_DOC_CHARS = 3000


def _pool(seed: int) -> bytes:
    """POOL_BYTES of space-separated pseudo-words, Zipf-distributed like a language's."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", np.uint8)
    freq = 1.0 / np.arange(1, 27) ** 0.9
    lengths = rng.integers(1, 11, VOCAB_WORDS)
    words = [bytes(rng.choice(letters, n, p=freq / freq.sum())) + b" " for n in lengths.tolist()]
    weights = 1.0 / np.arange(1, VOCAB_WORDS + 1)
    ids = rng.choice(VOCAB_WORDS, POOL_BYTES // 6, p=weights / weights.sum())
    return b"".join(words[i] for i in ids.tolist())[:POOL_BYTES]


def _documents(pool: bytes, seed: int):
    """Endless distinct documents: 'doc N.' and a slice of the pool starting at a word."""
    rng = np.random.default_rng(seed + 1)
    n = 0
    while True:
        starts = rng.integers(0, len(pool) - 200_000, 4096).tolist()
        sizes = np.clip(rng.lognormal(np.log(MEAN_DOC_CHARS) - 0.5, 1.0, 4096), 50, 150_000)
        for start, size in zip(starts, sizes.astype(int).tolist(), strict=True):
            start = pool.index(b" ", start) + 1
            yield f"doc {n}. ".encode() + pool[start : start + size].rstrip()
            n += 1


def build_inputs(root: str, gb: float, row_group_mb: int, shard_mb: int, seed: int) -> dict:
    """Parquet shards of about `gb` GB in all and the same documents as one .jsonl."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pool = _pool(seed)
    docs = _documents(pool, seed)
    os.makedirs(os.path.join(root, "parquet"))
    jsonl = os.path.join(root, "docs.jsonl")
    shards, parquet_bytes, text_bytes, count = [], 0, 0, 0
    with open(jsonl, "w", encoding="utf-8") as out:
        while parquet_bytes < gb * 1e9:
            shard = os.path.join(root, "parquet", f"part-{len(shards):05d}.parquet")
            schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
            with pq.ParquetWriter(shard, schema, compression="snappy") as writer:
                shard_text = 0
                while shard_text < shard_mb << 20:
                    texts, size = [], 0
                    while size < row_group_mb << 20:
                        texts.append(next(docs).decode())
                        size += len(texts[-1])
                    ids = list(range(count, count + len(texts)))
                    writer.write_table(pa.table({"id": ids, "text": texts}, schema=schema))
                    out.writelines(
                        json.dumps({"id": i, "text": t}) + "\n"
                        for i, t in zip(ids, texts, strict=True)
                    )
                    count, shard_text, text_bytes = (
                        count + len(texts),
                        shard_text + size,
                        text_bytes + size,
                    )
            shards.append(shard)
            parquet_bytes += os.path.getsize(shard)
            print(f"  {shard}: {os.path.getsize(shard) / 1e6:,.0f} MB", flush=True)
    return {
        "pool": pool[: 16 << 20],
        "shards": shards,
        "parquet_bytes": parquet_bytes,
        "jsonl": jsonl,
        "jsonl_bytes": os.path.getsize(jsonl),
        "text_bytes": text_bytes,
        "documents": count,
    }


def train_tokenizer(root: str, sample: bytes, vocab: int) -> str:
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = sample.decode().split(" the ")  # ~2 KB pieces, not one 16 MB "sentence"
    tok.train_from_iterator(lines, trainer)
    path = os.path.join(root, "tokenizer.json")
    tok.save(path)
    return path


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _tree(pid: int) -> list[int]:
    """pid and its descendants, from every process's parent id in /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        found += frontier
    return found


# Runs a script and reports its own peak RSS (VmHWM: getrusage's ru_maxrss of an exec'ed child
# starts from its parent's peak at the fork, so a big parent would hide the child's figure).
_WRAPPER = """import atexit, runpy, sys
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            print("VmHWM_KB", line.split()[1], file=sys.stderr)
atexit.register(hwm)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def measure(script: str, argv: list[str]) -> dict:
    """Run `python script argv...`; its wall time, exit code, output, its main process's peak RSS
    (VmHWM) and the sampled peak of its process tree's total RSS (workers included)."""
    start = time.perf_counter()
    cmd = [sys.executable, "-c", _WRAPPER, script, *argv]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak_tree, done = [0], threading.Event()

    def sample():
        while not done.wait(0.2):
            peak_tree[0] = max(peak_tree[0], sum(_rss_kb(p) for p in _tree(child.pid)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = child.stdout.read()
    rc = child.wait()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    hwm = [line.split()[1] for line in output.splitlines() if line.startswith("VmHWM_KB ")]
    return {
        "seconds": seconds,
        "rc": rc,
        "output": output,
        "max_rss_mb": int(hwm[-1]) / 1024 if hwm else float("nan"),
        "tree_rss_mb": peak_tree[0] / 1024,
    }


def read_only(fmt: str, paths: list[str]) -> None:
    """The child of the read-only pass: iterate every document, tokenizing nothing."""
    from megatron_lite.data.readers import expand_inputs, iter_documents

    docs = chars = 0
    for path in expand_inputs(paths):
        for text, _ in iter_documents(path, fmt):
            docs, chars = docs + bool(text.strip()), chars + len(text)
    print(f"read {docs} documents, {chars} characters")


def _digest(prefix: str) -> str:
    h = hashlib.sha256()
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="GB of Parquet to build (1)")
    parser.add_argument("--workers", type=int, default=1, help="--workers of preprocess_data")
    parser.add_argument("--row-group-mb", type=int, default=256, help="MB of text a row group")
    parser.add_argument("--shard-mb", type=int, default=512, help="MB of text a Parquet file")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tmp-dir", default=None, help="where the temporary directory goes")
    parser.add_argument(
        "--read-only-passes",
        action="store_true",
        help="only read the inputs, tokenize nothing (the readers' speed and memory at a size "
        "whose tokenizing would take too long)",
    )
    parser.add_argument("--read-only", nargs="+", help=argparse.SUPPRESS)  # child: FORMAT PATH..
    args = parser.parse_args(argv)
    if args.read_only:
        read_only(args.read_only[0], args.read_only[1:])
        return 0
    if args.gb <= 0 or args.workers < 1 or args.row_group_mb < 1 or args.shard_mb < 1:
        print(
            "error: --gb must be > 0, --workers, --row-group-mb, --shard-mb >= 1", file=sys.stderr
        )
        return 2
    from megatron_lite.data import IndexedDataset, readers
    from megatron_lite.data import preprocess as preprocess_module

    with tempfile.TemporaryDirectory(prefix="bench_preprocess.", dir=args.tmp_dir) as root:
        print(f"building {args.gb:g} GB of Parquet and the same documents as JSON lines in {root}")
        start = time.perf_counter()
        data = build_inputs(root, args.gb, args.row_group_mb, args.shard_mb, args.seed)
        tok = train_tokenizer(root, data.pop("pool"), args.vocab)
        print(
            f"  {data['documents']:,} documents, {data['text_bytes'] / 1e6:,.0f} MB of text: "
            f"Parquet {data['parquet_bytes'] / 1e6:,.0f} MB in {len(data['shards'])} files, "
            f".jsonl {data['jsonl_bytes'] / 1e6:,.0f} MB ({time.perf_counter() - start:.0f} s)"
        )
        glob_pattern = os.path.join(root, "parquet", "part-*.parquet")
        inputs = {
            "parquet": (glob_pattern, data["parquet_bytes"]),
            "jsonl": (data["jsonl"], data["jsonl_bytes"]),
        }
        tool, me = os.path.join(ROOT, "tools", "preprocess_data.py"), os.path.abspath(__file__)
        text_mb = data["text_bytes"] / 1e6
        rows = []
        for fmt, (path, nbytes) in inputs.items():
            r = measure(me, ["--read-only", fmt, path])
            rows.append((f"{fmt} read only", r, nbytes, None))
            if args.read_only_passes:
                continue
            prefix = os.path.join(root, f"out_{fmt}")
            argv = ["--input", path, "--tokenizer-model", tok, "--output-prefix", prefix]
            r = measure(tool, [*argv, "--workers", str(args.workers), "--quiet"])
            rows.append((f"{fmt} preprocess", r, nbytes, prefix))
        print(
            f"\n{'path':<20} {'s':>7} {'text MB/s':>10} {'file MB/s':>10} {'Mtok/s':>7} "
            f"{'max RSS MB':>11} {'tree RSS MB':>12}"
        )
        for name, r, nbytes, prefix in rows:
            if r["rc"] != 0:
                print(f"{name}: failed (exit {r['rc']}):\n{r['output']}", file=sys.stderr)
                return 1
            tokens = ""
            if prefix:
                count = IndexedDataset(prefix, verify=False).num_tokens
                tokens = f"{count / r['seconds'] / 1e6:.2f}"
            print(
                f"{name:<20} {r['seconds']:7.1f} {text_mb / r['seconds']:10.1f} "
                f"{nbytes / 1e6 / r['seconds']:10.1f} {tokens:>7} {r['max_rss_mb']:11.0f} "
                f"{r['tree_rss_mb']:12.0f}"
            )
        same = args.read_only_passes or _digest(rows[1][3]) == _digest(rows[3][3])
        if not args.read_only_passes:
            print(f"\n.bin/.idx from Parquet and from JSON lines byte-identical: {same}")
        print(
            f"What bounds the RSS: the Parquet reader holds one record batch of "
            f"{readers.PARQUET_BATCH_ROWS} rows of the text column (here about "
            f"{readers.PARQUET_BATCH_ROWS * text_mb / data['documents']:.1f} MB) read through a "
            f"{readers.READ_BUFFER >> 20} MiB buffer and one data page, never a row group (here "
            f"{args.row_group_mb} MB of text) nor a file; the tokenizer takes batches of "
            f"{preprocess_module._BATCH_CHARS >> 20} MiB of text (with workers, at most "
            f"{preprocess_module._IN_FLIGHT_PER_WORKER} per worker in flight); the writer keeps "
            f"each document's token count until the end (a Python int in a list, ~36 bytes a "
            f"document: {data['documents'] * 36 / 1e6:.1f} MB here), the one part that grows "
            f"with the input. The rest is what the main process has loaded before the first "
            f"document (about 270 MB: the interpreter, torch, which the output-path check in "
            f"validation/ imports, pyarrow and the tokenizer); a worker is about 95 MB."
        )
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
