"""Hostile checkpoints for the fault tests: a DCP `.metadata` whose pickle runs a shell command
when unpickled, with its checksum in metadata.json updated to match (as an attacker who can
write the directory would do)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle


class RunsCode:
    """Unpickling this calls os.system(cmd)."""

    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def craft_metadata(ckpt: str, marker: str) -> str:
    """Make `ckpt/.metadata` touch `marker` when unpickled, keeping every real entry, and fix
    its sha256/size in metadata.json; returns the .metadata path."""
    file = os.path.join(ckpt, ".metadata")
    with open(file, "rb") as f:
        md = pickle.load(f)  # our own, untampered file
    md.planner_data = RunsCode(f"touch {marker}")
    data = pickle.dumps(md)
    with open(file, "wb") as f:
        f.write(data)
    meta_file = os.path.join(ckpt, "metadata.json")
    with open(meta_file) as f:
        meta = json.load(f)
    meta["files"][".metadata"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    return file
