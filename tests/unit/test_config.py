"""Config loading, overrides and validation messages (no processes)."""

import pytest

from megatron_lite.config import ConfigError, load_config
from megatron_lite.validation import validate

P2P = ["parallel.cp_comm_type=p2p"]
HYBRID = ["parallel.cp_comm_type=a2a+p2p", "parallel.cp_a2a_size=2"]


def _cfg(*overrides):
    return load_config(None, ["data.mock=true", "model.vocab_size=128", *overrides])


def _error(world, *overrides) -> str:
    with pytest.raises(ConfigError) as e:
        validate(_cfg(*overrides), world)
    return str(e.value)


def test_overrides_are_typed_and_dp_is_derived():
    cfg = validate(_cfg("parallel.tp=2", "train.lr=1e-3", "train.steps=7"), 8)
    assert cfg.parallel.tp == 2 and cfg.parallel.dp == 4
    assert cfg.train.lr == 1e-3 and cfg.train.steps == 7
    assert cfg.model.num_query_groups == cfg.model.num_attention_heads


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(ConfigError, match="Did you mean 'model.hidden_size'"):
        load_config(None, ["model.hiden_size=3"])
    with pytest.raises(ConfigError, match="Did you mean 'train'"):
        load_config(None, ["trian.steps=3"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(None, ["train.steps=abc"])


@pytest.mark.parametrize(
    "world, overrides, needle",
    [
        (
            3,
            ["parallel.tp=3"],
            "parallel.tp=3: model.num_attention_heads=4 must be divisible by tp",
        ),
        (6, ["parallel.tp=2", "parallel.dp=2"], "world size 6 must equal tp·pp·cp·dp"),
        (6, ["parallel.tp=4"], "world size 6 must be divisible by tp·pp·cp"),
        (2, ["model.num_query_groups=3"], "model.num_query_groups=3: must divide"),
        (4, ["parallel.pp=4", "model.num_layers=6"], "model.num_layers=6: must be divisible by pp"),
        (2, ["train.global_batch_size=6", "train.micro_batch_size=2"], "multiple of micro_batch"),
        (
            4,
            [
                "parallel.pp=4",
                "model.num_layers=4",
                "train.global_batch_size=4",
                "train.micro_batch_size=2",
            ],
            "fewer than the 4 pipeline stages",
        ),
        (
            2,
            ["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_length=63"],
            "model.seq_length=63: must be divisible by cp·tp",
        ),
        (1, ["model.arch=bert"], "model.arch='bert': must be one of llama, gpt"),
        (1, ["parallel.ep=2"], "needs an MoE model"),
        (
            3,
            ["parallel.cp=3"],
            "query heads per TP rank (4) must be divisible by the Ulysses ranks",
        ),
        (
            2,
            ["parallel.cp=2", "model.seq_length=63"],
            "model.seq_length=63: must be divisible by cp",
        ),
        (
            2,
            ["model.num_experts=3", "parallel.ep=2"],
            "model.num_experts=3 must be divisible by ep",
        ),
        (
            2,
            ["model.num_experts=4", "model.moe_router_topk=5"],
            "must be between 1 and num_experts",
        ),
        (4, ["parallel.tp=2", "model.num_experts=4", "parallel.ep=4"], "must divide dp·cp"),
        (1, ["model.num_experts=4", "model.moe_layer_freq=0"], "model.moe_layer_freq=0"),
        (1, ["model.num_experts=4", "model.moe_capacity_factor=0"], "must be > 0 when set"),
        # context parallelism of each type (parallel.cp_comm_type)
        (4, [*P2P, "parallel.cp=4", "model.seq_length=36"], "and by 2·ring"),
        (4, ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p"], "a2a+p2p needs Ulysses groups"),
        (4, [*HYBRID, "parallel.cp=4", "parallel.cp_a2a_size=4"], "a2a+p2p needs Ulysses"),
        (2, ["parallel.cp=2", "parallel.cp_a2a_size=2"], "only a2a+p2p uses it"),
        (2, [*P2P, "parallel.cp=2", "model.attention_dropout=0.1"], "has no attention dropout"),
        (2, [*P2P, "parallel.cp=2", "model.attention_backend=flash"], "computes its blocks in"),
        (
            8,
            [*HYBRID, "parallel.cp=8", "model.hidden_size=96", "model.num_attention_heads=3"],
            "the Ulysses ranks (2",
        ),
        (
            2,
            [*P2P, "parallel.cp=2", "model.num_experts=4", "model.moe_capacity_factor=1.0"],
            "token dropping follows the sequence order",
        ),
        (
            1,
            ["data.mock=false", "data.paths=[/nonexistent/x]"],
            "/nonexistent/x.bin does not exist",
        ),
    ],
)
def test_rules_name_key_value_rule_and_fix(world, overrides, needle):
    msg = _error(world, *overrides)
    assert needle in msg, msg
    assert "Fix:" in msg, msg


def test_yaml_file_and_missing_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  hidden_size: 32\ntrain:\n  steps: 3\n")
    cfg = load_config(str(path), ["train.steps=5"])
    assert cfg.model.hidden_size == 32 and cfg.train.steps == 5
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    path.write_text("model:\n  hidden_sise: 32\n")
    with pytest.raises(ConfigError, match="Did you mean 'model.hidden_size'"):
        load_config(str(path))


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["log.interval=0"], "log.interval=0: must be >= 1"),
        (["model.arch=gpt", "model.max_position_embeddings=10"], "must be >= model.seq_length"),
        (["train.global_batch_size=0"], "train.global_batch_size=0: must be >= 1"),
        (["model.hidden_size=12"], "rotary embeddings need an even head dim"),
        (["model.make_vocab_size_divisible_by=0"], "make_vocab_size_divisible_by=0"),
        (["train.adam_beta1=1.5"], "train.adam_beta1=1.5: must be in [0, 1)"),
        (["model.num_query_groups=0"], "model.num_query_groups=0: must be >= 1"),
        (["parallel.timeout_s=0"], "parallel.timeout_s=0.0: must be a positive number of seconds"),
        (["model.vocab_size=0"], "model.vocab_size=0: must be >= 1"),
        (["parallel.order=tp-cp-pp-ep-dp"], "cp, ep and dp must be adjacent"),
    ],
)
def test_values_that_would_fail_after_start_up_are_rejected(overrides, needle):
    msg = _error(1, *overrides)
    assert needle in msg and "Fix:" in msg, msg


def test_moe_with_tp_needs_sequence_parallel():
    msg = _error(2, "parallel.tp=2", "model.num_experts=4")
    assert "needs sequence parallelism" in msg, msg
