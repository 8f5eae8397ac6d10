"""Generate text from a training run, a checkpoint or a Hugging Face model (docs/generation.md).

    python -m megatron_lite.generate --run runs/quickstart --prompt "ROMEO:" --max-new-tokens 64
    python -m megatron_lite.torchrun --standalone --nproc-per-node=2 -m megatron_lite.generate \\
        --tp 2 --hf hf/llama-x --prompt-ids 1,15043 --prompt-ids 1,450,4996

Greedy unless --temperature > 0 (then --top-k, --top-p, --seed). Several prompts decode as one
batch. stdout holds only the generated text (one prompt: streamed token by token, the prompt
first; several: each prompt with its continuation under a `[i/n]` line once all are done);
messages go to stderr. Everything a user can get wrong is checked before any process group
exists, and exits 2 naming the flag, the rule and the fix.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

__all__ = ["arg_parser", "main", "prepare", "run"]


def arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_lite.generate",
        allow_abbrev=False,
        description="Generate text with a KV cache from a run, a checkpoint or a Hugging Face "
        "model; under torchrun with --tp N, tensor-parallel over N ranks.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--run",
        metavar="DIR",
        help="a run directory (train.out_dir): its newest "
        "checkpoint and the tokenizer its config records",
    )
    src.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a step_<N> checkpoint directory, or a folder with `latest`",
    )
    src.add_argument(
        "--hf",
        metavar="DIR",
        help="a Hugging Face Llama / Mixtral / Qwen3-MoE "
        "directory (config.json, *.safetensors, tokenizer.json if any)",
    )
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a prompt (repeat for a batch); encoded without BOS",
    )
    p.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        metavar="IDS",
        help="a prompt as token ids, comma-separated (repeat for a batch); prints "
        "ids, needs no tokenizer",
    )
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy; > 0: sample from softmax(logits / T)",
    )
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: all)")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the smallest set with this probability (1: all)",
    )
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    p.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="a SentencePiece .model or tokenizer.json instead of the recorded one",
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks (run under torchrun with as many)"
    )
    p.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="recompute every sequence in full at each step (slow; a check)",
    )
    return p


def _check_flags(args) -> None:
    """The flags' own ranges and combinations."""
    from megatron_lite.generation.sources import GenerateError

    rules = [
        (args.max_new_tokens >= 1, f"--max-new-tokens {args.max_new_tokens}", "must be >= 1"),
        (args.temperature >= 0, f"--temperature {args.temperature}", "must be >= 0 (0: greedy)"),
        (args.top_k >= 0, f"--top-k {args.top_k}", "must be >= 0 (0: no limit)"),
        (0 < args.top_p <= 1, f"--top-p {args.top_p}", "must be in (0, 1] (1: no limit)"),
        (args.tp >= 1, f"--tp {args.tp}", "must be >= 1"),
    ]
    for ok, flag, rule in rules:
        if not ok:
            raise GenerateError(f"{flag}: {rule}. Fix: give a value in that range")
    if args.temperature == 0 and (args.top_k or args.top_p < 1):
        raise GenerateError(
            f"--top-k {args.top_k} / --top-p {args.top_p} have no effect with greedy decoding "
            "(--temperature 0). Fix: set --temperature > 0 to sample, or drop them"
        )
    if bool(args.prompt) == bool(args.prompt_ids):
        raise GenerateError(
            "prompts come as --prompt TEXT or as --prompt-ids IDS, not both and not neither. "
            "Fix: give one kind (repeat it for a batch)"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        raise GenerateError(
            f"--tp {args.tp} but {world} rank(s) started (WORLD_SIZE): generation runs on "
            f"exactly tp ranks. Fix: python -m megatron_lite.torchrun --standalone "
            f"--nproc-per-node={args.tp} -m megatron_lite.generate --tp {args.tp} ..."
        )


def _check_model(source, tp: int) -> None:
    """What the weights' model must satisfy on tp ranks."""
    from megatron_lite import resolve
    from megatron_lite.generation.sources import GenerateError
    from megatron_lite.models.registry import get_architecture

    m = source.model
    try:
        get_architecture(m.arch)
    except ValueError as e:
        raise GenerateError(f"{source.flag}: {e}") from None
    groups = resolve.num_query_groups(m)
    for key, n in (("num_attention_heads", m.num_attention_heads), ("num_query_groups", groups)):
        if n % tp:
            raise GenerateError(
                f"--tp {tp}: the model's model.{key}={n} is not divisible by it (each rank "
                f"holds whole heads). Fix: use a --tp that divides {n}"
            )


def _tokenizer(args, source):
    """The tokenizer (None when none is given or recorded and prompts are ids), checked
    against the model's vocabulary."""
    from megatron_lite.data.tokenizer import Tokenizer
    from megatron_lite.generation.sources import GenerateError

    path, flag = args.tokenizer, f"--tokenizer {args.tokenizer}"
    if path is None:
        path, flag = source.tokenizer, f"the tokenizer of {source.flag} ({source.tokenizer})"
    if path is None:
        if args.prompt:
            raise GenerateError(
                f"--prompt needs a tokenizer, and {source.flag} records none (a converted or "
                "mock-data checkpoint). Fix: pass --tokenizer FILE (the model's), or give "
                "token ids with --prompt-ids"
            )
        return None
    tok = Tokenizer(path)  # DataFileError names the file
    model_vocab = source.model.vocab_size
    fits = (
        tok.vocab_size <= model_vocab
        if source.hf_tokenizer_padding
        else (tok.vocab_size == model_vocab)
    )
    if not fits:
        rule = "at most" if source.hf_tokenizer_padding else "exactly"
        raise GenerateError(
            f"{flag} has {tok.vocab_size} token ids, but the model's embedding has "
            f"{model_vocab} rows (model.vocab_size) and takes a tokenizer of {rule} "
            f"{model_vocab} ids: other ids would mean other tokens. Fix: use the tokenizer the "
            "model was trained with"
        )
    return tok


def _prompt_ids(args, tok, source) -> list[list[int]]:
    """The prompts as token ids, each in the vocabulary and fitting the context."""
    from megatron_lite.generation.sources import GenerateError

    prompts = []
    for text in args.prompt_ids:
        try:
            ids = [int(t) for t in text.replace(",", " ").split()]
        except ValueError:
            raise GenerateError(
                f"--prompt-ids {text!r}: not a list of integers. Fix: e.g. --prompt-ids 1,15,7"
            ) from None
        prompts.append((f"--prompt-ids {text!r}", ids))
    for text in args.prompt:
        shown = text if len(text) <= 40 else text[:37] + "..."
        prompts.append((f"--prompt {shown!r}", tok.encode(text)))
    vocab = tok.vocab_size if tok is not None else source.model.vocab_size
    context = source.context
    for flag, ids in prompts:
        if not ids:
            raise GenerateError(f"{flag} has no tokens. Fix: give a prompt of at least one token")
        if not all(0 <= i < vocab for i in ids):
            raise GenerateError(
                f"{flag}: token ids must be in [0, {vocab}) (the vocabulary). Fix: use ids of "
                "the model's tokenizer"
            )
        if len(ids) + args.max_new_tokens > context:
            room = context - len(ids)
            fix = (
                f"lower --max-new-tokens to {room}, or shorten the prompt"
                if room >= 1
                else f"shorten the prompt to at most {max(context - args.max_new_tokens, 1)} "
                f"tokens (with --max-new-tokens {args.max_new_tokens})"
            )
            raise GenerateError(
                f"{flag} is {len(ids)} tokens; with --max-new-tokens {args.max_new_tokens} that "
                f"is {len(ids) + args.max_new_tokens}, longer than the model's context of "
                f"{context} (model.seq_length, or max_position_embeddings, of {source.flag}). "
                f"Fix: {fix}"
            )
    return [ids for _, ids in prompts]


def prepare(args):
    """Everything checked before any process group: (source, tokenizer or None, prompts as
    token ids); raises GenerateError or DataFileError with the user's message."""
    from megatron_lite.generation.sources import open_source

    _check_flags(args)
    source = open_source(args.run, args.checkpoint, args.hf)
    _check_model(source, args.tp)
    tok = _tokenizer(args, source)
    return source, tok, _prompt_ids(args, tok, source)


class Printer:
    """stdout of rank 0: one prompt streams (the prompt, then each token as chosen: the
    decoded text grows, and only what was added is printed, once it is whole characters);
    several are printed when all are done, each under `[i/n]`. With --prompt-ids, ids."""

    def __init__(self, tok, prompts: list[list[int]], as_ids: bool, eos_id: int | None):
        self.tok, self.prompts, self.eos = (None if as_ids else tok), prompts, eos_id
        self.stream = len(prompts) == 1
        self.new: list[int] = []
        self.shown = ""
        if self.stream and self.tok is not None:
            self.shown = self._text(prompts[0])
            self._write(self.shown)
        elif self.stream:
            self._write(" ".join(map(str, prompts[0])))

    def _text(self, ids: list[int]) -> str:
        return self.tok.decode([i for i in ids if i != self.eos])

    def _write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def token(self, row: int, token: int) -> None:
        if not self.stream:
            return
        self.new.append(token)
        if self.tok is None:
            self._write(f" {token}")
            return
        text = self._text(self.prompts[0] + self.new)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):  # whole characters
            self._write(text[len(self.shown) :])
            self.shown = text

    def finish(self, outputs: list[list[int]]) -> None:
        if self.stream:
            if self.tok is not None:  # anything held back (an unfinished character)
                text = self._text(self.prompts[0] + self.new)
                self._write(text[len(self.shown) :] if text.startswith(self.shown) else "")
            self._write("\n")
            return
        n = len(outputs)
        for i, (prompt, new) in enumerate(zip(self.prompts, outputs, strict=True)):
            body = self._text(prompt + new) if self.tok else " ".join(map(str, prompt + new))
            self._write(f"[{i + 1}/{n}]\n{body}\n")


def run(args, source, tok, prompts: list[list[int]]) -> list[list[int]]:
    """Build the model on the tp ranks of the existing process group, generate, print on rank
    0 (collective); returns each prompt's new tokens. Raises CheckpointError (agreed across
    ranks) when the weights cannot be loaded."""
    import torch
    import torch.distributed as dist

    from megatron_lite.generation.decode import Sampling, generate
    from megatron_lite.generation.model import build_generation_model

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    chunk, mesh = build_generation_model(source, args.tp, device)
    rank0 = dist.get_rank() == 0
    eos = tok.eos_id if tok is not None else None
    printer = Printer(tok, prompts, bool(args.prompt_ids), eos) if rank0 else None
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    start = time.perf_counter()
    outputs = generate(
        chunk,
        mesh.tp,
        prompts,
        args.max_new_tokens,
        source.model.vocab_size,
        sampling,
        eos_id=eos,
        on_token=printer.token if rank0 else None,
        kv_cache=not args.no_kv_cache,
        device=device,
    )
    seconds = time.perf_counter() - start
    if rank0:
        printer.finish(outputs)
        tokens = sum(map(len, outputs))
        mode = "greedy" if args.temperature == 0 else f"sampled (T={args.temperature:g})"
        print(
            f"[generate] {len(prompts)} prompt(s), {tokens} new tokens {mode} in {seconds:.2f} "
            f"s ({tokens / seconds:.1f} tok/s) on tp={args.tp}, from {source.flag}",
            file=sys.stderr,
            flush=True,
        )
    return outputs


def main(argv=None) -> None:
    from megatron_lite.checkpoint.errors import CheckpointError, CheckpointReadError
    from megatron_lite.config import ConfigError
    from megatron_lite.data.errors import DataFileError
    from megatron_lite.generation.model import generation_config
    from megatron_lite.generation.sources import GenerateError
    from megatron_lite.train import exit_together, init_distributed, user_error

    args = arg_parser().parse_args(argv)
    try:
        source, tok, prompts = prepare(args)
    except (GenerateError, DataFileError, ConfigError) as e:
        user_error(e)
    init_distributed(generation_config(source.model, args.tp))
    try:
        run(args, source, tok, prompts)
    except (CheckpointError, CheckpointReadError) as e:  # agreed across ranks
        exit_together(2, e)
    exit_together(0, None)


if __name__ == "__main__":
    main()
