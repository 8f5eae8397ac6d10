"""Typed run configuration: dataclasses fed by YAML files and `key.sub=value` overrides.

`load_config(path, overrides)` builds a `Config`; `megatron_lite.validation.validate(cfg,
world_size)` checks it before any process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field

import yaml

from megatron_lite.atomic import write_atomic


class ConfigError(ValueError):
    """Invalid configuration; the message is meant for the user as-is (no traceback)."""


@dataclass
class ModelConfig:
    arch: str = "llama"  # a registered architecture (models/registry.py): llama | gpt
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None = num_attention_heads (plain multi-head)
    kv_channels: int | None = None  # head dimension; None = hidden_size / num_attention_heads
    qk_layernorm: bool = False  # RMSNorm/LayerNorm on each head's query and key (Qwen3)
    # multi-head latent attention (DeepSeek-V2/V3; Megatron's flags; docs/deepseek_v3.md)
    multi_latent_attention: bool = False  # llama: MLA instead of (grouped-query) attention
    q_lora_rank: int | None = None  # MLA query compression rank; None = one q projection
    kv_lora_rank: int = 512  # MLA's compressed key/value width
    qk_head_dim: int = 128  # MLA: the no-RoPE part of each q/k head (HF: qk_nope_head_dim)
    qk_pos_emb_head_dim: int = 64  # MLA: the decoupled RoPE part (one key for all heads)
    v_head_dim: int = 128  # MLA: each value head's width
    # RoPE scaling as in HF's rope_scaling: {type: yarn, factor, original_max_position_embeddings,
    # beta_fast, beta_slow, mscale, mscale_all_dim}; None = plain RoPE
    rope_scaling: dict[str, float | str] | None = None
    add_qkv_bias: bool = False  # biases on the q, k and v projections only (Qwen2)
    ffn_hidden_size: int | None = None  # None = 4·h (gpt) or multiple-of-64 8h/3 (llama)
    vocab_size: int | None = None  # None = the tokenizer's vocabulary (mock data: required)
    seq_length: int = 64
    max_position_embeddings: int | None = None  # gpt learned positions; None = seq_length
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    make_vocab_size_divisible_by: int = 128
    attention_backend: str = "auto"  # auto | sdpa | flash | te
    linear_backend: str = "local"  # local | te
    # FP8 GEMMs (bf16 training): tensorwise | rowwise with linear_backend local (torchao's
    # recipes, docs/fp8.md), hybrid | e4m3 with linear_backend te (TE, recipe fp8_recipe)
    fp8: str | None = None
    fp8_recipe: str = "tensorwise"  # TE only: tensorwise | delayed | blockwise | mxfp8
    # local FP8: linears whose module name contains one of these stay bf16
    fp8_skip: list[str] = field(default_factory=lambda: ["output_layer"])
    fp8_unaligned: str = "bf16"  # local FP8, a GEMM dim not a multiple of 16: bf16 | error
    fp8_all_gather: bool = True  # tensorwise FP8 under ZeRO-3: gather those weights in FP8
    # mixture of experts (num_experts None = dense)
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_capacity_factor: float | None = None
    # every k-th layer is MoE (1 = all), or a list of 0/1 per layer (1 = MoE), as in Megatron
    moe_layer_freq: int | list[int] = 1
    moe_first_k_dense_replace: int = 0  # the first k layers dense (DeepSeek-V3: 3)
    moe_grouped_gemm: bool = True  # local experts as one grouped GEMM (False: a loop)
    moe_shared_expert_ffn_hidden_size: int = 0  # a dense SwiGLU every token passes (0 = none)
    moe_shared_expert_overlap: bool = False  # the shared expert beside the dispatch all-to-all
    moe_shared_expert_gate: bool = False  # shared expert output × sigmoid(x·g), g [1, h] (Qwen2)
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_topk_scaling_factor: float | None = None  # top-k weights × this (None = 1)
    moe_router_norm_topk: bool | None = None  # renormalize the top-k (None: sigmoid yes)
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing (DeepSeek-V3)
    moe_router_bias_update_rate: float = 1e-3  # bias += rate · sign(mean load - load)
    moe_aux_loss_type: str = "global"  # global (over the microbatch) | seq (per sequence)
    moe_router_num_groups: int | None = None  # group-limited routing: expert groups
    moe_router_group_topk: int | None = None  # groups each token may use
    # a group's score: the sum of its top topk/group_topk scores (Megatron) | of its top 2 (DSv3)
    moe_router_group_score: str = "topk_per_group"  # topk_per_group | top2
    # activation recomputation (Megatron's names; parallel/recompute.py)
    recompute_granularity: str | None = None  # None | selective | full
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])  # selective
    recompute_method: str | None = None  # full: uniform | block
    recompute_num_layers: int | None = None  # full: layers per group (uniform) / per stage
    # activation CPU offload (Megatron-Core's --offload-modules names where ours match;
    # parallel/activation_offload.py, docs/activation_offload.md): submodules whose saved tensors
    # go to host memory; the most groups in flight; smaller saved tensors stay on the device
    activation_offload: list[str] = field(default_factory=list)
    activation_offload_inflight: int = 4
    activation_offload_min_bytes: int = 1048576
    fp32_residual_connection: bool = False  # bf16: keep the residual stream (and P2P) in fp32
    # torch.compile each transformer layer and the loss head as its own region
    # (models/compile.py, docs/performance.md); compile_mode: torch.compile's mode (None: default)
    compile: bool = False
    compile_mode: str | None = None  # None | default | max-autotune-no-cudagraphs | ...
    # multi-token prediction (DeepSeek-V3, Megatron's names; models/mtp.py)
    mtp_num_layers: int = 0  # D sequential MTP modules on the last stage (0 = off)
    mtp_loss_scaling_factor: float = 0.1  # λ: the objective adds λ/D · Σ_k MTP loss_k


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline rank
    # a registered schedule's name (pipeline/registry.py; shipped: 1f1b, interleaved, zb-h1,
    # zb-v, dualpipev); None: 1f1b at vpp=1, interleaved at vpp >= 2
    pipeline_schedule: str | None = None
    pipeline_layers: list[int] | None = None  # layers per virtual stage (None: even split)
    decoder_first_pipeline_num_layers: int | None = None  # Megatron's: the first stage's layers
    decoder_last_pipeline_num_layers: int | None = None  # the last stage's; the rest even
    cp: int = 1
    ep: int = 1
    dp: int | None = None  # None = world_size / (tp·pp·cp)
    sequence_parallel: bool = False
    order: str = "tp-cp-ep-dp-pp"
    cp_comm_type: str = "a2a"  # a2a (Ulysses) | p2p (ring) | a2a+p2p (Ulysses inside, ring across)
    cp_a2a_size: int | None = None  # a2a+p2p: Ulysses ranks per ring rank (cp = a2a · ring)
    timeout_s: float = 300.0  # collective / p2p timeout
    # data parallelism (parallel/data_parallel/): ZeRO stage, hybrid sharding, buckets
    zero_stage: int = 0  # 0 replicated optimizer | 1 distributed optimizer | 2 + sharded grads
    # | 3 + sharded parameters (torch FSDP2)
    dp_shard: int | None = None  # shard within groups of this many ranks (None: the whole group)
    ddp_bucket_size: int = 40_000_000  # parameters per gradient bucket
    overlap_grad_reduce: bool = True  # reduce buckets during the backward
    overlap_param_gather: bool = True  # all-gather updated weights during the next forward
    grad_reduce_dtype: str = "fp32"  # fp32 | bf16
    reshard_after_forward: bool = True  # zero_stage 3: free gathered weights after each forward
    zero3_grad_reduce: str = "step"  # zero_stage 3: step (one reduce-scatter per step,
    # unsharded accumulation) | microbatch (one per microbatch, sharded accumulation)


@dataclass
class DataConfig:
    mock: bool = False  # seeded random tokens (benchmarks, tests)
    paths: list[str] = field(default_factory=list)  # indexed dataset prefixes (.bin/.idx)
    weights: list[float] | None = None  # blending weights, one per path
    tokenizer_model: str | None = None  # sentencepiece .model or Hugging Face tokenizer.json
    corpus: str | None = None  # built-in corpus prepared on first run (e.g. "shakespeare")
    cache_dir: str = ".cache/megatron_lite"
    index_cache_dir: str | None = None  # cached data indices; None: index_cache/ beside the data
    split: str | None = None  # train,valid,test weights over each dataset's documents: "969,30,1"
    valid_paths: list[str] = field(default_factory=list)  # validation prefixes (instead of split)
    tokenizer_vocab_size: int = 4096  # for tokenizers trained on first run
    # document masking of packed windows (Megatron's get_ltor_masks_and_position_ids)
    reset_attention_mask: bool = False  # attention never crosses an end-of-document token
    reset_position_ids: bool = False  # positions restart at 0 at every document start
    eod_mask_loss: bool = False  # no loss where the input is EOD (predicting the next document)
    eod_token_id: int | None = None  # the EOD id; None = the tokenizer's eos id


@dataclass
class TrainConfig:
    micro_batch_size: int = 2
    global_batch_size: int = 8
    steps: int = 20
    seed: int = 1234
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 2
    lr_decay_steps: int | None = None  # None = steps
    weight_decay: float = 0.1
    optimizer: str = "adamw"  # a registered OptimizerSpec (data_parallel/optimizer_spec.py)
    # its other hyperparameters by name, e.g. {momentum: 0.95} (lr, betas, eps, weight decay
    # have their own keys)
    optimizer_args: dict[str, float] = field(default_factory=dict)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    # train.optimizer=muon (data_parallel/muon.py): Muon steps these parameter kinds, AdamW
    # (adam_* above) the others; the update scale rule, Newton-Schulz steps and dtype
    muon_params: list[str] = field(
        default_factory=lambda: ["attention", "mlp", "experts", "hidden"]
    )
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_ns_dtype: str = "bf16"  # bf16 (as torch.optim.Muon) | fp32
    muon_adjust_lr: str = "match_rms_adamw"  # match_rms_adamw (Moonlight) | original (Keller)
    muon_split_fused: bool = True  # q, k, v and gate, up orthogonalized each alone
    muon_lr: float | None = None  # None = train.lr (the same schedule, scaled)
    # resume with another train.optimizer than the checkpoint's: weights kept, states fresh
    reset_optimizer_state: bool = False
    grad_clip: float = 1.0
    eval_interval: int = 0  # validation loss every N steps and after the last (0: never)
    eval_iters: int = 1  # global batches per evaluation
    skip_nonfinite_steps: int = 0  # skip up to N NaN/Inf steps in a row (0: stop at the first)
    # replay a suspicious step once to tell a transient fault from the data/model (rerun.py)
    rerun_on: str = "none"  # none | nonfinite | spike | both
    spike_factor: float = 3.0  # a spike: loss or grad norm > factor × mean of the last 10 steps
    precision: str = "fp32"  # fp32 | bf16 (bf16 weights, fp32 master weights and gradients)
    # none | cpu (master weights and AdamW states in host memory) | nvme (in a swap file under
    # nvme_path, read through a host buffer of nvme_buffer_mb MiB; docs/offload.md)
    optimizer_offload: str = "none"
    nvme_path: str | None = None  # an existing writable directory on a local NVMe drive
    nvme_buffer_mb: int = 1024
    out_dir: str = "runs/default"
    profile_pipeline: bool = False
    # torch.profiler traces of steps [a, b] (0-based, as in metrics.jsonl); [] = none
    profile_steps: list[int] = field(default_factory=list)
    profile_memory_snapshot: bool = False  # CUDA: also the allocator's history over those steps
    # checkpointing (checkpoint/; when to save: training/signals.py)
    save_interval: int = 0  # save every N steps and after the last one; 0 = never
    # every N steps a copy in /dev/shm and at a peer rank for fast restarts; 0 = off
    memory_checkpoint_interval: int = 0
    keep_checkpoints: int = 2  # newest checkpoints kept in ckpt_dir
    resume: str = "auto"  # auto (newest valid in ckpt_dir, if any) | none | a checkpoint path
    init_from: str | None = None  # model weights only (step 0, fresh optimizer), e.g. from HF
    async_save: bool = False  # write on a thread while training continues
    async_save_timeout_s: float = 3600.0  # how long an async save may take (not timeout_s)
    ckpt_dir: str | None = None  # None = <out_dir>/checkpoints
    # resume=none (or an older step) over existing checkpoints: move them aside, never delete
    overwrite: bool = False


@dataclass
class LogConfig:
    interval: int = 1
    memory_steps: int = 2  # the run's first steps measured by the memory tracker (mem/* peaks)
    progress: bool = True
    wandb: bool = False
    wandb_project: str = "megatron_lite"
    wandb_mode: str = "offline"  # offline | online | disabled
    # every numeric field of metrics.jsonl as a TensorBoard scalar (pip install -e ".[tensorboard]")
    tensorboard: bool = False
    tensorboard_dir: str = ""  # "" = <train.out_dir>/tensorboard
    straggler: bool = False  # report the slowest ranks' compute speed (training/straggler.py)
    straggler_interval: int = 10  # steps between straggler reports

    def tensorboard_path(self, out_dir: str) -> str:
        """Where the event files go: tensorboard_dir, or <out_dir>/tensorboard when it is ""."""
        return self.tensorboard_dir or os.path.join(out_dir, "tensorboard")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------ loading and overrides
def _known(section) -> list[str]:
    return [f.name for f in dataclasses.fields(section)]


def _unknown_key(key: str, choices: list[str]) -> ConfigError:
    near = difflib.get_close_matches(key.split(".")[-1], choices, n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    return ConfigError(f"unknown config key {key!r}.{hint} Valid keys here: {', '.join(choices)}.")


def _set(cfg: Config, key: str, value, source: str) -> None:
    parts = key.split(".")
    if len(parts) != 2:
        raise ConfigError(
            f"{source}: key {key!r} must be <section>.<name>, sections: {', '.join(_known(cfg))}"
        )
    section, name = parts
    if section not in _known(cfg):
        raise _unknown_key(section, _known(cfg))
    sec = getattr(cfg, section)
    if name not in _known(sec):
        raise _unknown_key(key, [f"{section}.{n}" for n in _known(sec)])
    ftype = next(f.type for f in dataclasses.fields(sec) if f.name == name)
    setattr(sec, name, _coerce(key, value, str(ftype), getattr(sec, name)))


def check_section(section: str, values: dict) -> None:
    """The known keys of `values`, a dict of config section `section` read back from
    elsewhere (a checkpoint's metadata), against their field types; other keys are ignored
    (a checkpoint of another version may have more). ConfigError names the first misfit."""
    cfg = Config()
    for name, value in values.items():
        if isinstance(name, str) and name in _known(getattr(cfg, section)):
            _set(cfg, f"{section}.{name}", value, section)


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def _coerce(key: str, value, ftype: str, current):
    """Check a YAML value against the field's annotation ("int", "float | None", "list[str]")."""
    if ftype.startswith("int | list["):  # a scalar or a list (moe_layer_freq)
        ftype = ftype.split(" | ", 1)[1] if isinstance(value, list) else "int"
    base = ftype.split(" | ")[0].split("[")[0]
    if base == "dict" and value is not None:  # name -> number (train.optimizer_args)
        return _coerce_mapping(key, value, strings=ftype.startswith("dict[str, float | str]"))
    if value is None:
        if ftype.endswith("| None"):
            return None
        raise ConfigError(f"{key}: null is not allowed. Fix: give a {base}, e.g. {key}={current!r}")
    if base != "list":
        return _coerce_scalar(value, base, f"{key}={value!r}", f"e.g. {key}={current!r}")
    item = ftype.split("[", 1)[1].split("]", 1)[0]  # "list[float] | None" -> "float"
    values = value if isinstance(value, list) else [value]
    fix = f"give a list of {item} values, e.g. {key}=[{_EXAMPLES[item]}]"
    return [
        _coerce_scalar(v, item, f"{key}={value!r}: element {i} ({v!r})", fix)
        for i, v in enumerate(values)
    ]


def _coerce_mapping(key: str, value, strings: bool = False) -> dict:
    """A mapping of names to finite numbers or booleans (`strings`: or strings)."""
    fix = f"give a mapping of names to numbers, e.g. {key}={{momentum: 0.95}}"
    if strings:
        fix = (
            f"give a mapping of names to numbers or strings, e.g. {key}={{type: yarn, factor: 40}}"
        )
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={value!r}: expected a mapping, got {type(value).__name__}. "
                          f"Fix: {fix}")  # fmt: skip
    for name, v in value.items():
        number = isinstance(v, int | float) and (isinstance(v, bool) or math.isfinite(v))
        if not isinstance(name, str) or not (number or (strings and isinstance(v, str))):
            raise ConfigError(f"{key}={value!r}: {name!r}: {v!r} is not a finite number or "
                              f"boolean under a name. Fix: {fix}")  # fmt: skip
    return dict(value)


# list-element examples for the Fix: (the defaults of list fields are empty or null)
_EXAMPLES = {"str": "data/my_corpus", "float": 1.0, "int": 1, "bool": True}


def _coerce_scalar(value, base: str, shown: str, fix: str):
    """One scalar against its type name; a float must be finite (no field means inf or nan)."""
    if base == "float" and not isinstance(value, bool):
        try:  # ints and YAML-1.1 strings such as 1e-3
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            pass
        else:
            if not math.isfinite(number):
                raise ConfigError(f"{shown}: must be a finite number, not inf or nan. Fix: {fix}")
            return number
    t = _SCALARS[base]
    if not isinstance(value, t) or (t is int and isinstance(value, bool)):
        raise ConfigError(f"{shown}: expected {base}, got {type(value).__name__}. Fix: {fix}")
    return value


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""


def _construct_unique_mapping(loader, node, deep=False):
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(
                f"line {key_node.start_mark.line + 1}: key {key!r} is given twice (first on "
                f"line {seen[key]}); YAML would silently keep the last one. Fix: delete one "
                f"of them"
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def _read_yaml(path: str):
    """The YAML file's content; ConfigError for a missing, unreadable, non-UTF-8 or invalid file
    and for duplicate keys."""
    if os.path.isdir(path):
        raise ConfigError(
            f"config file {path!r} is a directory. Fix: pass --config with the path of a YAML "
            f"file in it, e.g. configs/quickstart.yaml"
        )
    if not os.path.isfile(path):
        raise ConfigError(
            f"config file {path!r} does not exist. Fix: pass --config with the "
            f"path of a YAML file, e.g. configs/quickstart.yaml"
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path!r} is not UTF-8 text ({e.reason} at byte {e.start}). "
            f"Fix: save it as UTF-8 (e.g. iconv -t UTF-8) or pass the right file"
        ) from None
    except OSError as e:
        raise ConfigError(
            f"config file {path!r} cannot be read ({e.strerror}). Fix: check its permissions"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except ConfigError as e:
        raise ConfigError(f"config file {path!r}, {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None


def load_config(path: str | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults <- YAML file (nested sections) <- `section.key=value` overrides (YAML values)."""
    cfg = Config()
    if path is not None:
        raw = _read_yaml(path)
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise ConfigError(
                f"config file {path!r} holds a {type(raw).__name__}, not a mapping of sections. "
                f"Fix: write sections such as 'train:' with indented 'key: value' lines below"
            )
        for section, values in raw.items():
            if not isinstance(values, dict):
                raise ConfigError(
                    f"{path}: section {section!r} is a {type(values).__name__}, not a mapping "
                    f"of keys. Fix: indent 'key: value' lines under '{section}:'"
                )
            for name, value in values.items():
                try:
                    _set(cfg, f"{section}.{name}", value, path)
                except ConfigError as e:
                    raise ConfigError(f"{path}: {e}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r} must look like section.key=value, e.g. train.steps=100"
            )
        key, text = item.split("=", 1)
        try:
            value = yaml.safe_load(text) if text != "" else None
        except yaml.YAMLError:
            value = text
        _set(cfg, key.strip(), value, "command line")
    return cfg


def save_config(cfg: Config, path: str) -> None:
    """The config as YAML at `path`, written atomically (a failed write names `path`)."""
    write_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
