"""tools/convert_checkpoint.py refuses every bad input before writing anything: exit 2, a
message naming the file and the field (or tensor), no traceback, and no output or temporary
left behind. Inputs: config.json (not JSON, the wrong JSON type, each field missing, of the
wrong type or out of range, fields inconsistent with each other or with the weights), the
*.safetensors files (empty, truncated, a pickle, wrong shapes and dtypes, experts of unequal
shapes, missing/extra/repeated tensors), the directories themselves, and on the DCP side a
checkpoint that is missing, a file, not a checkpoint, or whose model config is out of range."""

import json
import os
import shutil

import pytest

pytest.importorskip("safetensors")

import torch  # noqa: E402

from tests.unit.convert_tiny import family_layout, write_hf  # noqa: E402
from tools import convert_checkpoint as convert  # noqa: E402


def _set(**kw):
    return lambda c: {**c, **kw}


def _drop(key):
    return lambda c: {k: v for k, v in c.items() if k != key}


CONFIG_CASES = [  # (id, family, config.json change (callable, or the raw bytes), needle)
    ("not-json", "llama", b"{model_type: llama", "is not JSON"),
    ("empty-file", "llama", b"", "is not JSON"),
    ("not-utf8", "llama", b'{"a": "\xff\xfe"}', "is not JSON"),
    ("a-list", "llama", b"[1, 2]", "holds a JSON list"),
    ("a-string", "llama", b'"llama"', "holds a JSON str"),
    ("nan-eps", "llama", _set(rms_norm_eps=float("nan")), "rms_norm_eps=nan"),
    ("string-hidden", "llama", _set(hidden_size="64"), "hidden_size='64'"),
    ("float-hidden", "llama", _set(hidden_size=8.0), "hidden_size=8.0"),
    ("no-hidden", "llama", _drop("hidden_size"), "has no hidden_size"),
    ("no-heads", "llama", _drop("num_attention_heads"), "has no num_attention_heads"),
    ("no-layers", "llama", _drop("num_hidden_layers"), "has no num_hidden_layers"),
    ("no-ffn", "llama", _drop("intermediate_size"), "has no intermediate_size"),
    ("no-vocab", "llama", _drop("vocab_size"), "has no vocab_size"),
    ("zero-heads", "llama", _set(num_attention_heads=0), "num_attention_heads=0"),
    ("negative-heads", "llama", _set(num_attention_heads=-2), "num_attention_heads=-2"),
    ("bool-heads", "llama", _set(num_attention_heads=True), "num_attention_heads=True"),
    ("zero-layers", "llama", _set(num_hidden_layers=0), "num_hidden_layers=0"),
    ("float-layers", "llama", _set(num_hidden_layers=1.0), "num_hidden_layers=1.0"),
    ("huge-layers", "llama", _set(num_hidden_layers=10**9), "num_hidden_layers=1000000000"),
    ("layers-vs-weights", "llama", _set(num_hidden_layers=3), "num_hidden_layers=3"),
    ("kv-not-dividing", "llama", _set(num_key_value_heads=3), "num_key_value_heads=3"),
    ("zero-kv", "llama", _set(num_key_value_heads=0), "num_key_value_heads=0"),
    ("odd-head-dim", "llama", _set(head_dim=3), "head_dim=3"),
    ("hidden-not-by-heads", "llama", _set(hidden_size=9), "hidden_size=9"),
    ("negative-vocab", "llama", _set(vocab_size=-1), "vocab_size=-1"),
    ("null-vocab", "llama", _set(vocab_size=None), "vocab_size=None"),
    ("vocab-vs-weights", "llama", _set(vocab_size=20), "model.embed_tokens.weight"),
    ("zero-eps", "llama", _set(rms_norm_eps=0), "rms_norm_eps=0"),
    ("string-theta", "llama", _set(rope_theta="1e4"), "rope_theta='1e4'"),
    ("negative-theta", "llama", _set(rope_theta=-1.0), "rope_theta=-1.0"),
    ("rope-list", "llama", _set(rope_parameters=[1]), "rope_parameters=[1]"),
    ("rope-zero-theta", "llama", _set(rope_parameters={"rope_theta": 0}), "rope_theta=0"),
    ("rope-scaling", "llama", _set(rope_scaling={"rope_type": "yarn"}), "rope scaling"),
    ("tie-string", "llama", _set(tie_word_embeddings="yes"), "tie_word_embeddings='yes'"),
    ("bias-string", "llama", _set(attention_bias="false"), "attention_bias='false'"),
    ("act-number", "llama", _set(hidden_act=5), "hidden_act=5"),
    ("act-gelu", "llama", _set(hidden_act="gelu"), "hidden_act gelu"),
    ("no-model-type", "llama", _drop("model_type"), "model_type=None"),
    ("model-type-list", "llama", _set(model_type=["llama"]), "model_type=['llama']"),
    ("zero-positions", "llama", _set(max_position_embeddings=0), "max_position_embeddings=0"),
    ("archs-string", "llama", _set(architectures="Llama"), "architectures='Llama'"),
    ("sparse-step-zero", "qwen3_moe", _set(decoder_sparse_step=0), "decoder_sparse_step=0"),
    ("sparse-step-none-moe", "qwen3_moe", _set(decoder_sparse_step=5), "no layer of 2 is MoE"),
    ("dense-out-of-range", "qwen3_moe", _set(mlp_only_layers=[5]), "mlp_only_layers=[5]"),
    ("dense-string", "qwen3_moe", _set(mlp_only_layers="0"), "mlp_only_layers='0'"),
    ("all-dense", "qwen3_moe", _set(mlp_only_layers=[0, 1]), "no layer of 2 is MoE"),
    ("zero-experts", "qwen3_moe", _set(num_experts=0), "num_experts=0"),
    ("experts-vs-weights", "qwen3_moe", _set(num_experts=4), "num_experts=4"),
    ("topk-above-experts", "qwen3_moe", _set(num_experts_per_tok=9), "num_experts_per_tok=9"),
    ("topk-zero", "qwen3_moe", _set(num_experts_per_tok=0), "num_experts_per_tok=0"),
    ("norm-topk-string", "qwen3_moe", _set(norm_topk_prob="true"), "norm_topk_prob='true'"),
    ("no-moe-ffn", "qwen3_moe", _drop("moe_intermediate_size"), "has no moe_intermediate_size"),
    ("negative-aux", "qwen3_moe", _set(router_aux_loss_coef=-1), "router_aux_loss_coef=-1"),
    ("window-bool", "qwen3_moe", _set(use_sliding_window=1), "use_sliding_window=1"),
    ("mixtral-experts-str", "mixtral", _set(num_local_experts="2"), "num_local_experts='2'"),
    ("mixtral-window", "mixtral", _set(sliding_window="x"), "sliding_window='x'"),
    ("mixtral-jitter", "mixtral", _set(router_jitter_noise=-0.5), "router_jitter_noise=-0.5"),
    ("mixtral-topk", "mixtral", _set(num_experts_per_tok=3), "num_experts_per_tok=3"),
    ("mixtral-experts-vs-weights", "mixtral", _set(num_local_experts=1), "num_local_experts=1"),
]


def _refused(capsys, argv, *needles, out=None):
    """Run the converter in-process: exit 2, every needle in the message, no traceback, and
    nothing created at `out` or beside it."""
    parent = os.path.dirname(out) if out else None
    before = set(os.listdir(parent)) if parent and os.path.isdir(parent) else None
    assert convert.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in: {err}"
    if out is not None:
        assert not os.path.exists(out), f"{out} was written"
        if before is not None:
            assert set(os.listdir(parent)) == before, "something was left beside the output"
    return err


@pytest.mark.parametrize(
    "case, family, change, needle", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES]
)
def test_bad_config_json_names_file_and_field(tmp_path, capsys, case, family, change, needle):
    config, _ = family_layout(family)
    hf = write_hf(tmp_path / "hf", family)
    file = os.path.join(hf, "config.json")
    with open(file, "wb") as f:
        f.write(change if isinstance(change, bytes) else json.dumps(change(config)).encode())
    out = str(tmp_path / "out")
    err = _refused(capsys, ["hf-to-dcp", hf, out], needle, out=out)
    assert file in err or hf in err, err  # the file (or, for the weights, the directory)


# ------------------------------------------------------------------ the weights
def _save(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})


def _tensors(family="llama", dtype=torch.float32, **shape_changes):
    _, shapes = family_layout(family)
    shapes = {**shapes, **shape_changes}
    return {k: torch.zeros(s, dtype=dtype) for k, s in shapes.items() if s is not None}


Q = "model.layers.0.self_attn.q_proj.weight"
E1 = "model.layers.1.mlp.experts.1.gate_proj.weight"


def _write_weights(hf, how):
    file = os.path.join(hf, "model.safetensors")
    data = open(file, "rb").read()
    if how == "empty":
        open(file, "wb").close()
    elif how == "truncated":
        open(file, "wb").write(data[: len(data) // 2])
    elif how == "garbage":
        open(file, "wb").write(b"\x00\x01garbage" * 10)
    elif how == "pickle":
        torch.save({"w": torch.zeros(2)}, file)
    elif how == "header-too-big":
        open(file, "wb").write((1 << 40).to_bytes(8, "little") + b"{}")
    elif how == "a-directory":
        os.remove(file)
        os.mkdir(file)
    elif how == "none":
        os.remove(file)
    elif how == "repeated":
        _save(os.path.join(hf, "model-00002.safetensors"), {Q: torch.zeros(8, 8)})
    elif how == "int-dtype":
        _save(file, _tensors(dtype=torch.int64))
    elif how == "bool-dtype":
        _save(file, _tensors(dtype=torch.bool))
    elif how == "transposed":
        _save(file, {**_tensors(), Q: torch.zeros(8, 4)})
    elif how == "missing":
        _save(file, _tensors(**{Q: None}))
    elif how == "extra":
        _save(file, {**_tensors(), "model.layers.0.mlp.bias": torch.zeros(8)})
    elif how == "unequal-experts":
        _save(file, _tensors("qwen3_moe", **{E1: (5, 8)}))
    elif how == "layer-out-of-range":
        _save(file, {**_tensors(), "model.layers.7.input_layernorm.weight": torch.zeros(8)})
    return file


WEIGHT_CASES = [  # (how, family, needles: "{file}" is model.safetensors)
    ("empty", "llama", ["{file}", "not a readable safetensors file"]),
    ("truncated", "llama", ["{file}", "not a readable safetensors file"]),
    ("garbage", "llama", ["{file}", "not a readable safetensors file"]),
    ("pickle", "llama", ["{file}", "not a readable safetensors file"]),
    ("header-too-big", "llama", ["{file}", "not a readable safetensors file"]),
    ("a-directory", "llama", ["{file}", "not a readable safetensors file"]),
    ("none", "llama", ["has no *.safetensors files"]),
    ("repeated", "llama", ["model-00002.safetensors", "repeats tensor " + Q, "{file}"]),
    ("int-dtype", "llama", ["{file}", "dtype int64"]),
    ("bool-dtype", "llama", ["{file}", "dtype bool"]),
    ("transposed", "llama", ["{file}", Q, "shape [8, 4]"]),
    ("missing", "llama", ["tensors missing", Q]),
    ("extra", "llama", ["unexpected", "model.layers.0.mlp.bias"]),
    ("unequal-experts", "qwen3_moe", ["{file}", E1, "shape [5, 8]"]),
    ("layer-out-of-range", "llama", ["num_hidden_layers=1", "layers 0..7"]),
]


@pytest.mark.parametrize("how, family, needles", WEIGHT_CASES, ids=[c[0] for c in WEIGHT_CASES])
def test_bad_weights_name_the_file_and_tensor(tmp_path, capsys, how, family, needles):
    hf = write_hf(tmp_path / "hf", family)
    file = _write_weights(hf, how)
    out = str(tmp_path / "out")
    _refused(capsys, ["hf-to-dcp", hf, out], *[n.format(file=file) for n in needles], out=out)


def test_bad_input_directories(tmp_path, capsys):
    out = str(tmp_path / "out")
    missing = str(tmp_path / "nope")
    _refused(capsys, ["hf-to-dcp", missing, out], missing, "does not exist", out=out)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _refused(capsys, ["hf-to-dcp", str(a_file), out], str(a_file), "not a directory", out=out)
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(capsys, ["hf-to-dcp", str(empty), out], "config.json does not exist", out=out)
    (empty / "config.json").mkdir()
    _refused(capsys, ["hf-to-dcp", str(empty), out], "config.json is a directory", out=out)


# ------------------------------------------------------------------ our checkpoints (dcp-to-hf)
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    hf = write_hf(root / "hf", "llama")
    convert.hf_to_dcp(hf, str(root / "ckpt"))
    return str(root / "ckpt")


def _with_model(ckpt, tmp_path, **model):
    path = str(tmp_path / "ckpt")
    shutil.copytree(ckpt, path)
    file = os.path.join(path, "metadata.json")
    meta = json.load(open(file))
    meta["config"]["model"].update(model)
    json.dump(meta, open(file, "w"))
    return path


DCP_MODEL_CASES = [  # (model.* change in metadata.json, needle)
    ({"num_attention_heads": 0}, "model.num_attention_heads=0"),
    ({"hidden_size": 0}, "model.hidden_size=0"),
    ({"num_layers": 10**9}, "model.num_layers=1000000000"),
    ({"num_layers": 2}, "model.num_layers=2"),
    ({"num_query_groups": 3, "num_attention_heads": 2}, "model.num_query_groups=3"),
    ({"kv_channels": 0}, "model.kv_channels=0"),
    ({"hidden_size": 16}, "embedding.weight has shape [16, 8]"),
    ({"ffn_hidden_size": 12}, "layers.0.mlp.linear_fc1.weight/gate has shape [16, 8]"),
    ({"arch": "gpt"}, "model.arch='gpt'"),
]


@pytest.mark.parametrize("change, needle", DCP_MODEL_CASES, ids=[n for _, n in DCP_MODEL_CASES])
def test_checkpoint_with_a_bad_model_config(ckpt, tmp_path, capsys, change, needle):
    path = _with_model(ckpt, tmp_path, **change)
    out = str(tmp_path / "hf")
    _refused(capsys, ["dcp-to-hf", path, out], path, needle, out=out)


def test_bad_checkpoint_paths(tmp_path, capsys):
    out = str(tmp_path / "hf")
    missing = str(tmp_path / "nope")
    _refused(capsys, ["dcp-to-hf", missing, out], missing, "does not exist", out=out)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _refused(capsys, ["dcp-to-hf", str(a_file), out], str(a_file), "not a directory", out=out)
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(capsys, ["dcp-to-hf", str(empty), out], "metadata.json does not exist", out=out)
    hf = write_hf(tmp_path / "hf_model", "llama")  # an HF directory is not our checkpoint
    _refused(capsys, ["dcp-to-hf", hf, out], hf, "not a complete megatron_lite", out=out)


@pytest.mark.parametrize("name, how", [("__0_0.distcp", "truncate"), (".metadata", "remove")])
def test_damaged_checkpoint_files_are_named(ckpt, tmp_path, capsys, name, how):
    path = str(tmp_path / "ckpt")
    shutil.copytree(ckpt, path)
    file = os.path.join(path, name)
    if how == "truncate":
        os.truncate(file, os.path.getsize(file) // 2)
    else:
        os.remove(file)
    out = str(tmp_path / "hf")
    _refused(capsys, ["dcp-to-hf", path, out], file, out=out)


def test_case_count():
    """The issue's count: distinct bad inputs this file exercises."""
    n = len(CONFIG_CASES) + len(WEIGHT_CASES) + len(DCP_MODEL_CASES) + 4 + 4 + 2
    assert n >= 45, n
