"""Tokenize text, JSON lines, Parquet or saved Hugging Face datasets into an indexed dataset.

    python tools/preprocess_data.py --input plays/*.txt --tokenizer-model tok.model \\
        --output-prefix data/plays
    python tools/preprocess_data.py --input corpus.jsonl --json-key text \\
        --tokenizer-model llama3/tokenizer.json --workers 8 --output-prefix data/corpus
    python tools/preprocess_data.py --input 'fineweb/data/*.parquet' --text-column text \\
        --tokenizer-model llama3/tokenizer.json --workers 8 --output-prefix data/fineweb

The output is a .bin/.idx pair for data.paths. Inputs are read in the order given, a quoted glob
pattern's matches sorted by name. The format comes from the name (--input-format overrides it):
*.jsonl / *.json hold one JSON object per line whose --text-column (alias --json-key) field is a
document, as do *.jsonl.gz and *.jsonl.zst compressed; *.parquet files and directories written
by datasets' save_to_disk hold a --text-column column of strings, one document a row (these need
the [data] extra: pip install -e ".[data]"). Other files are text: one document each, one per
line (--split-lines), or one per blank-line separated paragraph (--split-blank-lines). An EOS
token follows every document. The tokenizer is a SentencePiece .model or a Hugging Face
tokenizer.json; --workers N tokenizes in N processes (the output is byte-identical for any N).
A corrupt input is named with its line or row, and then nothing is written.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.data.errors import DataFileError  # noqa: E402
from megatron_lite.data.preprocess import preprocess  # noqa: E402
from megatron_lite.data.readers import FORMATS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files, quoted glob patterns (sorted matches) or save_to_disk dataset directories",
    )
    parser.add_argument(
        "--input-format",
        choices=FORMATS,
        help="read every input as this format (default: by name; a directory is a dataset)",
    )
    parser.add_argument(
        "--tokenizer-model",
        required=True,
        help="SentencePiece .model or Hugging Face tokenizer.json",
    )
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin/.idx")
    parser.add_argument(
        "--text-column",
        "--json-key",
        dest="text_column",
        default="text",
        help="the JSON field or Parquet / dataset column holding the text (default text)",
    )
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--split-lines", action="store_true", help="one document per line")
    split.add_argument(
        "--split-blank-lines", action="store_true", help="documents are separated by blank lines"
    )
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS to documents")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--workers", type=int, default=1, help="tokenizer processes (default 1: all cores)"
    )
    args = parser.parse_args(argv)
    # imported here, not at the top: validation/ imports torch (~190 MB resident), and every
    # --workers process (spawned) imports this module again, but never runs main()
    from megatron_lite.validation.paths import output_prefix_problem

    problem = output_prefix_problem(args.output_prefix)
    if problem is not None:
        print(
            f"error: --output-prefix={args.output_prefix!r}: {problem}. Fix: give a prefix in a "
            f"directory this user can create or write, e.g. --output-prefix data/my_corpus",
            file=sys.stderr,
        )
        return 2
    if args.workers < 1:
        print(
            f"error: --workers={args.workers}: must be >= 1. Fix: e.g. --workers 4", file=sys.stderr
        )
        return 2
    mode = "line" if args.split_lines else "blank_line" if args.split_blank_lines else "file"
    start = time.perf_counter()
    try:
        stats = preprocess(
            args.input,
            args.tokenizer_model,
            args.output_prefix,
            split=mode,
            text_key=args.text_column,
            append_eos=not args.no_eos,
            progress=not args.quiet,
            workers=args.workers,
            input_format=args.input_format,
        )
    except DataFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the disk filled up, the directory vanished, ...: nothing was written
        print(
            f"error: writing {args.output_prefix}.bin/.idx failed: {e.strerror} "
            f"({e.filename}); no dataset was written. Fix: free space or choose another "
            f"--output-prefix",
            file=sys.stderr,
        )
        return 1
    seconds = time.perf_counter() - start
    print(
        f"wrote {stats.prefix}.bin/.idx: {stats.documents} documents, {stats.tokens:,} tokens "
        f"from {stats.inputs} input{'s' if stats.inputs > 1 else ''} "
        f"({stats.input_bytes / 1e6:,.1f} MB) in {seconds:.1f} s "
        f"({stats.tokens / max(seconds, 1e-9):,.0f} tokens/s, "
        f"{args.workers} worker{'s' if args.workers > 1 else ''})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
