"""A hostile user of the public data-parallel API (`build_data_parallel`, `DataParallel`,
`FullyShardedDataParallel`) and of the config keys that feed it: every bad value is refused
with a message naming the argument (or key) and its value, before any process group exists,
and both entry points state the same rule (parallel/data_parallel/rules.py).

The API cases pass mesh=None: the checks on values and chunks come before the mesh's, so a
case that got past its own rule would end on "mesh=None" instead and fail its needle. The
rules that need a real mesh (dp_shard divisibility, tied embeddings over pp) run on gloo ranks
in tests/parallel/test_public_data_parallel.py."""

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.config import ConfigError, load_config
from megatron_lite.parallel.data_parallel import (
    DataParallel,
    DataParallelArgumentError,
    FullyShardedDataParallel,
    build_data_parallel,
    rules,
)
from megatron_lite.parallel.mesh import RankLayout
from megatron_lite.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")
NAN, INF = math.nan, math.inf


def _model(dtype=torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).to(dtype)


class _WithCounter(nn.Module):
    """Integer state registered as a (frozen) parameter instead of a buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.count = nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)


def _mixed() -> nn.Module:
    m = _model()
    m[1].to(torch.bfloat16)
    return m


def _frozen() -> nn.Module:
    return _model().requires_grad_(False)


def _on_meta() -> nn.Module:
    with torch.device("meta"):
        return _model()


# (case id, keyword arguments of build_data_parallel, needle: the argument and its value)
ARGUMENT_CASES = [
    # grad_reduce_dtype: torch.float32 or torch.bfloat16, no strings (issue #36 G)
    ("reduce-int64", dict(grad_reduce_dtype=torch.int64), "grad_reduce_dtype=torch.int64: must"),
    ("reduce-int32", dict(grad_reduce_dtype=torch.int32), "grad_reduce_dtype=torch.int32"),
    ("reduce-fp16", dict(grad_reduce_dtype=torch.float16), "grad_reduce_dtype=torch.float16"),
    ("reduce-fp64", dict(grad_reduce_dtype=torch.float64), "grad_reduce_dtype=torch.float64"),
    ("reduce-bool", dict(grad_reduce_dtype=torch.bool), "grad_reduce_dtype=torch.bool"),
    ("reduce-str-bf16", dict(grad_reduce_dtype="bf16"), "grad_reduce_dtype='bf16'"),
    ("reduce-str-fp32", dict(grad_reduce_dtype="fp32"), "grad_reduce_dtype='fp32'"),
    ("reduce-none", dict(grad_reduce_dtype=None), "grad_reduce_dtype=None"),
    # bucket_size: an int >= 1
    ("bucket-zero", dict(bucket_size=0), "bucket_size=0: must be >= 1"),
    ("bucket-negative", dict(bucket_size=-5), "bucket_size=-5: must be >= 1"),
    ("bucket-float", dict(bucket_size=1.5), "bucket_size=1.5: must be an int"),
    ("bucket-bool", dict(bucket_size=True), "bucket_size=True: must be an int"),
    ("bucket-str", dict(bucket_size="40000000"), "bucket_size='40000000'"),
    # weight_decay: >= 0, finite in fp32, lr·weight_decay < 1
    ("wd-negative", dict(weight_decay=-0.1), "weight_decay=-0.1: must be >= 0"),
    ("wd-nan", dict(weight_decay=NAN), "weight_decay=nan: must be a finite"),
    ("wd-inf", dict(weight_decay=INF), "weight_decay=inf: must be a finite"),
    ("wd-fp32-overflow", dict(weight_decay=1e39), "weight_decay=1e+39: must be a finite"),
    ("wd-times-lr", dict(weight_decay=1e4), "weight_decay=10000.0: lr·weight_decay"),
    ("wd-str", dict(weight_decay="0.1"), "weight_decay='0.1': must be a number"),
    # zero_stage: one of the ints 0-3
    ("stage-true", dict(zero_stage=True), "zero_stage=True: must be one of the ints"),
    ("stage-float", dict(zero_stage=1.0), "zero_stage=1.0: must be one of the ints"),
    ("stage-str", dict(zero_stage="1"), "zero_stage='1': must be one of the ints"),
    ("stage-four", dict(zero_stage=4), "zero_stage=4: must be one of the ints"),
    ("stage-negative", dict(zero_stage=-1), "zero_stage=-1"),
    # lr: > 0 and finite, in fp32
    ("lr-zero", dict(lr=0), "lr=0: must be > 0"),
    ("lr-negative", dict(lr=-1e-3), "lr=-0.001: must be > 0"),
    ("lr-nan", dict(lr=NAN), "lr=nan: must be a finite"),
    ("lr-inf", dict(lr=INF), "lr=inf: must be a finite"),
    ("lr-fp32-overflow", dict(lr=1e39), "lr=1e+39: must be a finite number within fp32"),
    ("lr-fp32-zero", dict(lr=1e-50), "lr=1e-50: must be > 0 in fp32"),
    ("lr-none", dict(lr=None), "lr=None: must be a number"),
    ("lr-tensor", dict(lr=torch.tensor(1e-3)), "lr=tensor(0.0010): must be a number"),
    # betas: a pair, each in [0, 1) in fp32
    ("betas-one", dict(betas=(0.9,)), "betas=(0.9,): must be a pair"),
    ("betas-three", dict(betas=(0.9, 0.95, 0.99)), "betas=(0.9, 0.95, 0.99): must be a pair"),
    ("betas-scalar", dict(betas=0.9), "betas=0.9: must be a pair"),
    ("beta1-one", dict(betas=(1.0, 0.95)), "betas[0]=1.0: must be in [0, 1)"),
    ("beta1-negative", dict(betas=(-0.1, 0.95)), "betas[0]=-0.1: must be in [0, 1)"),
    ("beta2-nan", dict(betas=(0.9, NAN)), "betas[1]=nan: must be a finite"),
    ("beta2-fp32-one", dict(betas=(0.9, 0.999999999)), "betas[1]=0.999999999: must be in [0, 1)"),
    ("beta2-str", dict(betas=(0.9, "0.95")), "betas[1]='0.95': must be a number"),
    # eps: > 0 and finite, in fp32
    ("eps-zero", dict(eps=0.0), "eps=0.0: must be > 0"),
    ("eps-negative", dict(eps=-1e-8), "eps=-1e-08: must be > 0"),
    ("eps-fp32-zero", dict(eps=1e-50), "eps=1e-50: must be > 0 in fp32"),
    ("eps-inf", dict(eps=INF), "eps=inf: must be a finite"),
    # dp_shard: None or an int >= 1, with a sharding stage
    ("shard-zero", dict(zero_stage=1, dp_shard=0), "dp_shard=0: must be >= 1"),
    ("shard-negative", dict(zero_stage=1, dp_shard=-2), "dp_shard=-2: must be >= 1"),
    ("shard-float", dict(zero_stage=1, dp_shard=1.5), "dp_shard=1.5: must be an int or None"),
    ("shard-bool", dict(zero_stage=1, dp_shard=True), "dp_shard=True: must be an int or None"),
    ("shard-stage0", dict(dp_shard=1), "dp_shard=1: hybrid sharding shards the optimizer"),
    # flags: True or False
    ("overlap-grad-int", dict(overlap_grad_reduce=1), "overlap_grad_reduce=1: must be True"),
    ("overlap-param-str", dict(overlap_param_gather="yes"), "overlap_param_gather='yes'"),
    ("offload-none", dict(offload=None), "offload=None: must be False, True"),
    ("offload-disk", dict(offload="disk"), "offload='disk': must be False, True"),
    ("offload-stage3", dict(offload=True, zero_stage=3), "offload=True: optimizer offload is"),
    ("reshard-int", dict(reshard_after_forward=0), "reshard_after_forward=0: must be True"),
    ("tie-str", dict(tie_embeddings="no"), "tie_embeddings='no': must be True or False"),
    # layers_of, device
    ("layers-int", dict(layers_of=3), "layers_of=3: must be a callable"),
    ("layers-str", dict(layers_of="blocks"), "layers_of='blocks': must be a callable"),
    ("device-int", dict(device=42), "device=42: must be a str or torch.device"),
    ("device-unknown", dict(device="cuda:x"), "device='cuda:x': is not a device torch knows"),
    ("device-meta", dict(device="meta"), "device='meta': must have storage"),
    ("device-not-theirs", dict(device="cuda"), "device='cuda': the chunks are on ['cpu']"),
]

# (case id, the chunks argument (built lazily), needle)
CHUNK_CASES = [
    ("chunks-module", _model, "chunks=<Sequential>: must be a list of torch.nn.Module"),
    ("chunks-str", lambda: "model", "chunks='model': must be a list"),
    ("chunks-generator", lambda: (m for m in [_model()]), "chunks=<generator"),
    ("chunks-empty", lambda: [], "chunks=[]: must hold at least one chunk"),
    ("chunks-not-module", lambda: [3], "chunks[0]=3: is of type int, not a Module"),
    ("chunks-twice", lambda: [m := _model(), m], "chunks[1]=<Sequential>: is chunks[0] again"),
    ("chunks-fp16", lambda: [_model(torch.float16)], "chunks[0].0.weight.dtype=torch.float16"),
    ("chunks-fp64", lambda: [_model(torch.float64)], "chunks[0].0.weight.dtype=torch.float64"),
    ("chunks-int-param", lambda: [_WithCounter()], "chunks[0].count=torch.int64"),
    ("chunks-mixed", lambda: [_mixed()], "the trainable parameters must share one dtype"),
    ("chunks-frozen", lambda: [_frozen()], "have no trainable parameter"),
    ("chunks-meta-stage1", lambda: [_on_meta()], "zero_stage=1 with chunks on the meta device"),
]


@pytest.mark.parametrize("case, kwargs, needle", ARGUMENT_CASES, ids=[c[0] for c in ARGUMENT_CASES])
def test_bad_argument(case, kwargs, needle):
    with pytest.raises(DataParallelArgumentError) as err:
        build_data_parallel([_model()], None, **kwargs)
    assert needle in str(err.value), f"{case}: {err.value}"
    assert str(err.value).startswith("build_data_parallel: ") and "Fix: " in str(err.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize("case, make, needle", CHUNK_CASES, ids=[c[0] for c in CHUNK_CASES])
def test_bad_chunks(case, make, needle):
    stage = 1 if case == "chunks-meta-stage1" else 0
    with pytest.raises(DataParallelArgumentError) as err:
        build_data_parallel(make(), None, zero_stage=stage)
    assert needle in str(err.value), f"{case}: {err.value}"
    assert err.value.arg.startswith("chunks")


@pytest.mark.parametrize("mesh", [None, "mesh", RankLayout(1)], ids=["none", "str", "layout"])
def test_bad_mesh(mesh):
    with pytest.raises(DataParallelArgumentError, match=r"mesh=.*: must be a ParallelMesh"):
        build_data_parallel([_model()], mesh)


# the wrappers' public constructors take the same rules under their own argument names
WRAPPER_CASES = [
    ("ddp-bucket", DataParallel, dict(bucket_size=0), "DataParallel: bucket_size=0"),
    ("ddp-reduce", DataParallel, dict(grad_reduce_dtype=torch.int64), "DataParallel: grad_redu"),
    ("ddp-stage3", DataParallel, dict(zero_stage=3), "DataParallel: zero_stage=3: DataParallel"),
    ("ddp-wd", DataParallel, dict(weight_decay=-1.0), "DataParallel: weight_decay=-1.0"),
    ("fsdp-param-fp16", FullyShardedDataParallel, dict(param_dtype=torch.float16), "param_dtype"),
    ("fsdp-reduce-str", FullyShardedDataParallel, dict(reduce_dtype="bf16"), "reduce_dtype='bf16'"),
    ("fsdp-lr", FullyShardedDataParallel, dict(lr=-1.0), "FullyShardedDataParallel: lr=-1.0"),
    ("fsdp-layers", FullyShardedDataParallel, dict(layers_of=1), "layers_of=1"),
]


@pytest.mark.parametrize(
    "case, cls, kwargs, needle", WRAPPER_CASES, ids=[c[0] for c in WRAPPER_CASES]
)
def test_wrapper_constructors_check_the_same(case, cls, kwargs, needle):
    with pytest.raises(DataParallelArgumentError) as err:
        cls([_model()], None, **kwargs)
    assert needle in str(err.value), f"{case}: {err.value}"


# config keys -> the same rules: (case id, overrides of smoke.yaml, world size, needle)
CONFIG_CASES = [
    ("lr-fp32-overflow", ["train.lr=1e39", "train.min_lr=0"], 1, "train.lr=1e+39: must be a fin"),
    ("lr-fp32-zero", ["train.lr=1e-50", "train.min_lr=0"], 1, "train.lr=1e-50: must be > 0 in"),
    ("eps-fp32-zero", ["train.adam_eps=1e-50"], 1, "train.adam_eps=1e-50: must be > 0 in fp32"),
    ("eps-fp32-overflow", ["train.adam_eps=1e39"], 1, "train.adam_eps=1e+39: must be a finite"),
    ("beta2-fp32-one", ["train.adam_beta2=0.999999999"], 1, "train.adam_beta2=0.999999999"),
    ("beta1-one", ["train.adam_beta1=1.0"], 1, "train.adam_beta1=1.0: must be in [0, 1)"),
    ("wd-negative", ["train.weight_decay=-0.1"], 1, "train.weight_decay=-0.1: must be >= 0"),
    ("wd-times-lr", ["train.weight_decay=2000"], 1, "train.weight_decay=2000.0: lr·weight_decay"),
    ("wd-fp32-overflow", ["train.weight_decay=1e39"], 1, "train.weight_decay=1e+39"),
    ("bucket-zero", ["parallel.ddp_bucket_size=0"], 1, "parallel.ddp_bucket_size=0: must be >="),
    ("bucket-negative", ["parallel.ddp_bucket_size=-5"], 1, "parallel.ddp_bucket_size=-5"),
    ("reduce-int64", ["parallel.grad_reduce_dtype=int64"], 1, "parallel.grad_reduce_dtype='int64"),
    ("reduce-fp16", ["parallel.grad_reduce_dtype=fp16"], 1, "parallel.grad_reduce_dtype='fp16'"),
    ("stage-four", ["parallel.zero_stage=4"], 1, "parallel.zero_stage=4: must be one of the ints"),
    ("stage-negative", ["parallel.zero_stage=-1"], 1, "parallel.zero_stage=-1"),
    ("shard-zero", ["parallel.zero_stage=1", "parallel.dp_shard=0"], 1, "parallel.dp_shard=0:"),
    ("shard-stage0", ["parallel.dp=2", "parallel.dp_shard=2"], 2, "parallel.dp_shard=2: hybrid"),
    (
        "shard-divides",
        ["parallel.dp=2", "parallel.zero_stage=1", "parallel.dp_shard=3"],
        2,
        "parallel.dp_shard=3: must divide the gradient's reduction group",
    ),
    (
        "offload-stage3",
        ["parallel.zero_stage=3", "train.optimizer_offload=cpu"],
        1,
        "train.optimizer_offload='cpu': optimizer offload is for zero_stage 0-2",
    ),
    ("offload-gpu", ["train.optimizer_offload=gpu"], 1, "train.optimizer_offload='gpu'"),
]


@pytest.mark.parametrize(
    "case, overrides, world, needle", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES]
)
def test_bad_config_key(case, overrides, world, needle):
    with pytest.raises(ConfigError) as err:
        validate(load_config(SMOKE, overrides), world)
    assert needle in str(err.value), f"{case}: {err.value}"


# one rule, both entry points: (rule's answer, API arguments, config overrides)
SHARED = [
    (rules.bucket_size(0), dict(bucket_size=0), ["parallel.ddp_bucket_size=0"]),
    (rules.positive_fp32(1e39), dict(lr=1e39), ["train.lr=1e39", "train.min_lr=0"]),
    (rules.positive_fp32(1e-50), dict(eps=1e-50), ["train.adam_eps=1e-50"]),
    (rules.beta(0.999999999), dict(betas=(0.9, 0.999999999)), ["train.adam_beta2=0.999999999"]),
    (rules.weight_decay(-0.1, 1e-3), dict(weight_decay=-0.1), ["train.weight_decay=-0.1"]),
    (rules.zero_stage(4), dict(zero_stage=4), ["parallel.zero_stage=4"]),
    (rules.offload(True, 3), dict(zero_stage=3, offload=True), ["parallel.zero_stage=3",
                                                                 "train.optimizer_offload=cpu"]),
]  # fmt: skip


@pytest.mark.parametrize("rule, kwargs, overrides", SHARED, ids=[s[2][0] for s in SHARED])
def test_both_entry_points_state_the_same_rule(rule, kwargs, overrides):
    assert rule is not None
    with pytest.raises(DataParallelArgumentError) as api:
        build_data_parallel([_model()], None, **kwargs)
    with pytest.raises(ConfigError) as config:
        validate(load_config(SMOKE, overrides), 1)
    assert rule in str(api.value) and rule in str(config.value), (api.value, config.value)


def test_valid_unusual_values_pass_the_rules():
    """What the rules must not refuse: list betas, int and numpy numbers, bf16 weights."""
    import numpy as np

    from megatron_lite.parallel.data_parallel import arguments

    ok = dict(zero_stage=np.int64(2), lr=1, betas=[0.0, np.float32(0.5)], eps=np.float64(1e-30),
              weight_decay=0, bucket_size=np.int32(1), dp_shard=1, grad_reduce_dtype=torch.bfloat16,
              offload=False, layers_of=lambda c: [c], device=None)  # fmt: skip
    arguments.check_values("build_data_parallel", ok)
    arguments.check_chunks("build_data_parallel", [_model(torch.bfloat16), _model(torch.bfloat16)])
    assert rules.positive_fp32(rules.FP32_MAX) is None and rules.beta(0.99999) is None
