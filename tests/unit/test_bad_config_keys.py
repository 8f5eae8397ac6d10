"""Issue #36 classes D, E (MoE, model, data, train and log keys) and F, before any process group:
- D: what a model part divides at build time, and every token id against the vocabulary, are
  validation rules (the builder's ValueError was the first to notice);
- E: an invalid value of an inactive feature's key is an error; a valid non-default one gets a
  one-line warning that it has no effect, shown once per run;
- F: floats that become tensor state or tensor math are checked in that tensor's dtype.
Every case asserts that the message names the key (a substring, not the whole message)."""

import os

import pytest

from megatron_lite.config import ConfigError, load_config
from megatron_lite.validation import config_warnings, validate
from megatron_lite.validation.rules import WARNED_ENV, show_warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")  # mock data, vocab 512, 2 layers, 4 heads
MOE = ["model.num_experts=4", "model.moe_router_topk=2"]
BIAS = [*MOE, "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true"]
TP2 = ["parallel.tp=2", "parallel.sequence_parallel=true"]

# (case id, world size, overrides of smoke.yaml, needle)
ERRORS = [
    # E: the MoE keys' own ranges hold on a dense model too
    ("dense-topk-zero", 1, ["model.moe_router_topk=0"], "model.moe_router_topk=0: must be >= 1"),
    ("dense-freq-zero", 1, ["model.moe_layer_freq=0"], "model.moe_layer_freq=0: must be >= 1"),
    ("dense-freq-list", 1, ["model.moe_layer_freq=[1,0,1]"], "model.moe_layer_freq=[1, 0, 1]"),
    ("dense-first-k", 1, ["model.moe_first_k_dense_replace=5"], "moe_first_k_dense_replace=5"),
    ("dense-score", 1, ["model.moe_router_score_function=relu"], "score_function='relu'"),
    ("dense-aux-type", 1, ["model.moe_aux_loss_type=token"], "moe_aux_loss_type='token'"),
    ("dense-scaling", 1, ["model.moe_router_topk_scaling_factor=0"], "scaling_factor=0.0"),
    ("dense-rate-neg", 1, ["model.moe_router_bias_update_rate=-1"], "update_rate=-1.0: must"),
    ("dense-shared-neg", 1, ["model.moe_shared_expert_ffn_hidden_size=-64"], "size=-64: must"),
    ("dense-overlap", 1, ["model.moe_shared_expert_overlap=true"], "moe_shared_expert_overlap"),
    ("dense-groups-half", 1, ["model.moe_router_num_groups=2"], "model.moe_router_group_topk"),
    ("dense-group-score", 1, ["model.moe_router_group_score=max"], "group_score='max'"),
    ("dense-gate", 1, ["model.moe_shared_expert_gate=true"], "model.moe_shared_expert_gate=True"),
    ("top2-of-one", 1, [*MOE, "model.moe_router_num_groups=4", "model.moe_router_group_topk=2",
                        "model.moe_router_group_score=top2"],
     "model.moe_router_group_score='top2': scores a group by the sum of its top 2 experts"),
    ("dense-capacity-zero", 1, ["model.moe_capacity_factor=0"], "moe_capacity_factor=0.0"),
    ("dense-z-neg", 1, ["model.moe_z_loss_coeff=-1"], "model.moe_z_loss_coeff=-1.0: must"),
    ("dense-ffn-zero", 1, ["model.moe_ffn_hidden_size=0"], "model.moe_ffn_hidden_size=0"),
    ("dense-rate-fp32", 1, ["model.moe_router_bias_update_rate=1e308"], "is inf in float32"),
    # F: in the dtype the value is stored in (the case first)
    ("rate-1e308", 1, [*BIAS, "model.moe_router_bias_update_rate=1e308"],
     "model.moe_router_bias_update_rate=1e+308: is inf in float32, the dtype of the expert bias"),
    ("rate-underflow", 1, [*BIAS, "model.moe_router_bias_update_rate=1e-50"], "rounds to 0 in"),
    ("scaling-inf", 1, [*MOE, "model.moe_router_topk_scaling_factor=1e39"], "factor=1e+39: is"),
    ("aux-inf", 1, [*MOE, "model.moe_aux_loss_coeff=1e39"], "moe_aux_loss_coeff=1e+39: is inf"),
    ("z-underflow", 1, [*MOE, "model.moe_z_loss_coeff=1e-60"], "moe_z_loss_coeff=1e-60: rounds"),
    ("std-inf", 1, ["model.init_method_std=1e39"], "init_method_std=1e+39: is inf in float32"),
    ("std-underflow", 1, ["model.init_method_std=1e-50"], "init_method_std=1e-50: rounds to 0"),
    ("std-bf16", 1, ["train.precision=bf16", "model.init_method_std=3.4e38"], "inf in bfloat16"),
    ("eps-underflow", 1, ["model.norm_eps=1e-50"], "model.norm_eps=1e-50: rounds to 0 in float32"),
    ("eps-inf", 1, ["model.norm_eps=1e39"], "model.norm_eps=1e+39: is inf in float32"),
    ("capacity-huge", 1, [*MOE, "model.moe_capacity_factor=1e308"], "must be <= model.num_experts"),
    ("capacity-5", 1, [*MOE, "model.moe_capacity_factor=5"], "model.moe_capacity_factor=5.0"),
    ("save-timeout-huge", 1, ["train.async_save_timeout_s=1e308"], "async_save_timeout_s=1e+308"),
    ("save-timeout-10g", 1, ["train.async_save_timeout_s=1e10"], "at most 9.223e+09"),
    # D: what the model builders divide, checked here with the key's name
    ("shared-tp2", 2, [*MOE, *TP2, "model.moe_shared_expert_ffn_hidden_size=33"],
     "model.moe_shared_expert_ffn_hidden_size=33: must be divisible by parallel.tp=2"),
    ("shared-tp4", 4, [*MOE, *TP2, "parallel.tp=4", "model.num_query_groups=4",
                       "model.moe_shared_expert_ffn_hidden_size=34"],
     "model.moe_shared_expert_ffn_hidden_size=34: must be divisible by parallel.tp=4"),
    ("shared-fp8", 1, [*MOE, "model.moe_shared_expert_ffn_hidden_size=40", "model.fp8=hybrid",
                       "model.linear_backend=te", "train.precision=bf16",
                       "model.num_query_groups=4"],
     "model.moe_shared_expert_ffn_hidden_size / tp = 40 must be a multiple of 16"),
    ("eod-100000", 1, ["data.eod_token_id=100000", "data.reset_attention_mask=true"],
     "data.eod_token_id=100000: must be a token id in [0, 512) (model.vocab_size)"),
    ("eod-off-beyond", 1, ["data.eod_token_id=512"], "data.eod_token_id=512: must be a token id"),
    ("eod-off-negative", 1, ["data.eod_token_id=-5"], "data.eod_token_id=-5"),
    # data sources: every file named is checked, used or not
    ("corpus-and-paths", 1, ["data.mock=false", "data.corpus=shakespeare", "data.paths=[{tmp}/d]"],
     "data.corpus='shakespeare': is set together with data.paths"),
    ("mock-tokenizer-missing", 1, ["data.tokenizer_model={tmp}/none.model"],
     "data.tokenizer_model='{tmp}/none.model': file does not exist"),
    ("mock-paths-missing", 1, ["data.paths=[{tmp}/none]"], "data.paths='{tmp}/none'"),
    ("mock-weights-count", 1, ["data.weights=[1]"], "data.weights=[1.0]: needs one weight per"),
    ("corpus-tokenizer-missing", 1,
     ["data.mock=false", "data.corpus=shakespeare", "data.tokenizer_model={tmp}/none.model"],
     "data.tokenizer_model='{tmp}/none.model'"),
    # multi-token prediction (models/mtp.py)
    ("mtp-negative", 1, ["model.mtp_num_layers=-1"], "model.mtp_num_layers=-1: must be an"),
    ("mtp-factor-negative", 1, ["model.mtp_num_layers=1", "model.mtp_loss_scaling_factor=-0.1"],
     "model.mtp_loss_scaling_factor=-0.1: must be a finite number >= 0"),
    ("mtp-factor-inf", 1, ["model.mtp_loss_scaling_factor=inf"],
     "model.mtp_loss_scaling_factor='inf': must be a finite number"),
    ("mtp-window", 1, ["model.mtp_num_layers=64"], "model.mtp_num_layers=64: must be < model"),
    ("mtp-gpt", 1, ["model.arch=gpt", "model.mtp_num_layers=1"],
     "model.mtp_num_layers=1: model.arch=gpt adds learned absolute positions"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("keys")
    _build(str(root / "d"), range(10, 300))
    return str(root)


def _build(prefix: str, ids, eod: int | None = None, docs: int = 30) -> None:
    import numpy as np

    from megatron_lite.data import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix) as builder:
        for _ in range(docs):
            doc = rng.choice(np.asarray(ids), 80)
            builder.add_document(doc if eod is None else np.append(doc, eod))


def _cfg(overrides, tmp=""):
    return load_config(SMOKE, [o.replace("{tmp}", tmp) for o in overrides])


@pytest.mark.parametrize("case, world, overrides, needle", ERRORS, ids=[c[0] for c in ERRORS])
def test_bad_key_is_refused_naming_it(tmp, case, world, overrides, needle):
    with pytest.raises(ConfigError) as e:
        validate(_cfg(overrides, tmp), world)
    message = str(e.value)
    assert needle.replace("{tmp}", tmp) in message, message
    assert "Fix:" in message, message


@pytest.mark.parametrize("tp", [2, 4])
def test_shared_expert_rule_agrees_with_the_builder(monkeypatch, tp):
    """Validation refuses exactly the shared-expert widths the builder (ColumnParallelLinear's
    segments over tp) would refuse on every rank, for widths around the multiples of tp."""
    import torch

    from megatron_lite.parallel import layers

    monkeypatch.setattr(layers, "_tp", lambda group: (tp, 0))  # a TP rank of `tp`, no group
    for width in range(2 * tp - 1, 4 * tp + 2):
        try:
            with torch.device("meta"):
                layers.ColumnParallelLinear(64, [width, width], None)
            builds = True
        except ValueError:
            builds = False
        overrides = [*MOE, *TP2, f"parallel.tp={tp}", "model.num_query_groups=4"]
        cfg = _cfg([*overrides, f"model.moe_shared_expert_ffn_hidden_size={width}"])
        try:
            validate(cfg, tp, warn=False)
            valid = True
        except ConfigError as e:
            assert "model.moe_shared_expert_ffn_hidden_size" in str(e), str(e)
            valid = False
        assert valid == builds, (width, tp, valid, builds)


# E: valid values of keys this run does not use: (case id, overrides, the warning's start)
WARNINGS = [
    ("dense-topk", ["model.moe_router_topk=4"], "model.moe_router_topk=4 has no effect: model."
     "num_experts is null"),
    ("dense-bias", ["model.moe_router_enable_expert_bias=true"], "moe_router_enable_expert_bias"),
    ("dense-shared", ["model.moe_shared_expert_ffn_hidden_size=64"], "size=64 has no effect"),
    ("dense-capacity", ["model.moe_capacity_factor=1.25"], "moe_capacity_factor=1.25 has no"),
    ("dense-score", ["model.moe_router_score_function=sigmoid"], "score_function='sigmoid' has"),
    ("rate-without-bias", [*MOE, "model.moe_router_bias_update_rate=0.01"],
     "model.moe_router_bias_update_rate=0.01 has no effect: model.moe_router_enable_expert_bias"),
    ("no-moe-layer", [*MOE, "model.moe_first_k_dense_replace=2"], "model.num_experts=4 has no"),
    ("llama-max-pos", ["model.max_position_embeddings=128"], "max_position_embeddings=128 has"),
    ("gpt-rope", ["model.arch=gpt", "model.rope_theta=500000"], "model.rope_theta=500000.0 has"),
    ("gpt-qkv-bias", ["model.arch=gpt", "model.add_qkv_bias=true"], "model.add_qkv_bias=True has"),
    ("group-score-no-groups", [*MOE, "model.moe_router_group_score=top2"],
     "model.moe_router_group_score='top2' has no effect: model.moe_router_num_groups is null"),
    ("fp8-recipe", ["model.fp8_recipe=delayed"], "model.fp8_recipe='delayed' has no effect"),
    ("fp32-residual", ["model.fp32_residual_connection=true"], "fp32_residual_connection=True"),
    ("recompute-list", ["model.recompute_modules=[mlp]"], "model.recompute_modules=['mlp'] has"),
    ("mock-tokenizer", ["data.tokenizer_model={tmp}/tok.model"], "data.tokenizer_model='{tmp}"),
    ("mock-split", ["data.split='9,1,0'"], "data.split='9,1,0' has no effect: data.mock=true"),
    ("mock-index-cache", ["data.index_cache_dir={tmp}/ic"], "data.index_cache_dir='{tmp}/ic'"),
    ("paths-cache-dir", ["data.mock=false", "data.paths=[{tmp}/d]", "data.cache_dir={tmp}/c"],
     "data.cache_dir='{tmp}/c' has no effect: they are for a built-in corpus"),
    ("paths-tok-vocab", ["data.mock=false", "data.paths=[{tmp}/d]", "data.tokenizer_vocab_size=9"],
     "data.tokenizer_vocab_size=9 has no effect"),
    ("corpus-tokenizer", ["data.mock=false", "data.corpus=shakespeare",
                          "data.tokenizer_model={tmp}/tok.model"], "trains its own tokenizer"),
    ("one-path-weights", ["data.mock=false", "data.paths=[{tmp}/d]", "data.weights=[2]"],
     "data.weights=[2.0] has no effect: one dataset is not blended"),
    ("mtp-factor-off", ["model.mtp_loss_scaling_factor=0.3"],
     "model.mtp_loss_scaling_factor=0.3 has no effect: model.mtp_num_layers=0"),
    ("eod-no-masking", ["data.eod_token_id=3"], "data.eod_token_id=3 has no effect: no document"),
    ("async-no-save", ["train.async_save=true"], "train.async_save=True has no effect: train.s"),
    ("keep-no-save", ["train.keep_checkpoints=5"], "train.keep_checkpoints=5 has no effect"),
    ("eval-iters", ["train.eval_iters=5"], "train.eval_iters=5 has no effect: train.eval_inter"),
    ("wandb-project", ["log.wandb_project=x"], "log.wandb_project='x' has no effect: log.wandb"),
    ("wandb-mode", ["log.wandb_mode=online"], "log.wandb_mode='online' has no effect"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tok_file(tmp) -> str:
    path = os.path.join(tmp, "tok.model")  # validation opens it only where data reads it
    with open(path, "wb") as f:
        f.write(b"not read here")
    return path


@pytest.mark.parametrize("case, overrides, needle", WARNINGS, ids=[c[0] for c in WARNINGS])
def test_key_without_effect_warns_once(tmp, tok_file, monkeypatch, capsys, case, overrides, needle):
    monkeypatch.setenv(WARNED_ENV, "")  # restored after the test (validate sets it)
    monkeypatch.delenv("RANK", raising=False)
    cfg = _cfg(overrides, tmp)
    messages = config_warnings(validate(cfg, 1, warn=False))
    needle = needle.replace("{tmp}", tmp)
    assert [m for m in messages if needle in m], messages
    assert all("Fix:" in m and "\n" not in m for m in messages), messages
    validate(cfg, 1)  # shows them
    validate(cfg, 1)  # the same run again (the launcher, then its ranks): not again
    err = capsys.readouterr().err
    assert err.count(needle) == 1 and err.startswith("warning: "), err
    assert config_warnings(validate(_cfg([], tmp), 1, warn=False)) == [], "smoke.yaml warns"


def test_warnings_show_on_rank_zero_only_and_once_per_run(monkeypatch, capsys):
    message = "model.x=1 has no effect: y. Fix: z."
    monkeypatch.setenv("RANK", "1")
    show_warnings([message])
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(WARNED_ENV, "")
    show_warnings([message])
    show_warnings([message])  # a process this one starts inherits the variable
    assert capsys.readouterr().err == f"warning: {message}\n"
    show_warnings(["another config's warning"])  # other messages are shown
    assert "another config's warning" in capsys.readouterr().err


# D: the data's vocabulary and its end-of-document tokens, checked where the data is read
# (train, launch and plan prepare it before any process group): (case id, overrides, needle)
DATA = ["data.mock=false", "model.vocab_size=null"]
MASK = "data.reset_attention_mask=true"
DATA_ERRORS = [
    ("eod-beyond-data-vocab", [*DATA, "data.paths=[{tmp}/d]", "data.eod_token_id=100000", MASK],
     "data.eod_token_id=100000: must be a token id in [0, 300) (the vocabulary of data.paths)"),
    ("eod-beyond-data-off", [*DATA, "data.paths=[{tmp}/d]", "data.eod_token_id=350"],
     "data.eod_token_id=350: must be a token id in [0, 300)"),
    ("no-eod-attention", [*DATA, "data.paths=[{tmp}/d]", "data.eod_token_id=7", MASK],
     "data.paths: {tmp}/d.bin holds no end-of-document token 7 (data.eod_token_id), so "
     "data.reset_attention_mask=true would do nothing"),
    ("no-eod-positions", [*DATA, "data.paths=[{tmp}/d]", "data.eod_token_id=7",
                          "data.reset_position_ids=true"], "data.reset_position_ids=true would"),
    ("no-eod-loss", [*DATA, "data.paths=[{tmp}/d]", "data.eod_token_id=7",
                     "data.eod_mask_loss=true"], "holds no end-of-document token 7"),
    ("no-eod-blend", [*DATA, "data.paths=[{tmp}/e,{tmp}/d]", "data.eod_token_id=7", MASK],
     "{tmp}/d.bin holds no end-of-document token 7"),
    ("no-eod-valid", [*DATA, "data.paths=[{tmp}/e]", "data.valid_paths=[{tmp}/d]",
                      "train.eval_interval=2", "data.eod_token_id=7", MASK],
     "data.valid_paths: {tmp}/d.bin holds no end-of-document token 7"),
    ("no-eos-tokenizer", [*DATA, "data.paths=[{tmp}/d]", "data.tokenizer_model={tok}", MASK],
     "holds no end-of-document token 2 (the tokenizer eos)"),
    ("eod-beyond-tokenizer", [*DATA, "data.paths=[{tmp}/d]", "data.tokenizer_model={tok}",
                              "data.eod_token_id=400", MASK],
     "data.eod_token_id=400: must be a token id in [0, 320) (the tokenizer's vocabulary)"),
    ("eod-beyond-tokenizer-model", [*DATA, "data.paths=[{tmp}/d]", "data.tokenizer_model={tok}",
                                    "model.vocab_size=512", "data.eod_token_id=400"],
     "data.eod_token_id=400: must be a token id in [0, 320) (the tokenizer's vocabulary)"),
]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp) -> tuple[str, str]:
    from megatron_lite.data import train_tokenizer

    _build(os.path.join(tmp, "e"), range(10, 300), eod=7)
    text = os.path.join(tmp, "tok.txt")
    with open(text, "w") as f:
        f.write("\n".join(f"line {i} of words abc def ghi" for i in range(300)))
    return tmp, train_tokenizer([text], os.path.join(tmp, "tok"), 320)


def _prepare(overrides, tmp, tok, monkeypatch):
    from megatron_lite import train

    monkeypatch.chdir(tmp)
    monkeypatch.delenv("RANK", raising=False)
    argv = ["--config", SMOKE, f"train.out_dir={tmp}/run"]
    argv += [o.replace("{tmp}", tmp).replace("{tok}", tok) for o in overrides]
    return train.prepare(argv, world_size=1, hardware=False)


@pytest.mark.parametrize("case, overrides, needle", DATA_ERRORS, ids=[c[0] for c in DATA_ERRORS])
def test_bad_data_key_is_refused_when_the_data_is_read(data_dir, monkeypatch, case, overrides,
                                                       needle):  # fmt: skip
    from megatron_lite.data import DataFileError

    tmp, tok = data_dir
    with pytest.raises((ConfigError, DataFileError)) as e:
        _prepare(overrides, tmp, tok, monkeypatch)
    message = str(e.value)
    assert needle.replace("{tmp}", tmp) in message and "Fix:" in message, message


def test_documents_that_end_with_eod_pass(data_dir, monkeypatch):
    """The control: the same run on data whose documents end with the EOD id trains."""
    tmp, tok = data_dir
    overrides = [
        *DATA,
        "data.paths=[{tmp}/e]",
        "data.eod_token_id=7",
        MASK,
        "data.eod_mask_loss=true",
    ]
    cfg, _, vocab = _prepare(overrides, tmp, tok, monkeypatch)
    assert vocab == 300 and cfg.data.eod_token_id == 7
