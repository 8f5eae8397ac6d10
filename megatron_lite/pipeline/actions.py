"""The vocabulary of pipeline schedules: one rank's ordered list of actions, where its
virtual stages sit, and the rules every table obeys (pipeline/schedules.py builds the tables).

Each function here is pure (no torch.distributed): it returns what one pipeline rank does, in
order. The engine executes the list; `simulate.py` checks a whole table (every rank's list) for
matched sends/receives and deadlock-freedom and measures its bubble, without processes.

Model layout: the model is cut into `pp * vpp` virtual stages; rank `r` holds the local chunks
`c = 0..vpp-1`, which are the virtual stages `c * pp + r`. Activations flow from virtual stage
`s` to `s + 1` (rank r -> r + 1, wrapping from rank pp - 1 to the next chunk on rank 0) and
gradients flow back from `s + 1` to `s`.

An `Action(kind, microbatch, chunk)` is one of
  forward / backward           run that chunk on that microbatch
  recv_forward / send_forward  receive the chunk's input activation / send its output activation
  recv_backward / send_backward receive the grad of the chunk's output / send the grad of its input
Send/recv actions name the local (microbatch, chunk) whose tensor they carry; `peer_of` gives
the other side. There is no recv_forward/send_backward on virtual stage 0 and no
send_forward/recv_backward on the last virtual stage.

Communication is batched: consecutive send/recv actions with no compute between them form one
batch, issued together as one `batch_isend_irecv` that blocks until all its ops complete
(`comm_batches` groups them). Within a batch, activation ops come before gradient ops, so two
ranks that exchange both over one link (pp=2, interleaved) issue them in the same order: issue a
batch's ops in list order. The simulator proves each table deadlock-free under rendezvous
semantics (a send completes only once the peer has posted the matching receive).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

COMPUTE_KINDS = ("forward", "backward", "weight")
COMM_KINDS = ("recv_forward", "send_forward", "recv_backward", "send_backward")
KINDS = COMPUTE_KINDS + COMM_KINDS
# Order of ops inside one batch: activation traffic first, then gradient traffic.
_BATCH_ORDER = {"send_forward": 0, "recv_forward": 1, "send_backward": 2, "recv_backward": 3}
RECV_OF = {"send_forward": "recv_forward", "send_backward": "recv_backward"}  # a send's match
_SHORT = {"forward": "F", "backward": "B", "weight": "W", "recv_forward": "rF",
          "send_forward": "sF", "recv_backward": "rB", "send_backward": "sB"}  # fmt: skip
# Where the pp * vpp virtual stages sit: "loop" puts stage c * pp + r on rank r (Megatron's
# interleaving), "v" puts stages r and 2 * pp - 1 - r on rank r (ZB-V, DualPipeV: vpp = 2, and
# the last rank's two chunks meet, so the turn from chunk 0 to chunk 1 stays on one rank).
PLACEMENTS = ("loop", "v")


@dataclass(frozen=True)
class Action:
    """One step of a rank: `kind` on local model `chunk` for `microbatch`."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {KINDS}")

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind.startswith("send_")

    def __str__(self) -> str:
        return f"{_SHORT[self.kind]}{self.microbatch}.{self.chunk}"


Step = Action | tuple[Action, ...]


def virtual_stage(pp_rank: int, chunk: int, pp_size: int, placement: str = "loop") -> int:
    """Global position of local `chunk` on `pp_rank` in the pipeline of pp_size * vpp stages."""
    if placement == "v":
        if chunk not in (0, 1):
            raise ValueError(f"chunk={chunk}: the V placement holds chunks 0 and 1 only")
        return pp_rank if chunk == 0 else 2 * pp_size - 1 - pp_rank
    if placement != "loop":
        raise ValueError(f"placement={placement!r} is not one of {PLACEMENTS}")
    return chunk * pp_size + pp_rank


def stage_location(stage: int, pp_size: int, placement: str = "loop") -> tuple[int, int]:
    """(pipeline rank, local chunk) holding virtual `stage`: the inverse of `virtual_stage`."""
    if placement == "v":
        return (stage, 0) if stage < pp_size else (2 * pp_size - 1 - stage, 1)
    if placement != "loop":
        raise ValueError(f"placement={placement!r} is not one of {PLACEMENTS}")
    return stage % pp_size, stage // pp_size


def peer_of(action: Action, pp_rank: int, pp_size: int, placement: str = "loop") -> tuple[int, int]:
    """(peer rank, peer's local chunk) on the other side of a send/recv action."""
    if not action.is_comm:
        raise ValueError(f"{action.kind} has no peer: only send/recv actions do")
    downstream = action.kind in ("send_forward", "recv_backward")
    stage = virtual_stage(pp_rank, action.chunk, pp_size, placement) + (1 if downstream else -1)
    return stage_location(stage, pp_size, placement)


def comm_batches(actions: list[Action]) -> list[Step]:
    """Group consecutive send/recv actions into one tuple (one batch_isend_irecv each).

    Compute actions stay bare. Example: [F0.0, sF0.0, rB0.0, B0.0] -> [F0.0, (sF0.0, rB0.0), B0.0].
    """
    steps: list[Step] = []
    batch: list[Action] = []
    for action in actions:
        if action.is_comm:
            batch.append(action)
            continue
        if batch:
            steps.append(tuple(batch))
            batch = []
        steps.append(action)
    if batch:
        steps.append(tuple(batch))
    return steps


def format_actions(actions: list[Action]) -> str:
    """Compact one-line form, batches in brackets: 'F0.0 [sF0.0 rB0.0] B0.0'."""
    parts = []
    for step in comm_batches(actions):
        parts.append(f"[{' '.join(map(str, step))}]" if isinstance(step, tuple) else str(step))
    return " ".join(parts)


def _check_rank(pp_size: int, pp_rank: int) -> None:
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, pp={pp_size})")


def _batch(*ops: Action | None) -> list[Action]:
    """The non-None ops in the order two ranks sharing a link both use (activations first)."""
    return sorted((op for op in ops if op is not None), key=lambda op: _BATCH_ORDER[op.kind])


def _label_receives(actions: list[Action]) -> list[Action]:
    """Give each receive the microbatch of the next compute on its chunk still lacking input.

    Inputs of one chunk arrive in the order that chunk computes, so the n-th recv_forward for
    chunk c carries the input of the n-th forward of chunk c (likewise for backward).
    """
    order: dict[tuple[str, int], list[int]] = defaultdict(list)
    for a in actions:
        if not a.is_comm:
            order[(a.kind, a.chunk)].append(a.microbatch)
    taken: dict[tuple[str, int], int] = defaultdict(int)
    labelled = []
    for a in actions:
        if a.kind in ("recv_forward", "recv_backward"):
            key = (a.kind.removeprefix("recv_"), a.chunk)
            a = Action(a.kind, order[key][taken[key]], a.chunk)
            taken[key] += 1
        labelled.append(a)
    return labelled
