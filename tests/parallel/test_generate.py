"""Generation (megatron_lite/generation/) against transformers' own `generate`, greedy, token for
token, on forked gloo ranks:

- a tiny random-weight HF Llama (--hf, converted in memory): prompts of three lengths in one
  left-padded batch equal transformers run on each prompt alone, on 1 rank and on tp 2; the
  KV-cached decoding equals recomputing each whole sequence at every step (the training
  forward, no cache);
- slow tier: a checkpoint trained on tp2·pp2·dp2 (ZeRO-1, sequence parallel, tied embeddings,
  padded vocabulary), resharded on load to 1 rank and to tp 2, equals transformers on the same
  weights exported by tools/convert_checkpoint.py dcp-to-hf; likewise checkpoints trained
  with ZeRO-3 on dp 2, in bf16 on tp2·pp2·vpp2, and an MoE one with ep 2 (exported as
  Mixtral).

Weights are drawn at O(0.1) (norms away from 1) so logits spread over several units: with
HF's 0.02 init the top two logits of a 2-layer model lie ~1e-4 apart, and float rounding
between two implementations could flip a greedy choice."""

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402

from tests.dist_harness import run_ranks  # noqa: E402

PROMPTS = [[5, 17, 3, 9, 44, 61], [12], [7, 7, 2, 30]]  # lengths 6, 1, 4: left padding
NEW = 12


def _spread(model) -> None:
    """Weights O(0.1), norm weights in [0.5, 1.5] (module docstring)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)


def hf_generate(model, prompts, new: int, eos: int | None = None) -> list[list[int]]:
    """transformers' greedy generate on each prompt alone (no padding): the new tokens (eos
    None: exactly `new`, as ours without a tokenizer)."""
    model.generation_config.eos_token_id = eos
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        got = model.generate(ids, do_sample=False, max_new_tokens=new, pad_token_id=0)
        out.append(got[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """(HF directory, transformers' greedy tokens for PROMPTS, and for CLI_PROMPT up to its
    EOS) of a tiny random Llama: GQA (4 heads, 2 KV heads), untied output layer, vocabulary 96,
    with a word-level tokenizer.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip
    model = LlamaForCausalLM(config).float().eval()
    _spread(model)
    path = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(path)
    write_tokenizer(path)
    cli = hf_generate(model, [CLI_PROMPT], NEW, eos=EOS)[0]
    return str(path), hf_generate(model, PROMPTS, NEW), cli


EOS = 23  # the tokenizer's "</s>": the model's greedy continuation of CLI_PROMPT reaches it
CLI_PROMPT = [5, 17, 3]


def write_tokenizer(path) -> None:
    """tokenizer.json of words w<i> for every id i but EOS, which is "</s>": text "w5 w17" is
    ids [5, 17]."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {**{f"w{i}": i for i in range(96) if i != EOS}, "</s>": EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))


def _generate(rank, world, kind: str, path: str, prompts, new: int, full: bool):
    """Our greedy tokens from `path` (kind hf or checkpoint) on `world` TP ranks, batched with
    the KV cache, and (full) recomputed without it."""
    from megatron_lite.generation.decode import generate
    from megatron_lite.generation.model import build_generation_model
    from megatron_lite.generation.sources import checkpoint_source, hf_source

    source = hf_source(path) if kind == "hf" else checkpoint_source(path)
    chunk, mesh = build_generation_model(source, world, torch.device("cpu"))
    vocab = source.model.vocab_size
    out = {"cached": generate(chunk, mesh.tp, prompts, new, vocab)}
    if full:
        out["full"] = generate(chunk, mesh.tp, prompts, new, vocab, kv_cache=False)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_equals_transformers(hf_llama, tp):
    path, expected, _ = hf_llama
    ranks = run_ranks(tp, _generate, "hf", path, PROMPTS, NEW, tp == 1, timeout=120)
    for rank, got in enumerate(ranks):
        assert got["cached"] == expected, f"tp {tp}, rank {rank}: ours {got} vs HF {expected}"
        if "full" in got:
            assert got["full"] == got["cached"], "the KV cache changed the tokens"


def _gpt_rows(rank, world):
    """A random GPT (learned positions, biases) on `world` TP ranks: the batch, each prompt
    alone, and the batch recomputed without the cache."""
    from megatron_lite.config import ModelConfig
    from megatron_lite.generation.decode import generate
    from megatron_lite.generation.model import generation_config
    from megatron_lite.models import build_model
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.parallel.random import RNGStatesTracker

    m = ModelConfig(
        arch="gpt",
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=96,
        seq_length=32,
        tie_embeddings=False,
        init_method_std=0.2,
    )
    mesh = ParallelMesh(RankLayout(world, tp=world))
    (chunk,) = build_model(generation_config(m, world), mesh, RNGStatesTracker(), 96)
    chunk.eval()
    batch = generate(chunk, mesh.tp, PROMPTS, NEW, 96)
    alone = [generate(chunk, mesh.tp, [p], NEW, 96)[0] for p in PROMPTS]
    return batch, alone, generate(chunk, mesh.tp, PROMPTS, NEW, 96, kv_cache=False)


def test_learned_positions_count_from_each_rows_first_token():
    """GPT's position table (unlike RoPE, which sees only distances) tells a left-padded row
    from one alone: each row's positions must start at its first real token."""
    for batch, alone, full in run_ranks(2, _gpt_rows):
        assert batch == alone, f"batched {batch} vs each alone {alone}"
        assert batch == full, f"cached {batch} vs recomputed {full}"


def _cli(rank, world, argv):
    """megatron_lite.generate's checks, then its run on this process group: stdout."""
    import contextlib
    import io

    from megatron_lite.generate import arg_parser, prepare, run

    args = arg_parser().parse_args(argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run(args, *prepare(args))
    return out.getvalue()


def test_the_cli_streams_the_text_of_transformers_tokens(hf_llama):
    """One prompt through the CLI's --hf (its tokenizer.json found beside the weights): stdout
    is the prompt and HF's greedy continuation up to its EOS."""
    path, _, new = hf_llama
    prompt = " ".join(f"w{i}" for i in CLI_PROMPT)
    argv = ["--hf", path, "--prompt", prompt, "--max-new-tokens", str(NEW)]
    (stdout,) = run_ranks(1, _cli, argv)
    assert EOS in new[1:], f"HF's continuation {new} stops at no EOS: the test needs one"
    words = [f"w{i}" for i in CLI_PROMPT + new if i != EOS]
    assert stdout == " ".join(words) + "\n", f"{stdout!r} vs HF {words}"


# ------------------------------------------------------------------ trained checkpoints (slow)
RUN = [
    "model.vocab_size=250", "model.make_vocab_size_divisible_by=8",  # padded to 256 at tp 2
    "model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4",
    "model.num_query_groups=2", "model.ffn_hidden_size=128", "model.seq_length=32",
    "model.init_method_std=0.1", "data.mock=true", "train.micro_batch_size=1",
    "train.global_batch_size=4", "train.steps=2", "train.save_interval=2", "train.lr=1e-3",
    "train.warmup_steps=1", "log.progress=false",
]  # fmt: skip
LAYOUTS = {  # world size, overrides
    "tp2_pp2_dp2": (8, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                        "parallel.zero_stage=1"]),
    "zero3_dp2": (2, ["parallel.zero_stage=3"]),  # FSDP2 rows, fp32 masters apart
    "bf16_tp2_pp2_vpp2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2",
                              "train.precision=bf16"]),
    "moe_ep2": (2, ["model.num_experts=4", "model.moe_router_topk=2", "parallel.ep=2",
                    "model.moe_router_norm_topk=true", "model.moe_ffn_hidden_size=64"]),
}  # fmt: skip


def _train(rank, world, overrides, out_dir):
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    p = cfg.parallel
    mesh = ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep))
    Trainer(cfg, mesh, dataset, vocab).train()


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_trained_checkpoint_equals_transformers_on_its_export(layout, tmp_path):
    from transformers import AutoModelForCausalLM

    from tools.convert_checkpoint import dcp_to_hf

    world, parallel = LAYOUTS[layout]
    run_ranks(world, _train, [*RUN, *parallel], str(tmp_path / "run"), timeout=300)
    ckpt = os.path.join(tmp_path, "run", "checkpoints", "step_2")
    dcp_to_hf(ckpt, str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    prompts = [[p % 250 for p in prompt] for prompt in PROMPTS]
    expected = hf_generate(model, prompts, NEW)
    for tp in (1, 2):
        got = run_ranks(tp, _generate, "checkpoint", ckpt, prompts, NEW, False, timeout=120)
        for rank, out in enumerate(got):
            assert out["cached"] == expected, f"{layout} -> tp {tp}, rank {rank}: {out} vs HF"
