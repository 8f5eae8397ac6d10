"""The peers of tools/bench_data_parallel.py: a plain torch Llama of the benchmark's shape,
trained under torch FSDP2 (`fully_shard` per block) or DeepSpeed ZeRO 1/2/3, one step at a time.

Each runner has the interface of the benchmark's own: `step(probe)` runs one optimizer step on
the fixed batch (probe: record the model-state bytes once the gradients are synchronized, before
the optimizer step), `memory` holds what the probe saw, `model_params()` the parameters.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shape:
    """The benchmark model: a Llama with tied embeddings, no biases, GQA."""

    vocab: int = 8192
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    groups: int = 4
    ffn: int = 704
    seq: int = 128
    micro_batch: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class Block(nn.Module):
    """RMSNorm -> GQA attention (RoPE, causal SDPA) -> RMSNorm -> SwiGLU MLP; [b, s, h]."""

    def __init__(self, c: Shape):
        super().__init__()
        self.c = c
        kv = c.groups * c.head_dim
        self.input_norm = nn.RMSNorm(c.hidden, eps=1e-5)
        self.qkv = nn.Linear(c.hidden, c.hidden + 2 * kv, bias=False)
        self.proj = nn.Linear(c.hidden, c.hidden, bias=False)
        self.pre_mlp_norm = nn.RMSNorm(c.hidden, eps=1e-5)
        self.fc1 = nn.Linear(c.hidden, 2 * c.ffn, bias=False)  # [gate, up]
        self.fc2 = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, (b, s, _) = self.c, x.shape
        kv = c.groups * c.head_dim
        q, k, v = self.qkv(self.input_norm(x)).split([c.hidden, kv, kv], dim=-1)
        q = q.view(b, s, c.heads, c.head_dim).transpose(1, 2)  # [b, n, s, d]
        k = k.view(b, s, c.groups, c.head_dim).transpose(1, 2)  # [b, g, s, d]
        v = v.view(b, s, c.groups, c.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, c.hidden))
        gate, up = self.fc1(self.pre_mlp_norm(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-rotation RoPE on [b, heads, s, d] with cos/sin [s, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class PlainLlama(nn.Module):
    """Embedding -> N blocks -> RMSNorm -> output (the embedding's weight, tied) -> mean CE."""

    def __init__(self, c: Shape):
        super().__init__()
        self.embedding = nn.Embedding(c.vocab, c.hidden)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.final_norm = nn.RMSNorm(c.hidden, eps=1e-5)
        self.output = nn.Linear(c.hidden, c.vocab, bias=False)
        self.output.weight = self.embedding.weight  # tied, as model.tie_embeddings=true
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
        inv = 1.0 / 10000.0 ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        freqs = torch.outer(torch.arange(c.seq, dtype=torch.float64), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """tokens, labels [b, s] -> scalar mean cross-entropy."""
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.output(self.final_norm(x))  # [b, s, V]
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only, as the trainer does."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class FSDP2Runner:
    """torch FSDP2 alone: `fully_shard` per block, then the root (embedding, final norm, tied
    output); defaults otherwise (reshard after forward, fp32); torch AdamW; clip at 1.0."""

    def __init__(self, shape: Shape, batch, device, lr: float, weight_decay: float):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        self.model = PlainLlama(shape).to(device)
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, weight_decay), lr=lr, betas=(0.9, 0.95), eps=1e-8
        )
        self.batch, self.memory, self.sync_times, self.gather_times = batch, None, [], []

    def model_params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def memory_roots(self) -> list:
        return [m._get_fsdp_state() for m in self.model.modules() if hasattr(m, "_get_fsdp_state")]

    def step(self, probe) -> None:
        self.model(*self.batch).backward()  # gradients reduce-scattered by the backward
        if probe is not None:
            self.memory = probe(self.model_params(), self.optimizer, self.memory_roots())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def import_deepspeed():
    """deepspeed, quiet, on the CPU accelerator (or the error that says why not)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    warnings.filterwarnings("ignore", category=FutureWarning)
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


class DeepSpeedRunner:
    """DeepSpeed ZeRO `stage` on the plain model: fp32, torch AdamW (`torch_adam`), clip 1.0,
    overlap_comm and contiguous gradients on, buckets of `bucket` elements, and for stage 3 every
    parameter sharded (`stage3_param_persistence_threshold: 0`, the layout of FSDP2 and ours)."""

    def __init__(self, stage: int, shape: Shape, batch, device, lr, weight_decay, bucket: int):
        deepspeed = import_deepspeed()
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        for key, value in (("LOCAL_WORLD_SIZE", world), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, str(value))  # read by its launcher checks only
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        torch.manual_seed(0)
        model = PlainLlama(shape).to(device)
        config = {
            "train_micro_batch_size_per_gpu": shape.micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "steps_per_print": 1 << 30,
            "zero_allow_untested_optimizer": True,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "torch_adam": True},
            },
            "zero_optimization": {
                "stage": stage,
                "overlap_comm": True,
                "contiguous_gradients": True,
                "reduce_bucket_size": bucket,
                "allgather_bucket_size": bucket,
                "stage3_prefetch_bucket_size": bucket,
                "stage3_param_persistence_threshold": 0,
            },
        }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, weight_decay), config=config
        )
        self.batch, self.memory, self.sync_times, self.gather_times = batch, None, [], []

    def model_params(self) -> list[torch.Tensor]:
        # ZeRO-3 leaves p.data empty; the rank's partition is p.ds_tensor
        return [getattr(p, "ds_tensor", p) for p in self.engine.module.parameters()]

    def step(self, probe) -> None:
        self.engine.backward(self.engine(*self.batch))  # reduced (partitioned) by the backward
        if probe is not None:
            self.memory = probe(self.model_params(), self.optimizer, [self.optimizer])
        self.engine.step()


if __name__ == "__main__":  # a module of tools/bench_data_parallel.py, not a command of its own
    print(
        f"{__doc__.strip()}\n\nRun python tools/bench_data_parallel.py (--help lists its options)."
    )
