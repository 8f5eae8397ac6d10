"""Tokenize text or JSON-lines files into an indexed dataset (.bin/.idx) for data.paths.

    python tools/preprocess_data.py --input plays/*.txt --tokenizer-model tok.model \\
        --output-prefix data/plays
    python tools/preprocess_data.py --input corpus.jsonl --json-key text \\
        --tokenizer-model llama3/tokenizer.json --workers 8 --output-prefix data/corpus

Text files are one document each, or one per line (--split-lines), or one per blank-line
separated paragraph (--split-blank-lines). *.jsonl / *.json files hold one JSON object per line
whose --json-key field is a document. An EOS token follows every document. The tokenizer is a
SentencePiece .model or a Hugging Face tokenizer.json; --workers N tokenizes in N processes
(the output is byte-identical for any N).
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
from megatron_lite.validation.paths import output_prefix_problem  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="text or .jsonl files")
    parser.add_argument(
        "--tokenizer-model",
        required=True,
        help="SentencePiece .model or Hugging Face tokenizer.json",
    )
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin/.idx")
    parser.add_argument("--json-key", default="text", help="JSON field holding the text")
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
            json_key=args.json_key,
            append_eos=not args.no_eos,
            progress=not args.quiet,
            workers=args.workers,
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
        f"in {seconds:.1f} s ({stats.tokens / max(seconds, 1e-9):,.0f} tokens/s, "
        f"{args.workers} worker{'s' if args.workers > 1 else ''})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
