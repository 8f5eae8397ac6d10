"""Enumerate every valid layout of a world size, keep those that fit, rank by throughput."""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass, field

from megatron_lite.config import Config, ConfigError
from megatron_lite.plan.hardware import usable_bytes
from megatron_lite.plan.memory import peak_bytes, rank_memory
from megatron_lite.plan.peak import static_states
from megatron_lite.plan.step_time import StepTime, step_time
from megatron_lite.validation import validate

RECOMPUTE = (None, "selective", "full")
ALWAYS = ("parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "parallel.dp",
          "parallel.zero_stage", "train.micro_batch_size")  # fmt: skip


@dataclass
class Candidate:
    overrides: dict[str, object]
    cfg: Config  # resolved
    peak_bytes: float
    time: StepTime

    def line(self, base: Config | None = None) -> str:
        return override_words(self.overrides, base)


def override_words(overrides: dict[str, object], base: Config | None = None) -> str:
    """Overrides as `key=value` words: the degrees, ZeRO stage and micro batch always, the
    other keys where they differ from `base`."""
    words = []
    for k, v in overrides.items():
        section, name = k.split(".")
        same = base is not None and getattr(getattr(base, section), name) == v
        if k in ALWAYS or not same:
            words.append(f"{k}={_yaml(v)}")
    return " ".join(words)


def _yaml(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _divisors(n: int, limit: int | None = None) -> list[int]:
    """The divisors of n up to `limit` (default n), ascending, in O(√n) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    every = small + [n // d for d in reversed(small) if d * d != n]
    return [d for d in every if d <= (limit or n)]


def pipeline_split(layers: int, stages: int) -> tuple[int | None, int | None] | None:
    """(decoder_first, decoder_last) layers for `stages` virtual stages: (None, None) when they
    divide evenly, else the heaviest equal ends k ≤ the middle stages' share, else the heaviest
    ends one apart (the first one heavier: the last stage holds the output head, the loss and
    any MTP modules), or None. Ends one apart let an odd layer count (DeepSeek-V3's 61) use a
    power-of-two pipeline: 3 + 14·4 + 2 on 16 stages."""
    if layers % stages == 0:
        return None, None
    if stages == 2:  # no middle stages: the two ends are the whole split
        return layers - layers // 2, layers // 2
    for gap in (0, 1):
        for last in range(layers // stages, 0, -1):
            first = last + gap
            rest = layers - first - last
            if rest > 0 and rest % (stages - 2) == 0 and first <= rest // (stages - 2):
                return first, last
    return None


def apply(cfg: Config, overrides: dict[str, object]) -> Config:
    """A copy of `cfg` with `section.key` overrides (sections copied shallowly: fast)."""
    out = copy.copy(cfg)
    for section in ("model", "parallel", "train"):
        setattr(out, section, copy.copy(getattr(cfg, section)))
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    return out


def cp_comm_type(cfg: Config, tp: int, cp: int) -> dict[str, object]:
    """The CP type a layout of degrees tp and cp runs: the config's, except that Ulysses where
    it cannot split the heads (cp not dividing the n/tp query heads, or neither dividing nor
    divisible by the g/tp KV heads) becomes the ring (p2p), which splits the sequence instead.
    One type per (tp, cp), so the search tries no more layouts than before; the config's
    a2a+p2p and p2p are kept as given."""
    p, m = cfg.parallel, cfg.model
    if cp == 1 or p.cp_comm_type != "a2a":
        return {}
    n, g = m.num_attention_heads // tp, (m.num_query_groups or m.num_attention_heads) // tp
    if not g or (n % cp == 0 and (cp % g == 0 if g < cp else g % cp == 0)):
        return {}  # (g = 0: a tp validation rejects anyway)
    return {"parallel.cp_comm_type": "p2p", "parallel.cp_a2a_size": None}


def layouts(cfg: Config, world: int, gpus_per_node: int):
    """Override dicts of every layout to try (validate() decides which are valid)."""
    m = cfg.model
    eps = _divisors(m.num_experts) if m.num_experts else [1]
    for tp in _divisors(world, gpus_per_node):
        for cp in _divisors(world // tp, 8):
            cp_type = cp_comm_type(cfg, tp, cp)
            for pp in _divisors(world // (tp * cp), m.num_layers):  # a layer per stage at least
                dp = world // (tp * cp * pp)
                for vpp in range(1, 9) if pp > 1 else [1]:
                    split = pipeline_split(m.num_layers, pp * vpp)
                    if split is None:
                        continue
                    for ep in eps:
                        for zero in (0, 1, 2, 3):
                            for mbs in (1, 2, 4):
                                for rec in RECOMPUTE:
                                    o = {"parallel.tp": tp, "parallel.pp": pp, "parallel.vpp": vpp,
                                         "parallel.cp": cp, "parallel.ep": ep, "parallel.dp": dp,
                                         "parallel.sequence_parallel": tp > 1,
                                         "parallel.pipeline_layers": None,
                                         "parallel.decoder_first_pipeline_num_layers": split[0],
                                         "parallel.decoder_last_pipeline_num_layers": split[1],
                                         "parallel.zero_stage": zero,
                                         "train.micro_batch_size": mbs}  # fmt: skip
                                    o.update(cp_type)
                                    o["model.recompute_granularity"] = rec
                                    if rec == "full":  # every layer, its input kept
                                        o["model.recompute_method"] = "uniform"
                                        o["model.recompute_num_layers"] = 1
                                    yield o


@dataclass
class SearchCounts:
    """What the search saw: layouts tried, valid (validate() accepts them) and fitting; per
    rule (the config key its ConfigError names) how many layouts it rejected and, as the
    nearest fix, its message for the rejected layout with the fewest data-parallel replicas
    (the smallest change to the batch); the valid layout with the smallest peak."""

    tried: int = 0
    valid: int = 0
    fit: int = 0
    rejected: Counter = field(default_factory=Counter)
    example: dict[str, tuple[int, str]] = field(default_factory=dict)  # key -> (dp, message)
    smallest_peak: float | None = None  # bytes, of the valid layout needing the least
    smallest: dict[str, object] | None = None  # its overrides

    def reject(self, overrides: dict[str, object], error: ConfigError) -> None:
        message = str(error)
        key = message.split("=", 1)[0] if "=" in message.split(" ", 1)[0] else "other"
        self.rejected[key] += 1
        dp = int(overrides["parallel.dp"])
        if key not in self.example or dp < self.example[key][0]:
            self.example[key] = (dp, message)

    def rejections(self, most: int = 4) -> list[str]:
        """The rules that rejected layouts, most first: "N by key (e.g. message)"."""
        return [
            f"{n} by {key} (e.g. {self.example[key][1]})"
            for key, n in self.rejected.most_common(most)
        ]


def search(cfg: Config, world: int, gpu, mfu: float, gpus_per_node: int, top: int = 5,
           reserve_fraction: float = 0.05) -> tuple[list[Candidate], SearchCounts]:  # fmt: skip
    """The `top` fitting layouts by predicted tokens/s, and the counts (see SearchCounts). All
    are ranked with the closed-form bubble, the top ones then timed with the schedule
    simulator."""
    budget = usable_bytes(gpu, reserve_fraction)
    counts = SearchCounts()
    fits: list[Candidate] = []
    for o in layouts(cfg, world, gpus_per_node):
        counts.tried += 1
        try:
            r = validate(apply(cfg, o), world, warn=False)
        except ConfigError as e:
            counts.reject(o, e)
            continue
        counts.valid += 1
        ranks = sorted({0, min(1, r.parallel.pp - 1), r.parallel.pp - 1})
        # the model states alone bound the peak from below: where they exceed the budget and
        # cannot beat the smallest peak seen, the schedule walk would not change the outcome
        floor = max(sum(static_states(r, k).values()) for k in ranks)
        if floor > budget and counts.smallest_peak is not None and floor >= counts.smallest_peak:
            continue
        peak = max(peak_bytes(r, world, k) for k in ranks)
        if peak > budget:
            if counts.smallest_peak is None or peak < counts.smallest_peak:
                counts.smallest_peak, counts.smallest = peak, o
            continue
        counts.fit += 1
        t = step_time(r, world, gpu, mfu, gpus_per_node, simulate=False)
        fits.append(Candidate(o, r, peak, t))
    fits.sort(key=lambda c: -c.time.tokens_per_s)
    best = fits[:top]
    for c in best:  # the schedule simulator for the finalists
        c.time = step_time(c.cfg, world, gpu, mfu, gpus_per_node, simulate=True)
        c.peak_bytes = max(rank_memory(c.cfg, world, k).total for k in range(c.cfg.parallel.pp))
    best.sort(key=lambda c: -c.time.tokens_per_s)
    return best[:top], counts


def nearest_valid_world(cfg: Config, world: int, gpus_per_node: int, span: int = 8,
                        budget: int = 2000) -> int | None:  # fmt: skip
    """The world size nearest `world` (within ±`span`, the smaller first on a tie) with a
    layout validate() accepts, or None; at most `budget` layouts are validated (~1 s)."""
    tried = 0
    for w in (w for d in range(1, span + 1) for w in (world - d, world + d) if w >= 1):
        for o in layouts(cfg, w, gpus_per_node):
            tried += 1
            if tried > budget:
                return None
            try:
                validate(apply(cfg, o), w, warn=False)
            except ConfigError:
                continue
            return w
    return None
