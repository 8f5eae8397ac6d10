"""Loading a checkpoint never runs code from its files: DCP's pickled `.metadata` goes through
an allow-list. A crafted `.metadata` with a matching checksum runs a shell command under plain
DCP (the independent check that the exploit is live) and is refused, naming the file, by our
reader and by tools/convert_checkpoint.py dcp-to-hf, with nothing executed."""

import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from megatron_lite.checkpoint import files
from megatron_lite.checkpoint.dcp_metadata import read_dcp_metadata
from megatron_lite.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from tests.crafted_checkpoint import craft_metadata
from tools import convert_checkpoint as convert


@pytest.fixture
def model_ckpt(tmp_path):
    """A model-only checkpoint (what hf-to-dcp writes) with two tensors."""
    torch.manual_seed(0)
    tensors = {"embedding.weight": torch.randn(8, 4), "final_norm.weight": torch.randn(4)}
    path = str(tmp_path / "ckpt")
    convert.write_model(path, tensors, {"arch": "llama", "num_layers": 0}, source="test")
    return path, tensors


def _rewrite(path: str, md) -> None:
    """Replace .metadata with `md` (checksum fixed, as in craft_metadata)."""
    import hashlib
    import json

    data = pickle.dumps(md)
    open(os.path.join(path, ".metadata"), "wb").write(data)
    meta = json.load(open(os.path.join(path, "metadata.json")))
    meta["files"][".metadata"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    json.dump(meta, open(os.path.join(path, "metadata.json"), "w"))


def test_real_metadata_reads_as_with_pickle(model_ckpt):
    path, tensors = model_ckpt
    ours = read_dcp_metadata(path)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        plain = pickle.load(f)
    assert ours.state_dict_metadata == plain.state_dict_metadata
    assert ours.storage_data == plain.storage_data
    _, loaded = convert.read_model(path)
    assert loaded.keys() == tensors.keys()
    for k, t in tensors.items():
        assert torch.equal(loaded[k], t), k


def test_crafted_metadata_is_refused_and_runs_nothing(model_ckpt, tmp_path):
    import torch.distributed.checkpoint as dcp

    path, _ = model_ckpt
    marker = tmp_path / "code-ran"
    file = craft_metadata(path, str(marker))
    files.verify(path)  # the checksums match: they cannot catch this
    dcp.FileSystemReader(path).read_metadata()  # plain DCP unpickles it ...
    assert marker.exists(), "the crafted pickle should run code under plain DCP"
    marker.unlink()
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system") as e:
        read_dcp_metadata(path)
    assert f"refused to load {file}" in str(e.value)
    assert "nothing in it was executed" in str(e.value)
    assert not marker.exists(), "our reader ran code from the file"


def test_convert_dcp_to_hf_refuses_crafted_metadata(model_ckpt, tmp_path, capsys):
    path, _ = model_ckpt
    marker, out = tmp_path / "code-ran", tmp_path / "hf"
    file = craft_metadata(path, str(marker))
    assert convert.main(["dcp-to-hf", path, str(out)]) == 2
    err = capsys.readouterr().err
    assert f"refused to load {file}" in err, err
    assert "Traceback" not in err
    assert not marker.exists(), "dcp-to-hf ran code from the checkpoint"
    assert not (out / "model.safetensors").exists()


def test_non_tensor_entries_and_outside_files_are_refused(model_ckpt):
    """A bytes entry would reach torch.load(weights_only=False); a data file outside the
    directory would be read unchecked."""
    path, _ = model_ckpt
    md = read_dcp_metadata(path)
    md.state_dict_metadata["model/embedding.weight"] = BytesStorageMetadata()
    _rewrite(path, md)
    with pytest.raises(UnsafeCheckpointError, match="'model/embedding.weight' is a Bytes"):
        read_dcp_metadata(path)
    md.state_dict_metadata = {}
    for info in md.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    _rewrite(path, md)
    with pytest.raises(UnsafeCheckpointError, match="data file '../../elsewhere.distcp'"):
        read_dcp_metadata(path)


def test_garbage_metadata_is_damage_not_a_refusal(model_ckpt):
    path, _ = model_ckpt
    open(os.path.join(path, ".metadata"), "wb").write(b"\x80\x04not a pickle at all")
    with pytest.raises(CheckpointError, match=r"\.metadata is damaged") as e:
        read_dcp_metadata(path)
    assert not isinstance(e.value, UnsafeCheckpointError)
