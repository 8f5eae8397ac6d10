"""The resolve step (derived fields) is separate from validation, and the frozen per-model
TransformerConfig needs no validate() first. Parameters without metadata are replicated."""

import dataclasses

import pytest
import torch
from torch import nn

from megatron_lite.config import ModelConfig, load_config
from megatron_lite.models.transformer_config import RUN_ONLY, TransformerConfig
from megatron_lite.parallel.params import init_parameters, meta_of
from megatron_lite.resolve import eod_token_id, resolve, vocab_size
from megatron_lite.validation import validate


def _cfg(*overrides):
    return load_config(None, ["data.mock=true", "model.vocab_size=100", *overrides])


def test_validate_only_checks_and_resolve_derives():
    cfg = _cfg("parallel.tp=2", "model.hidden_size=96", "model.num_attention_heads=6")
    before = dataclasses.asdict(cfg)
    resolved = validate(cfg, 8)
    assert dataclasses.asdict(cfg) == before  # the input is never changed
    assert dataclasses.asdict(resolved) == dataclasses.asdict(resolve(cfg, 8))
    assert resolved.parallel.dp == 4 and resolved.model.num_query_groups == 6
    assert resolved.model.ffn_hidden_size == 256  # 8·96/3 = 256, already a multiple of 64


def test_transformer_config_from_an_unvalidated_config():
    cfg = _cfg("parallel.tp=2", "model.arch=gpt", "parallel.sequence_parallel=true")
    c = TransformerConfig.from_config(cfg, world_size=4)  # no validate() anywhere
    assert (c.num_query_groups, c.ffn_hidden_size, c.padded_vocab_size) == (4, 256, 256)
    assert c.sequence_parallel and c.attention_backend == "sdpa" and c.head_dim == 16
    one_rank = TransformerConfig.from_config(_cfg("parallel.sequence_parallel=true"), 1)
    assert not one_rank.sequence_parallel  # no tensor parallelism: nothing to split
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 3


def test_vocab_size_before_any_data_exists(tmp_path):
    """model.vocab_size when set; else the tokenizer's: a built-in corpus's configured size
    (trained on its first run), a given tokenizer file's; None when only the data can tell."""
    corpus = ["data.corpus=shakespeare", "data.tokenizer_vocab_size=1000"]
    assert vocab_size(load_config(None, corpus)) == 1000
    assert vocab_size(load_config(None, [*corpus, "model.vocab_size=1024"])) == 1024
    assert vocab_size(_cfg()) == 100  # mock data: model.vocab_size, never a tokenizer
    spm = pytest.importorskip("sentencepiece")
    text = tmp_path / "t.txt"
    text.write_text("".join(f"word{i} and more words number {i * 7}\n" for i in range(300)))
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(tmp_path / "tok"), vocab_size=123, minloglevel=2
    )
    given = ["data.paths=[d]", f"data.tokenizer_model={tmp_path / 'tok.model'}"]
    assert vocab_size(load_config(None, given)) == 123
    assert vocab_size(load_config(None, ["data.paths=[d]"])) is None  # the data's ids decide
    missing = ["data.paths=[d]", f"data.tokenizer_model={tmp_path / 'none.model'}"]
    assert vocab_size(load_config(None, missing)) is None  # validation names the missing file


def test_transformer_config_takes_every_model_field_by_name():
    """A ModelConfig field reaches the layers under its own name (or is one of RUN_ONLY), so a
    new field cannot be forgotten in a second hand-written list."""
    model = {f.name for f in dataclasses.fields(ModelConfig)}
    layers = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert model - layers == RUN_ONLY
    derived = {
        "spec",
        "padded_vocab_size",
        "sequence_parallel",
        "moe_aux_loss_scale",
        "moe_layer_pattern",
        # from the data section: document masking
        "reset_attention_mask",
        "reset_position_ids",
        "eod_token_id",
    }
    assert layers - model == derived
    c = TransformerConfig.from_config(_cfg("model.norm_eps=1e-6", "model.rope_theta=5e5"), 1)
    assert c.norm_eps == 1e-6 and c.rope_theta == 5e5  # as set
    assert c.vocab_size == 100 and c.max_position_embeddings == 64  # resolved: seq_length


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)


def test_unmarked_parameters_are_replicated_and_seeded():
    a, b, c = _Mixed(), _Mixed(), _Mixed()
    torch.manual_seed(1)  # the global generator's state must not matter
    init_parameters(a, seed=5)
    torch.manual_seed(2)
    init_parameters(b, seed=5)
    init_parameters(c, seed=6)
    assert torch.equal(a.proj.weight, b.proj.weight) and torch.equal(a.proj.bias, b.proj.bias)
    assert not torch.equal(a.proj.weight, c.proj.weight)
    assert torch.equal(a.norm.weight, torch.ones(8))  # LayerNorm's own reset_parameters
    meta = meta_of(a.proj.weight)
    assert meta.tp_dim is None and meta.full_shape == (8, 8) and not meta.sequence_parallel


def test_unmarked_parameter_without_reset_is_refused_by_name():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(
        ValueError, match=r"parameter '1.gain' \(Scale\) has no sharding metadata.*set_meta"
    ):
        init_parameters(model, seed=0)


def test_eod_token_id_is_resolved_once_for_the_model(tmp_path):
    """data.eod_token_id, else the tokenizer's eos (a built-in corpus's trained tokenizer: 2; a
    given file's), None without a document flag or without a tokenizer; the model gets it."""
    on = "data.reset_attention_mask=true"
    assert eod_token_id(_cfg("data.eod_token_id=7").data) is None  # no flag: unused
    assert eod_token_id(_cfg(on, "data.eod_token_id=7").data) == 7
    assert eod_token_id(_cfg(on).data) is None  # mock data: validation asks for the id
    corpus = load_config(None, ["data.corpus=shakespeare", "data.eod_mask_loss=true"])
    assert eod_token_id(corpus.data) == 2
    spm = pytest.importorskip("sentencepiece")
    text = tmp_path / "t.txt"
    text.write_text("".join(f"word{i} and more words number {i * 7}\n" for i in range(300)))
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(tmp_path / "tok"), vocab_size=123, minloglevel=2,
        eos_id=5, unk_id=0, bos_id=1,
    )  # fmt: skip
    given = ["data.paths=[d]", f"data.tokenizer_model={tmp_path / 'tok.model'}", on]
    assert eod_token_id(load_config(None, given).data) == 5
    c = TransformerConfig.from_config(_cfg(on, "data.reset_position_ids=true",
                                           "data.eod_token_id=9"), 1)  # fmt: skip
    assert (c.eod_token_id, c.reset_attention_mask, c.reset_position_ids) == (9, True, True)
    assert TransformerConfig.from_config(_cfg(), 1).eod_token_id is None
