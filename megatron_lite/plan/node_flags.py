"""The planner's node flags (plan/hardware.py's Node): their arguments, and the rules that
need the interconnect they describe (the numeric ranges are plan/flags.py's NUMERIC)."""

from __future__ import annotations

import argparse

from megatron_lite.plan.errors import flag_error
from megatron_lite.plan.hardware import GPUS, INTERCONNECTS, NIC_TYPES


def node_arguments(ap: argparse.ArgumentParser) -> None:
    """--interconnect, --pcie-gbps, --gpus-per-switch and the NIC flags."""
    link_help = (
        "how a node's GPUs talk: nvlink (NVLink/NVSwitch), pcie (through host memory: no "
        "peer-to-peer, as on GeForce), pcie-p2p (default: the GPU's usual node)"
    )
    ap.add_argument("--interconnect", default=None, choices=INTERCONNECTS, help=link_help)
    ap.add_argument("--pcie-gbps", default=None, help="GB/s per GPU per direction of PCIe")
    ap.add_argument("--gpus-per-switch", default=None, help="GPUs sharing a PCIe uplink")
    ap.add_argument("--nic-gbps", default=None, help="Gb/s line rate of one NIC")
    ap.add_argument("--nics-per-node", default=None, help="NICs per node")
    ap.add_argument("--nic-type", default=None, choices=NIC_TYPES, help="ib | roce")


def check_node(args: argparse.Namespace) -> None:
    """The node flags against the interconnect they describe (the GPU's usual one unless
    --interconnect names it)."""
    gpu = GPUS[args.gpu]
    kind = args.interconnect or gpu.interconnect
    given = (
        f"--interconnect {kind}" if args.interconnect else f"--gpu {args.gpu} (its node: {kind})"
    )
    if kind == "nvlink":
        for flag in ("--pcie-gbps", "--gpus-per-switch"):
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                flag_error(flag, getattr(args, flag[2:].replace("-", "_")),
                           f"describes PCIe, and {given} is NVLink",
                           f"drop {flag}, or give --interconnect pcie or pcie-p2p")  # fmt: skip
        if not gpu.nvlink_gbps and args.nvlink_gbps is None:
            flag_error("--interconnect", kind, f"the {gpu.name} has no NVLink switch",
                       "give --nvlink-gbps (an NVLink bridge's GB/s), or --interconnect "
                       "pcie-p2p")  # fmt: skip
    elif args.nvlink_gbps is not None:
        flag_error("--nvlink-gbps", args.nvlink_gbps, f"describes NVLink, and {given} is PCIe",
                   "give --pcie-gbps for the PCIe link, or --interconnect nvlink")  # fmt: skip
    if args.gpus_per_switch is not None and args.gpus_per_switch > args.gpus_per_node:
        flag_error("--gpus-per-switch", args.gpus_per_switch,
                   f"is more than the node's --gpus-per-node {args.gpus_per_node}",
                   f"give at most {args.gpus_per_node}")  # fmt: skip
