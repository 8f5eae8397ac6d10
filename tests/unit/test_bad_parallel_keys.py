"""Parallel keys of a feature that is off (issue 36, class E): an invalid value is an error at
cp=1, pp=1 or tp=1 too, naming the key; a valid value other than the default warns in one line
that it has no effect (validation/parallel.py `parallel_warnings`); the same value where its
feature is on warns nothing."""

import os

import pytest

from megatron_lite.config import ConfigError, load_config
from megatron_lite.validation import validate
from megatron_lite.validation.parallel import parallel_warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")  # tp = pp = cp = dp = 1, 2 layers

# (overrides on smoke.yaml at world 1: every feature off, the key the error must name)
ERRORS = [
    (["parallel.cp_comm_type=ring"], "parallel.cp_comm_type='ring'"),
    (["parallel.cp_comm_type=A2A"], "parallel.cp_comm_type='A2A'"),
    (["parallel.cp_comm_type=a2a+p2p"], "parallel.cp_a2a_size"),
    (["parallel.cp_a2a_size=2"], "parallel.cp_a2a_size=2"),
    (["parallel.cp_a2a_size=-1"], "parallel.cp_a2a_size=-1"),
    (["parallel.pipeline_schedule=gpipe"], "parallel.pipeline_schedule='gpipe'"),
    (["parallel.pipeline_schedule=ZB-H1"], "parallel.pipeline_schedule='ZB-H1'"),
    (["parallel.pipeline_schedule=zb-v"], "parallel.pipeline_schedule='zb-v'"),
    (["parallel.pipeline_layers=[0,2]"], "parallel.pipeline_layers=[0, 2]"),
    (["parallel.pipeline_layers=[3]"], "parallel.pipeline_layers=[3]"),
    (["parallel.decoder_first_pipeline_num_layers=-1"],
     "parallel.decoder_first_pipeline_num_layers=-1"),
    (["parallel.decoder_last_pipeline_num_layers=0"],
     "parallel.decoder_last_pipeline_num_layers=0"),
    (["parallel.decoder_first_pipeline_num_layers=1"],
     "parallel.decoder_first_pipeline_num_layers=1"),
    (["parallel.order=tp-tp"], "parallel.order='tp-tp'"),
    (["parallel.vpp=2"], "parallel.vpp=2"),
    (["parallel.dp=0"], "parallel.dp=0: must be >= 1"),
    (["parallel.dp=-2"], "parallel.dp=-2: must be >= 1"),
]  # fmt: skip

# (overrides at world 1, the key warned about)
WARNINGS = [
    (["parallel.cp_comm_type=p2p"], "parallel.cp_comm_type='p2p'"),
    (["parallel.pipeline_schedule=1f1b"], "parallel.pipeline_schedule='1f1b'"),
    (["parallel.pipeline_schedule=zb-h1"], "parallel.pipeline_schedule='zb-h1'"),
    (["parallel.pipeline_layers=[2]"], "parallel.pipeline_layers=[2]"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=True"),
    (["parallel.order=pp-dp-ep-cp-tp"], "parallel.order='pp-dp-ep-cp-tp'"),
]

# the same keys where their feature is on (world 2): no warning
ACTIVE = [
    ["parallel.cp=2", "parallel.dp=1", "parallel.cp_comm_type=p2p"],
    ["parallel.pp=2", "parallel.dp=1", "parallel.pipeline_schedule=1f1b"],
    ["parallel.pp=2", "parallel.dp=1", "parallel.pipeline_schedule=zb-h1"],
    ["parallel.pp=2", "parallel.dp=1", "parallel.pipeline_layers=[1,1]"],
    ["parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=true"],
    ["parallel.tp=2", "parallel.dp=null", "parallel.order=pp-dp-ep-cp-tp"],
]


@pytest.mark.parametrize("overrides, named", ERRORS, ids=[" ".join(e[0]) for e in ERRORS])
def test_an_invalid_parallel_key_is_an_error_with_its_feature_off(overrides, named):
    with pytest.raises(ConfigError) as e:
        validate(load_config(SMOKE, overrides), 1, warn=False)
    assert str(e.value).startswith(named) and "Fix: " in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides, named", WARNINGS, ids=[" ".join(w[0]) for w in WARNINGS])
def test_a_valid_key_of_a_feature_that_is_off_warns_once(overrides, named):
    r = validate(load_config(SMOKE, overrides), 1, warn=False)
    (warning,) = parallel_warnings(r)
    assert warning.startswith(f"{named} has no effect: ") and "Fix: " in warning, warning
    assert "\n" not in warning


@pytest.mark.parametrize("overrides", ACTIVE, ids=[" ".join(a) for a in ACTIVE])
def test_the_same_key_with_its_feature_on_warns_nothing(overrides):
    world = 4 if "parallel.dp=null" in overrides else 2
    cfg = load_config(SMOKE, [*overrides, "train.global_batch_size=16"])
    assert parallel_warnings(validate(cfg, world, warn=False)) == []


def test_defaults_warn_nothing():
    assert parallel_warnings(validate(load_config(SMOKE, []), 1, warn=False)) == []
