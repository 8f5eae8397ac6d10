"""Train a byte-fallback BPE SentencePiece tokenizer on text files.

    python tools/train_tokenizer.py --input a.txt b.txt --output-prefix out/tok --vocab-size 4096

writes out/tok.model (use it as data.tokenizer_model) and out/tok.vocab. Each input line is a
training sentence; at most --input-sentence-size lines are sampled (deterministically).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.data.errors import DataFileError  # noqa: E402
from megatron_lite.data.tokenizer import (  # noqa: E402
    DEFAULT_INPUT_SENTENCE_SIZE,
    Tokenizer,
    train_tokenizer,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="UTF-8 text files")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.model/.vocab")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument(
        "--input-sentence-size",
        type=int,
        default=DEFAULT_INPUT_SENTENCE_SIZE,
        help="lines sampled for training (default %(default)s)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = train_tokenizer(
            args.input, args.output_prefix, args.vocab_size, args.input_sentence_size
        )
    except DataFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {path} ({Tokenizer(path).vocab_size} tokens) in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
