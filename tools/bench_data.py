"""Scale check of the data pipeline on a synthetic corpus (50 million documents by default).

    nice python tools/bench_data.py --dir /tmp/bench_data [--docs 50000000] [--datasets 10]

Writes `--datasets` indexed datasets that share `--docs` documents (real `.idx` files with
seeded document sizes; the `.bin` files are sparse files of the right size, all zeros, with the
id-range sidecar recorded), then measures, each phase in a fresh process (so its baseline is
its own): the first build of every index (no cache), a cached start-up, and a resume at blended
sample `--resume-at` (one global batch of `--batch` samples, first with the epochs' orders still
to build, then again in a fresh process). Resident memory is read from /proc/self/status after
the dataset is built: VmRSS (and its anonymous and file-backed parts) above the process's
baseline once numpy and megatron_lite.data are imported. File-backed pages (RssFile) are the
mmaps' shared, clean page cache: reading a sample faults in whole page-cache folios (up to 2 MB
each) of the index files, so RssFile after the resume grows with the samples read (bounded by
the files' sizes), while the private memory (RssAnon) does not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megatron_lite.data import (  # noqa: E402
    BlendedDataset,
    GPTDataset,
    IndexedDataset,
    indexed_dataset,
    token_ids,
)


def rss_mb() -> dict[str, float]:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, in MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def write_corpus(root: str, docs: int, datasets: int, max_doc: int, seed: int) -> list[str]:
    """`datasets` prefixes sharing `docs` documents of 1..max_doc tokens (uint16, all zeros)."""
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    prefixes, chunk = [], 1 << 22
    for d in range(datasets):
        prefix = os.path.join(root, f"synthetic_{d}")
        n = docs // datasets + (d < docs % datasets)
        header = indexed_dataset._HEADER.pack(indexed_dataset._MAGIC, 1, 8, n, 0)
        total = 0
        with open(prefix + ".idx", "wb") as f:
            f.write(header)
            sizes = [rng.integers(1, max_doc, size=min(chunk, n - s), dtype=np.int32) for s in
                     range(0, n, chunk)]  # fmt: skip
            for part in sizes:
                f.write(part.tobytes())
            for part in sizes:
                offsets = np.empty(len(part), dtype=np.int64)
                offsets[0] = total
                np.cumsum(part[:-1], dtype=np.int64, out=offsets[1:])
                offsets[1:] += total
                f.write((offsets * 2).tobytes())
                total += int(part.sum(dtype=np.int64))
        with open(prefix + ".bin", "wb") as f:
            f.truncate(total * 2)  # sparse: zeros, no blocks on disk
        token_ids.write_sidecar(prefix, prefix + ".bin", 0, 0)
        prefixes.append(prefix)
    return prefixes


def phase(args) -> dict:
    """One measured phase in this (fresh) process."""
    base = rss_mb()
    start = time.perf_counter()
    # As build_dataset opens them: the full .idx check runs when the indices are built.
    indexed = [IndexedDataset(p, verify=False) for p in args.prefixes]
    datasets = [GPTDataset(ix, args.seq, args.seed) for ix in indexed]
    weights = [ds.indexed.num_tokens for ds in datasets]
    cache = os.path.join(os.path.dirname(args.prefixes[0]), "index_cache")
    blend = BlendedDataset(datasets, weights, args.seed, cache) if len(datasets) > 1 else None
    opened = time.perf_counter() - start
    after = rss_mb()
    ds = blend or datasets[0]
    start = time.perf_counter()
    for i in range(args.resume_at, args.resume_at + args.batch):
        ds[i]
    resumed = time.perf_counter() - start
    final = rss_mb()
    return {
        "open_s": round(opened, 3),
        "resume_s": round(resumed, 3),
        "built": any(d.indices_built for d in datasets),
        "rss_above_baseline_mb": round(after["VmRSS"] - base["VmRSS"], 1),
        "anon_above_baseline_mb": round(after["RssAnon"] - base["RssAnon"], 1),
        "file_above_baseline_mb": round(after["RssFile"] - base["RssFile"], 1),
        "rss_after_resume_above_baseline_mb": round(final["VmRSS"] - base["VmRSS"], 1),
        "anon_after_resume_above_baseline_mb": round(final["RssAnon"] - base["RssAnon"], 1),
        "peak_rss_mb": round(final["VmHWM"], 1),
        "baseline_rss_mb": round(base["VmRSS"], 1),
        "samples_per_epoch": [d.num_samples for d in datasets[:3]],
        "blend_period": blend.period if blend else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir",
        default="/tmp/megatron_lite_bench_data",
        help="where the corpus and its index cache are written (%(default)s)",
    )
    parser.add_argument(
        "--docs", type=int, default=50_000_000, help="documents in all (%(default)s)"
    )
    parser.add_argument(
        "--datasets",
        type=int,
        default=10,
        help="blended datasets they are split into (%(default)s)",
    )
    parser.add_argument(
        "--max-doc-tokens",
        type=int,
        default=2000,
        help="document lengths are uniform in [1, this) (%(default)s)",
    )
    parser.add_argument(
        "--seq", type=int, default=2048, help="sequence length of a sample (%(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=1234, help="corpus and shuffle seed (%(default)s)"
    )
    parser.add_argument(
        "--resume-at",
        type=int,
        default=10**9,
        help="sample index the resume reads from (%(default)s)",
    )
    parser.add_argument("--batch", type=int, default=256, help="samples read at the resume")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--prefixes", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        print(json.dumps(phase(args)))
        return 0
    start = time.perf_counter()
    prefixes = write_corpus(args.dir, args.docs, args.datasets, args.max_doc_tokens, args.seed)
    idx_mb = sum(os.path.getsize(p + ".idx") for p in prefixes) / 1e6
    print(
        f"corpus: {args.docs:,} documents in {args.datasets} datasets, .idx {idx_mb:.0f} MB, "
        f"written in {time.perf_counter() - start:.1f} s",
        flush=True,
    )
    shutil.rmtree(os.path.join(args.dir, "index_cache"), ignore_errors=True)
    cmd = [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:]), "--phase", "x"]
    cmd += ["--prefixes", *prefixes]
    for name in ("first build (no cache)", "cached start-up", "cached start-up again"):
        result = subprocess.run(cmd, capture_output=True, text=True, check=True)
        print(f"{name}: {result.stdout.strip()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
