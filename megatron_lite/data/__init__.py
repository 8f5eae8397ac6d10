"""Data pipeline: tokenizer, indexed mmap datasets, GPT sample datasets, blending, sampler.

`build_dataset(cfg)` turns the data section of a Config into one infinite, seeded dataset of
int64 samples [seq_length+1]; `microbatches_for_step` (in `sampler`, which needs torch and is
therefore imported lazily) cuts a step's global batch into a dp rank's microbatches.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_lite.data.blended_dataset import BlendedDataset
from megatron_lite.data.corpus import prepare_corpus
from megatron_lite.data.errors import DataFileError
from megatron_lite.data.gpt_dataset import GPTDataset, MockDataset, default_cache_dir
from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_lite.data.split import check_split, split_documents
from megatron_lite.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "BlendedDataset",
    "DataFileError",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MockDataset",
    "Prefetcher",
    "Tokenizer",
    "build_dataset",
    "build_valid_dataset",
    "microbatches_for_step",
    "prepare_corpus",
    "train_tokenizer",
]


def __getattr__(name: str):
    # The sampler imports torch; tools that only tokenize should not pay for that.
    if name == "microbatches_for_step":
        from megatron_lite.data.sampler import microbatches_for_step

        return microbatches_for_step
    if name == "Prefetcher":
        from megatron_lite.data.prefetch import Prefetcher

        return Prefetcher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_dataset(cfg) -> tuple[object, int]:
    """Build the training dataset of a `megatron_lite.config.Config`: (dataset, vocab_size).

    data.mock -> MockDataset over model.vocab_size; data.corpus -> the prepared corpus;
    data.paths -> one GPTDataset per prefix, blended by data.weights (default: by token count)
    when there are several. Their indices are cached in data.index_cache_dir (default: an
    `index_cache/` folder beside each dataset; the blend's beside the first). vocab_size is the
    tokenizer's (data.tokenizer_model, a SentencePiece .model or a Hugging Face tokenizer.json,
    or the corpus one), else the largest token id in the data + 1. If model.vocab_size is set
    and smaller than that or than the data's largest id + 1, raises DataFileError naming the
    file and the fix.
    """
    d, seq, seed = cfg.data, cfg.model.seq_length, cfg.train.seed
    if d.mock:
        return MockDataset(cfg.model.vocab_size, seq, seed), cfg.model.vocab_size
    tokenizer_path, paths = d.tokenizer_model, list(d.paths)
    if d.corpus is not None:  # (validation: not with data.paths)
        prefix, tokenizer_path = prepare_corpus(d.corpus, d.cache_dir, d.tokenizer_vocab_size)
        paths = [prefix]
    if not paths:
        raise DataFileError("no training data: set data.paths, data.corpus or data.mock=true")
    key = "data.corpus" if d.corpus is not None else "data.paths"
    indexed = _open(paths, key)
    vocab_size = _check_vocab(indexed, tokenizer_path, cfg.model.vocab_size, "data.paths")
    _check_documents(indexed, d, vocab_size, key)
    check_split(indexed, d.split, seq, evaluating=cfg.train.eval_interval > 0)
    return _gpt_datasets(indexed, d, seq, seed, part=0), vocab_size


def build_valid_dataset(cfg):
    """The validation dataset (None without data.split or data.valid_paths): data.valid_paths'
    datasets, or the validation part of every training dataset's documents under data.split.
    Mock data validates on another seed's tokens."""
    d, seq, seed = cfg.data, cfg.model.seq_length, cfg.train.seed
    if d.mock:
        return MockDataset(cfg.model.vocab_size, seq, seed + 1)
    if d.valid_paths:
        indexed = _open(d.valid_paths, "data.valid_paths")
        tokenizer = d.tokenizer_model
        if d.corpus is not None:
            tokenizer = prepare_corpus(d.corpus, d.cache_dir, d.tokenizer_vocab_size)[1]
        vocab = _check_vocab(indexed, tokenizer, cfg.model.vocab_size, "data.valid_paths")
        # token ids against the training vocabulary (this data may use fewer ids)
        _check_documents(indexed, d, cfg.model.vocab_size or vocab, "data.valid_paths")
        return _gpt_datasets(indexed, replace(d, split=None, weights=None), seq, seed, part=0)
    if d.split is None:
        return None
    paths = list(d.paths)
    if d.corpus is not None:
        paths = [prepare_corpus(d.corpus, d.cache_dir, d.tokenizer_vocab_size)[0]]
    indexed = _open(paths, "data.corpus" if d.corpus is not None else "data.paths")
    check_split(indexed, d.split, seq, evaluating=True)
    return _gpt_datasets(indexed, d, seq, seed, part=1)


def epoch_samples(dataset) -> int | None:
    """Samples before a dataset repeats itself: one epoch of a GPTDataset, the sum of a blend's
    datasets' epochs; None for mock data (it never repeats)."""
    if isinstance(dataset, BlendedDataset):
        return sum(d.num_samples for d in dataset.datasets)
    return getattr(dataset, "num_samples", None)


def _open(prefixes: list[str], key: str) -> list[IndexedDataset]:
    """The datasets of `key`'s prefixes (the full .idx check runs once per machine, when
    GPTDataset builds its cached indices); DataFileError for one without documents."""
    out = [IndexedDataset(p, verify=False) for p in prefixes]
    for ds in out:
        if len(ds) == 0:
            raise DataFileError(
                f"{key}: {ds.idx_path} holds no documents, so it has no samples. Fix: "
                f"preprocess a non-empty input into {ds.prefix} with tools/preprocess_data.py, "
                f"or leave it out of {key}"
            )
    return out


def _check_documents(indexed: list[IndexedDataset], d, vocab: int, key: str) -> None:
    """The token-id keys against the data's vocabulary (known only now when no tokenizer or
    model.vocab_size gave it), and under document masking an end-of-document id that each
    dataset of `key` holds: without one every window is one document, and the masking the
    config asks for would silently do nothing. Checked here, on the host, before any process
    group (the scan stops at the first EOD)."""
    from megatron_lite.resolve import eod_token_id
    from megatron_lite.validation.inputs import check_token_ids  # the one rule (imports torch)

    check_token_ids(d, vocab, f"the vocabulary of {key}")
    eod = eod_token_id(d)
    if eod is None:
        return
    flag = next(f for f in ("reset_attention_mask", "reset_position_ids", "eod_mask_loss")
                if getattr(d, f))  # fmt: skip
    for ds in indexed:
        if not ds.contains(eod):
            raise DataFileError(
                f"{key}: {ds.bin_path} holds no end-of-document token {eod} ("
                f"{'data.eod_token_id' if d.eod_token_id is not None else 'the tokenizer eos'}"
                f"), so "
                f"data.{flag}=true would do nothing (each window would be one document). Fix: "
                f"preprocess the data with an EOS after each document (tools/preprocess_data.py "
                f"without --no-eos), set data.eod_token_id to the id that ends its documents, "
                f"or turn document masking off"
            )


def _gpt_datasets(indexed, d, seq: int, seed: int, part: int):
    """One GPTDataset per indexed dataset over `part` of its documents, blended if several."""
    cache_dir = d.index_cache_dir
    docs = [split_documents(len(ds), d.split)[part] for ds in indexed]
    datasets = [
        GPTDataset(ds, seq, seed, cache_dir, None if d.split is None else r)
        for ds, r in zip(indexed, docs, strict=True)
    ]
    if len(datasets) == 1:
        return datasets[0]
    weights = d.weights if d.weights is not None else [ds.num_tokens for ds in indexed]
    blend_dir = cache_dir or default_cache_dir(indexed[0].prefix)
    return BlendedDataset(datasets, weights, seed, blend_dir)


def _check_vocab(
    indexed: list[IndexedDataset], tokenizer_path: str | None, model_vocab, key: str
) -> int:
    """The data's vocabulary size, checked against the tokenizer and model.vocab_size (`key`:
    the config key that lists the datasets)."""
    top = max(indexed, key=lambda ds: ds.max_token_id)
    data_vocab = top.max_token_id + 1
    if tokenizer_path is not None:
        vocab, source = Tokenizer(tokenizer_path).vocab_size, f"tokenizer {tokenizer_path}"
        if data_vocab > vocab:
            raise DataFileError(
                f"{key}: {top.idx_path} holds token id {top.max_token_id} but {source} has only "
                f"{vocab} tokens, so the data was made with another tokenizer. Fix: point "
                f"data.tokenizer_model at the tokenizer used by tools/preprocess_data.py"
            )
    else:
        vocab, source = data_vocab, f"data {top.idx_path} (largest token id {top.max_token_id})"
    if model_vocab is not None and model_vocab < vocab:
        raise DataFileError(
            f"{key}: model.vocab_size={model_vocab} is smaller than the {vocab} tokens of "
            f"{source}. Fix: set model.vocab_size={vocab} or larger, or leave it unset (null) "
            f"to use the tokenizer's vocabulary"
        )
    return vocab
