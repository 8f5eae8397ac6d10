"""python -m megatron_lite.generate without process groups: sampling against hand-computed
distributions, and every bad input stopped before any process group with a message naming
the flag or file, the rule and the fix (exit 2 through the CLI)."""

import json
import os

import pytest
import torch

from megatron_lite.config import Config, save_config
from megatron_lite.data.errors import DataFileError
from megatron_lite.generate import arg_parser, main, prepare
from megatron_lite.generation.decode import Sampling, next_tokens
from megatron_lite.generation.sources import GenerateError
from tests.unit.convert_tiny import write_hf

# ------------------------------------------------------------------ sampling
LOGITS = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))  # probabilities 0.05, 0.5, 0.15, 0.3
DRAWS = 20_000  # sd of a frequency <= 0.0035: atol 0.015 is 4 sd


def frequencies(sampling: Sampling) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sampling.seed)
    tokens = next_tokens(LOGITS.expand(DRAWS, 4), sampling, gen)
    return torch.bincount(tokens, minlength=4).float() / DRAWS


@pytest.mark.parametrize(
    "sampling, expected",
    [
        (Sampling(1.0), [0.05, 0.5, 0.15, 0.3]),
        (Sampling(1.0, top_k=2), [0, 0.5 / 0.8, 0, 0.3 / 0.8]),
        # nucleus 0.75: 0.5 < 0.75, 0.5 + 0.3 >= 0.75 -> the two likeliest
        (Sampling(1.0, top_p=0.75), [0, 0.5 / 0.8, 0, 0.3 / 0.8]),
        (Sampling(1.0, top_p=0.85), [0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95]),
        # T = 0.5 squares the probabilities before normalizing
        (Sampling(0.5), [p * p / 0.3650 for p in (0.05, 0.5, 0.15, 0.3)]),
    ],
)
def test_sampling_draws_the_intended_distribution(sampling, expected):
    got = frequencies(sampling)
    assert torch.allclose(got, torch.tensor(expected), atol=0.015), f"{sampling}: {got.tolist()}"


def test_greedy_is_argmax_and_a_seed_repeats_its_draws():
    assert next_tokens(LOGITS[None], Sampling(), None).tolist() == [1]
    a, b = frequencies(Sampling(1.0, seed=7)), frequencies(Sampling(1.0, seed=7))
    assert torch.equal(a, b), "the same seed drew differently"


# ------------------------------------------------------------------ bad inputs
def tokenizer_json(path, size: int) -> str:
    """A word-level tokenizer.json of `size` ids ("</s>" is id 0: its EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"</s>": 0, **{f"w{i}": i for i in range(1, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    file = os.path.join(path, "tokenizer.json")
    tok.save(file)
    return file


FEW = ["--max-new-tokens", "4"]  # the tiny model's context is 32


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny HF Llama (2 heads, 1 KV head, vocabulary 16, 32 positions), no tokenizer."""
    return write_hf(tmp_path / "hf")


def error(argv, monkeypatch=None, world: int | None = None) -> str:
    if monkeypatch is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises((GenerateError, DataFileError)) as e:
        prepare(arg_parser().parse_args(argv))
    return str(e.value)


def test_a_run_without_checkpoints(tmp_path):
    assert "config.yaml does not exist" in error(["--run", str(tmp_path), "--prompt", "x"])
    save_config(Config(), str(tmp_path / "config.yaml"))
    msg = error(["--run", str(tmp_path), "--prompt", "x"])
    assert "no checkpoint in" in msg and "train.save_interval=N" in msg, msg


def test_a_directory_that_holds_no_checkpoint(tmp_path):
    msg = error(["--checkpoint", str(tmp_path), "--prompt-ids", "1"])
    assert msg.startswith(f"--checkpoint {tmp_path}") and "metadata.json does not exist" in msg
    msg = error(["--checkpoint", str(tmp_path / "nowhere"), "--prompt-ids", "1"])
    assert "not a directory" in msg, msg


def test_a_tokenizer_of_another_vocabulary(hf_dir, tmp_path):
    file = tokenizer_json(tmp_path, 40)  # the model's embedding has 16 rows
    msg = error(["--hf", hf_dir, "--tokenizer", file, "--prompt", "w1 w2", *FEW])
    assert "has 40 token ids" in msg and "16 rows" in msg and "Fix:" in msg, msg
    ours = tokenizer_json(tmp_path, 16)
    source, tok, prompts = prepare(arg_parser().parse_args(
        ["--hf", hf_dir, "--tokenizer", ours, "--prompt", "w1 w2", *FEW]))  # fmt: skip
    assert prompts == [[1, 2]] and tok.eos_id == 0


def test_a_prompt_longer_than_the_context(hf_dir):
    msg = error(["--hf", hf_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", "30"])
    assert "33, longer than the model's context of 32" in msg, msg
    assert "--max-new-tokens to 29" in msg, msg
    prepare(
        arg_parser().parse_args(["--hf", hf_dir, "--prompt-ids", "1,2", "--max-new-tokens", "30"])
    )


def test_tp_must_divide_the_heads_and_match_the_ranks(hf_dir, monkeypatch):
    msg = error(["--hf", hf_dir, "--prompt-ids", "1", "--tp", "2", *FEW], monkeypatch, 2)
    assert "model.num_query_groups=1 is not divisible" in msg, msg
    msg = error(["--hf", hf_dir, "--prompt-ids", "1", "--tp", "2", *FEW], monkeypatch, 1)
    assert "--nproc-per-node=2" in msg, msg


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--prompt-ids", "1", "--top-k", "5"], "no effect with greedy decoding"),
        (["--prompt-ids", "1", "--temperature", "-1"], "--temperature -1.0: must be >= 0"),
        (["--prompt-ids", "1", "--temperature", "1", "--top-p", "0"], "must be in (0, 1]"),
        (["--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
        (["--prompt-ids", ""], "has no tokens"),
        (["--prompt-ids", "1", "--prompt", "x"], "not both and not neither"),
        ([], "not both and not neither"),
        (["--prompt-ids", "1,x"], "not a list of integers"),
        (["--prompt-ids", "1,16"], "must be in [0, 16)"),
        (["--prompt", "w1"], "--prompt needs a tokenizer"),
    ],
)
def test_bad_flags(hf_dir, argv, expected):
    msg = error(["--hf", hf_dir, *FEW, *argv])
    assert expected in msg and "Fix:" in msg, msg


def test_an_unconvertible_hf_directory(hf_dir):
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    config["attention_bias"] = True
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f)
    msg = error(["--hf", hf_dir, "--prompt-ids", "1"])
    assert msg.startswith(f"--hf {hf_dir}") and "attention_bias" in msg, msg


def test_the_cli_exits_2_with_the_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", str(tmp_path), "--prompt-ids", "1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: --checkpoint {tmp_path}")
