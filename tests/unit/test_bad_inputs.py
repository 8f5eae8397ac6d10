"""A hostile user's table: every bad input ends in exit code 2 with one message that names the
key or the file, and no traceback. Cases run in-process (train / launch / preprocess mains under
capsys); a few at the end go through real subprocesses to prove the CLI path."""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_lite import launch, train
from megatron_lite.data import IndexedDatasetBuilder, train_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")
PREPROCESS = os.path.join(ROOT, "tools", "preprocess_data.py")
LONG = "n" * 300  # one path component beyond NAME_MAX (255)
DEEP = "/".join(["d" * 200] * 25)  # 5 KB: beyond PATH_MAX (4096)
_spec = importlib.util.spec_from_file_location("preprocess_data", PREPROCESS)
preprocess_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(preprocess_data)
DATA = ["data.mock=false", "data.paths=[{tmp}/d]"]  # a dataset built by the fixture

# (case id, arguments after `--config smoke.yaml` ({tmp} = the fixture's directory), needle)
CONFIG_CASES = [
    # model
    ("ffn-zero", ["model.ffn_hidden_size=0"], "model.ffn_hidden_size=0: must be >= 1"),
    ("ffn-negative", ["model.ffn_hidden_size=-64"], "model.ffn_hidden_size=-64"),
    ("rope-zero", ["model.rope_theta=0"], "model.rope_theta=0.0: must be > 0"),
    ("rope-nan", ["model.rope_theta=.nan"], "model.rope_theta=nan: must be a finite"),
    ("norm-eps-negative", ["model.norm_eps=-1"], "model.norm_eps=-1.0: must be > 0"),
    ("norm-eps-inf", ["model.norm_eps=.inf"], "model.norm_eps=inf: must be a finite"),
    ("init-std-negative", ["model.init_method_std=-0.1"], "model.init_method_std=-0.1"),
    ("init-std-inf", ["model.init_method_std=.inf"], "model.init_method_std=inf"),
    ("dropout-one", ["model.hidden_dropout=1.0"], "model.hidden_dropout=1.0: must be in [0, 1)"),
    ("attn-dropout-neg", ["model.attention_dropout=-0.1"], "model.attention_dropout=-0.1"),
    ("vocab-zero", ["model.vocab_size=0"], "model.vocab_size=0: must be >= 1"),
    ("vocab-div-zero", ["model.make_vocab_size_divisible_by=0"], "make_vocab_size_divisible_by"),
    ("layers-zero", ["model.num_layers=0"], "model.num_layers=0: must be >= 1"),
    ("heads-zero", ["model.num_attention_heads=0"], "model.num_attention_heads=0"),
    ("hidden-not-int", ["model.hidden_size=abc"], "model.hidden_size='abc': expected int"),
    ("seq-float", ["model.seq_length=1.5"], "model.seq_length=1.5: expected int"),
    ("arch-unknown", ["model.arch=bert"], "model.arch='bert': must be one of"),
    ("aux-loss-negative", ["model.moe_aux_loss_coeff=-1"], "model.moe_aux_loss_coeff=-1.0"),
    ("tie-not-bool", ["model.tie_embeddings=maybe"], "model.tie_embeddings='maybe'"),
    ("model-typo", ["model.hiden_size=3"], "Did you mean 'model.hidden_size'"),
    # parallel
    ("timeout-inf", ["parallel.timeout_s=.inf"], "parallel.timeout_s=inf: must be a finite"),
    ("timeout-zero", ["parallel.timeout_s=0"], "parallel.timeout_s=0.0: must be a positive"),
    # timedelta (the process group's timeout) overflows above ~9.2e9 s: refused before it
    (
        "timeout-huge",
        ["parallel.timeout_s=1e15"],
        "parallel.timeout_s=1000000000000000.0: must be a positive",
    ),
    ("timeout-negative", ["parallel.timeout_s=-5"], "parallel.timeout_s=-5.0"),
    ("tp-zero", ["parallel.tp=0"], "parallel.tp=0: must be >= 1"),
    ("pp-negative", ["parallel.pp=-1"], "parallel.pp=-1: must be >= 1"),
    ("order-short", ["parallel.order=tp-dp"], "parallel.order"),
    ("cp-comm", ["parallel.cp_comm_type=ring"], "parallel.cp_comm_type='ring'"),
    ("dp-zero", ["parallel.dp=0"], "parallel.dp=0"),
    ("sp-not-bool", ["parallel.sequence_parallel=2"], "parallel.sequence_parallel=2"),
    # data
    ("paths-int", ["data.mock=false", "data.paths=[1]"], "data.paths=[1]: element 0"),
    ("paths-nested", ["data.mock=false", "data.paths=[[a]]"], "data.paths=[['a']]: element 0"),
    ("weights-str", ["data.weights=[a]"], "data.weights=['a']: element 0"),
    ("weights-nan", [*DATA, "data.weights=[.nan]"], "data.weights=[nan]: element 0"),
    ("weights-negative", [*DATA, "data.weights=[-1]"], "data.weights=[-1.0]"),
    ("weights-count", [*DATA, "data.weights=[1, 2]"], "needs one weight per path"),
    ("paths-missing", ["data.mock=false", "data.paths=[{tmp}/no]"], "{tmp}/no.bin does not exist"),
    ("paths-ext", ["data.mock=false", "data.paths=[{tmp}/d.bin]"], "without the .bin extension"),
    ("tokenizer-missing", [*DATA, "data.tokenizer_model={tmp}/no.model"], "data.tokenizer_model"),
    ("tokenizer-dir", [*DATA, "data.tokenizer_model={tmp}"], "data.tokenizer_model"),
    ("corpus-unknown", ["data.mock=false", "data.corpus=wikipedia"], "data.corpus='wikipedia'"),
    ("tok-vocab-zero", ["data.tokenizer_vocab_size=0"], "data.tokenizer_vocab_size=0"),
    ("no-data", ["data.mock=false"], "no training data"),
    ("mock-no-vocab", ["model.vocab_size=null"], "mock data needs an explicit vocabulary"),
    # document masking: an EOD id in the vocabulary, a backend that takes the mask
    *[
        (f"no-eod-{flag}", [f"data.{flag}=true"], "data.eod_token_id=None: data." + flag)
        for flag in ("reset_attention_mask", "reset_position_ids", "eod_mask_loss")
    ],
    ("no-eod-paths", [*DATA, "data.eod_mask_loss=true"], "set data.eod_token_id to the id"),
    ("eod-beyond-vocab", ["data.eod_token_id=512"], "data.eod_token_id=512: must be a token id"),
    ("eod-negative", ["data.eod_token_id=-1"], "data.eod_token_id=-1: must be a token id"),
    (
        "doc-mask-te",
        ["data.eod_token_id=2", "data.reset_attention_mask=true", "model.attention_backend=te"],
        "model.attention_backend='te': data.reset_attention_mask needs a per-document mask",
    ),
    # data.cache_dir (used when a corpus is prepared)
    *[
        (f"cache-{kind}", ["data.mock=false", "data.corpus=shakespeare", f"data.cache_dir={p}"], n)
        for kind, p, n in [
            ("file", "{tmp}/afile", "exists and is a file"),
            ("under-file", "{tmp}/afile/c", "lies under {tmp}/afile, which is a file"),
            ("long-name", f"{{tmp}}/{LONG}", "NAME_MAX"),
        ]
    ],
    # train
    ("lr-inf", ["train.lr=.inf"], "train.lr=inf: must be a finite number"),
    ("lr-nan", ["train.lr=nan"], "train.lr='nan': must be a finite number"),
    ("lr-zero", ["train.lr=0"], "train.lr=0.0: must be > 0"),
    ("lr-negative", ["train.lr=-1e-3"], "train.lr=-0.001: must be > 0"),
    ("min-lr-above-lr", ["train.min_lr=0.1"], "train.min_lr=0.1: must be <= train.lr=0.001"),
    ("min-lr-negative", ["train.min_lr=-1"], "train.min_lr=-1.0: must be >= 0"),
    ("decay-zero", ["train.lr_decay_steps=0"], "train.lr_decay_steps=0: must be >= 1"),
    ("decay-negative", ["train.lr_decay_steps=-5"], "train.lr_decay_steps=-5"),
    ("warmup-negative", ["train.warmup_steps=-1"], "train.warmup_steps=-1"),
    ("steps-zero", ["train.steps=0"], "train.steps=0: must be >= 1"),
    ("steps-word", ["train.steps=ten"], "train.steps='ten': expected int"),
    ("beta1-one", ["train.adam_beta1=1.0"], "train.adam_beta1=1.0: must be in [0, 1)"),
    ("beta2-negative", ["train.adam_beta2=-0.1"], "train.adam_beta2=-0.1"),
    ("eps-zero", ["train.adam_eps=0"], "train.adam_eps=0.0: must be > 0"),
    ("clip-negative", ["train.grad_clip=-1"], "train.grad_clip=-1.0"),
    ("wd-negative", ["train.weight_decay=-0.1"], "train.weight_decay=-0.1"),
    ("save-negative", ["train.save_interval=-1"], "train.save_interval=-1"),
    ("keep-zero", ["train.keep_checkpoints=0"], "train.keep_checkpoints=0"),
    ("mbs-zero", ["train.micro_batch_size=0"], "train.micro_batch_size=0"),
    ("gbs-zero", ["train.global_batch_size=0"], "train.global_batch_size=0"),
    ("precision", ["train.precision=fp16"], "train.precision='fp16'"),
    ("seed-float", ["train.seed=1.5"], "train.seed=1.5: expected int"),
    ("resume-bool", ["train.resume=true"], "train.resume=True: expected str"),
    ("resume-file", ["train.resume={tmp}/afile"], "is a file, not a checkpoint directory"),
    ("resume-missing", ["train.resume={tmp}/nowhere"], "train.resume='{tmp}/nowhere'"),
    ("init-from-file", ["train.init_from={tmp}/afile"], "must be an existing checkpoint dir"),
    # output paths: exists as a file, under a file, name too long, path too long, empty
    ("out-file", ["train.out_dir={tmp}/afile"], "train.out_dir='{tmp}/afile': exists and is"),
    ("out-under-file", ["train.out_dir={tmp}/afile/run"], "lies under {tmp}/afile"),
    ("out-long-name", [f"train.out_dir={{tmp}}/{LONG}"], "NAME_MAX"),
    ("out-long-path", [f"train.out_dir={{tmp}}/{DEEP}"], "PATH_MAX"),
    ("out-empty", ["train.out_dir=''"], "train.out_dir='': is empty"),
    ("out-null", ["train.out_dir="], "train.out_dir: null is not allowed"),
    ("ckpt-file", ["train.ckpt_dir={tmp}/afile", "train.save_interval=5"], "train.ckpt_dir="),
    ("ckpt-under-file", ["train.ckpt_dir={tmp}/afile/c", "train.save_interval=5"], "lies under"),
    ("ckpt-long", [f"train.ckpt_dir={{tmp}}/{LONG}", "train.save_interval=5"], "NAME_MAX"),
    ("ckpt-file-no-save", ["train.ckpt_dir={tmp}/afile"], "train.ckpt_dir='{tmp}/afile'"),
    ("ckpt-default-file", ["train.out_dir={tmp}/run"], "means <out_dir>/checkpoints"),
    # log
    ("log-interval-zero", ["log.interval=0"], "log.interval=0: must be >= 1"),
    ("log-interval-neg", ["log.interval=-1"], "log.interval=-1"),
    ("wandb-mode", ["log.wandb_mode=cloud"], "log.wandb_mode='cloud'"),
    ("progress-not-bool", ["log.progress=3"], "log.progress=3: expected bool"),
    ("log-typo", ["log.wandbproject=x"], "Did you mean 'log.wandb_project'"),
    # override syntax
    ("section-typo", ["trian.steps=3"], "Did you mean 'train'"),
    ("no-equals", ["train.steps"], "must look like section.key=value"),
    ("three-parts", ["a.b.c=1"], "must be <section>.<name>"),
]

# config files: (case id, file name the fixture writes, needle)
FILE_CASES = [
    ("file-not-utf8", "latin1.yaml", "is not UTF-8 text"),
    ("file-dup-key", "dup_key.yaml", "key 'lr' is given twice"),
    ("file-dup-section", "dup_section.yaml", "key 'train' is given twice"),
    ("file-not-mapping", "list.yaml", "not a mapping of sections"),
    ("file-section-list", "section_list.yaml", "section 'train' is a list"),
    ("file-bad-yaml", "broken.yaml", "is not valid YAML"),
    ("file-missing", "nope.yaml", "does not exist"),
    ("file-is-dir", "", "is a directory"),
    ("file-wrong-type", "wrong_type.yaml", "wrong_type.yaml: train.steps='many'"),
    ("file-inf", "inf.yaml", "train.lr=inf: must be a finite"),
]
FILES = {
    "latin1.yaml": "train:\n  out_dir: caf\xe9\n".encode("latin-1"),
    "dup_key.yaml": b"train:\n  lr: 0.1\n  lr: 0.2\n",
    "dup_section.yaml": b"train:\n  lr: 0.1\nmodel:\n  num_layers: 2\ntrain:\n  steps: 3\n",
    "list.yaml": b"- train\n- model\n",
    "section_list.yaml": b"train:\n  - steps\n",
    "broken.yaml": b"train: [1, 2\n",
    "wrong_type.yaml": b"train:\n  steps: many\n",
    "inf.yaml": b"train:\n  lr: .inf\n",
}

# data files: (case id, how the fixture damages a fresh dataset at {tmp}/<id>, needle)
DATA_CASES = [
    ("bin-missing", "rm .bin", "-missing.bin does not exist"),
    ("idx-missing", "rm .idx", "-missing.idx does not exist"),
    ("bin-truncated", "truncate .bin", "truncated or belongs to another index"),
    ("idx-magic", "magic .idx", "bad magic header"),
    ("idx-truncated", "truncate .idx", "the index is truncated or corrupt"),
    ("bin-random", "random .bin", "was changed after preprocessing"),
    ("ids-beyond-vocab", "big ids", "model.vocab_size=512 is smaller than the 700 tokens"),
    ("bin-is-dir", "dir .bin", ".bin is a directory"),
]


def _build(prefix: str, top: int = 400) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix) as builder:
        for _ in range(20):
            builder.add_document(rng.integers(0, top, 100))
        builder.add_document([top - 1])


def _damage(prefix: str, how: str) -> None:
    what, ext = how.split()
    path = prefix + ext
    if how == "big ids":
        _build(prefix, top=700)  # a consistent dataset whose ids do not fit model.vocab_size
    elif what == "rm":
        os.remove(path)
    elif what == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 6)
    elif what == "magic":
        with open(path, "r+b") as f:
            f.write(b"NOTANIDX")
    elif what == "random":  # same size, other content: ids up to 65535
        size = os.path.getsize(path)
        noise = np.random.default_rng(1).integers(0, 65535, size // 2, dtype=np.uint16)
        with open(path, "wb") as f:
            f.write(noise.tobytes())
    elif what == "dir":
        os.remove(path)
        os.mkdir(path)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("bad")
    (root / "afile").write_text("not a directory\n")
    (root / "run").mkdir()
    (root / "run" / "checkpoints").write_text("a file where the checkpoints go\n")
    _build(str(root / "d"))
    for name, data in FILES.items():
        (root / name).write_bytes(data)
    (root / "empty.txt").write_text("")
    (root / "blank.txt").write_text("  \n\n \t\n")
    (root / "text.txt").write_text("some words to tokenize\n" * 50)
    for case, how, _ in DATA_CASES:
        _build(str(root / case))
        _damage(str(root / case), how)
    return str(root)


@pytest.fixture(scope="module")
def tokenizer(tmp) -> str:
    text = os.path.join(tmp, "tok.txt")
    with open(text, "w") as f:
        f.write("\n".join(f"line {i} of words abc def ghi" for i in range(300)))
    return train_tokenizer([text], os.path.join(tmp, "tok"), 320)


@pytest.fixture(autouse=True)
def _no_training(monkeypatch, tmp_path):
    """A case that passes validation must not start training: fail loudly instead."""
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)

    def started(cfg):
        raise AssertionError("the bad input passed validation and training started")

    monkeypatch.setattr(train, "init_distributed", started)
    monkeypatch.setattr(os, "execvpe", lambda *a: started(None))


def _exit_code(main, argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return e.value.code, err


def _fill(items, tmp):
    return [s.replace("{tmp}", tmp) for s in items]


@pytest.mark.parametrize("case, args, needle", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_value(tmp, capsys, case, args, needle):
    code, err = _exit_code(train.main, ["--config", SMOKE, *_fill(args, tmp)], capsys)
    assert code == 2 and needle.replace("{tmp}", tmp) in err, err
    assert err.startswith("error: ") and err.strip().count("\n") == 0, err


@pytest.mark.parametrize("case, name, needle", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_bad_config_file(tmp, capsys, case, name, needle):
    path = os.path.join(tmp, name) if name else tmp
    code, err = _exit_code(train.main, ["--config", path], capsys)
    assert code == 2 and needle in err and path in err, err


@pytest.mark.parametrize("case, how, needle", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_data_file(tmp, capsys, case, how, needle):
    prefix = os.path.join(tmp, case)
    argv = ["--config", SMOKE, "data.mock=false", f"data.paths=[{prefix}]"]
    code, err = _exit_code(train.main, argv, capsys)
    assert code == 2 and needle in err and prefix in err, err


PREPROCESS_CASES = [
    ("empty-input", ["--input", "{tmp}/empty.txt"], "{tmp}/out", "no tokens to write"),
    ("blank-input", ["--input", "{tmp}/blank.txt", "--split-lines"], "{tmp}/out", "no tokens"),
    ("input-missing", ["--input", "{tmp}/nope.txt"], "{tmp}/out", "input file does not exist"),
    ("out-in-file", ["--input", "{tmp}/text.txt"], "{tmp}/afile/x", "afile exists and is a file"),
    ("out-under-file", ["--input", "{tmp}/text.txt"], "{tmp}/afile/s/x", "which is a file"),
    ("out-long-name", ["--input", "{tmp}/text.txt"], f"{{tmp}}/{LONG[:250]}", "NAME_MAX"),
    ("out-is-dir", ["--input", "{tmp}/text.txt"], "{tmp}/", "does not end in a file name"),
    ("out-bin-dir", ["--input", "{tmp}/text.txt"], "{tmp}/bin-is-dir", "is a directory"),
]


@pytest.mark.parametrize(
    "case, args, prefix, needle", PREPROCESS_CASES, ids=[c[0] for c in PREPROCESS_CASES]
)
def test_bad_preprocess_input(tmp, tokenizer, capsys, case, args, prefix, needle):
    prefix = prefix.replace("{tmp}", tmp)
    before = sorted(os.listdir(tmp))
    argv = [*_fill(args, tmp), "--tokenizer-model", tokenizer, "--output-prefix", prefix]
    code = preprocess_data.main([*argv, "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and needle.replace("{tmp}", tmp) in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp)) == before, "a failed preprocess must write nothing"


def test_preprocess_missing_tokenizer(tmp, capsys):
    argv = ["--input", f"{tmp}/text.txt", "--tokenizer-model", f"{tmp}/no.model"]
    assert preprocess_data.main([*argv, "--output-prefix", f"{tmp}/o", "--quiet"]) == 2
    assert f"{tmp}/no.model" in capsys.readouterr().err


LAUNCH_CASES = [
    ("max-restarts-negative", ["--max-restarts", "-1", "--config", SMOKE], "--max-restarts="),
    ("dp-null", ["--config", SMOKE, "parallel.dp=null"], "parallel.dp=None"),
    ("dp-zero", ["--config", SMOKE, "parallel.dp=0"], "parallel.dp=0: must be >= 1"),
    ("launch-lr-inf", ["--config", SMOKE, "train.lr=.inf"], "train.lr=inf"),
]


@pytest.mark.parametrize("case, argv, needle", LAUNCH_CASES, ids=[c[0] for c in LAUNCH_CASES])
def test_bad_launch_input(capsys, case, argv, needle):
    code, err = _exit_code(launch.main, argv, capsys)
    assert code == 2 and needle in err, err


def test_read_only_output_dir(tmp_path, capsys, monkeypatch):
    """A directory this user cannot write: os.access decides, so root (for whom permission bits
    do not stop writes) gets the same message when os.access says no."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):  # root: make os.access answer as for anyone else
            real = os.access
            monkeypatch.setattr(
                os, "access", lambda p, m, *a, **k: str(p) != str(ro) and real(p, m, *a, **k)
            )
        for key in ("train.out_dir", "train.ckpt_dir"):
            argv = ["--config", SMOKE, f"{key}={ro}/run", "train.save_interval=5"]
            code, err = _exit_code(train.main, argv, capsys)
            assert code == 2 and f"{ro} is not writable" in err and key in err, err
    finally:
        ro.chmod(0o755)


def test_bad_input_table_is_large_enough():
    n = sum(map(len, (CONFIG_CASES, FILE_CASES, DATA_CASES, PREPROCESS_CASES, LAUNCH_CASES)))
    sections = {args[0].split(".")[0] for _, args, _ in CONFIG_CASES if "." in args[0]}
    assert n >= 60 and {"model", "parallel", "data", "train", "log"} <= sections, (n, sections)


# ------------------------------------------------------------------ the real CLI, end to end
def _cli(args, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("RANK", None)
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, **kw)


def test_cli_train_bad_file_prints_no_traceback(tmp):
    r = _cli([sys.executable, "-m", "megatron_lite.train", "--config", f"{tmp}/dup_key.yaml"])
    assert r.returncode == 2 and "given twice" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_cli_launch_bad_path_prints_no_traceback(tmp):
    argv = ["-m", "megatron_lite.launch", "--config", SMOKE, f"train.out_dir={tmp}/afile/run"]
    r = _cli([sys.executable, *argv])
    assert r.returncode == 2 and f"train.out_dir='{tmp}/afile/run'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_validation_creates_no_directory(tmp_path):
    """Checking that out_dir, ckpt_dir and cache_dir can be created must not create them."""
    from megatron_lite.config import load_config
    from megatron_lite.validation import validate

    argv = [f"train.out_dir={tmp_path}/new/run", "train.save_interval=5", "data.mock=false"]
    argv += ["data.corpus=shakespeare", f"data.cache_dir={tmp_path}/c/d"]
    validate(load_config(SMOKE, argv), 1)
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_cli_preprocess_empty_input_writes_nothing(tmp, tokenizer, tmp_path):
    out = tmp_path / "sub" / "out"
    args = ["--input", f"{tmp}/empty.txt", "--tokenizer-model", tokenizer]
    r = _cli([sys.executable, PREPROCESS, *args, "--output-prefix", str(out), "--quiet"])
    assert r.returncode == 2 and "no tokens to write" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "sub").exists()


SUBMIT = os.path.join(ROOT, "launch", "slurm", "submit.sh")


@pytest.mark.parametrize(
    "nodes, gpus, env, key",
    [
        ("1+$(touch {marker})", "8", {}, "NODES"),
        ("a[$(touch {marker})]", "8", {}, "NODES"),
        ("2", "x[$(touch {marker})]", {}, "GPUS_PER_NODE"),
        ("2", "0", {"NPROC_PER_NODE": "$(touch {marker})"}, "NPROC_PER_NODE"),
        ("2", "8", {"MAX_REQUEUES": "1+$(touch {marker})"}, "MAX_REQUEUES"),
        ("two", "8", {}, "NODES"),
        ("0", "8", {}, "NODES"),
        ("2", "08", {}, "GPUS_PER_NODE"),
    ],
)
def test_submit_rejects_non_integers_before_arithmetic(tmp_path, nodes, gpus, env, key):
    marker = tmp_path / "pwned"
    fake = tmp_path / "sbatch"
    fake.write_text(f"#!/bin/sh\ntouch {tmp_path}/sbatch-called\n")
    fake.chmod(0o755)
    env = {k: v.replace("{marker}", str(marker)) for k, v in env.items()}
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", **env)
    argv = [SUBMIT, nodes.replace("{marker}", str(marker)), gpus.replace("{marker}", str(marker))]
    r = subprocess.run([*argv, SMOKE], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and f"error: {key}=" in r.stderr and "Fix:" in r.stderr, r.stderr
    assert not marker.exists(), "a submit.sh argument was executed as code"
    assert not (tmp_path / "sbatch-called").exists() and r.stdout == ""
