"""The memory tracker's phases (attach_layers) and the saved-tensor meter's labels
(attach_labels) find a model chunk's layers whatever their class: a registered architecture's
own layer (here a plain module, no TransformerLayer) gets "forward layer k" and "layer.k"."""

import torch
from torch import nn

from megatron_lite.models.chunk import ModelChunk
from megatron_lite.training.activation_memory import SavedTensorMeter, chunk_layers
from megatron_lite.training.memory_tracker import MemoryTracker

F32 = 4


class _Block(nn.Module):
    """relu(x @ W): saves its input and its output (the matmul's input, relu's result)."""

    def __init__(self, h: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(h, h))

    def forward(self, x):
        return torch.relu(x @ self.w)


def _chunk(h: int) -> nn.Module:
    """A ModelChunk holding layers 2 and 3 (global numbers) of _Block, inside a wrapper."""
    chunk = ModelChunk.__new__(ModelChunk)  # only its `layers`, as build_model names them
    nn.Module.__init__(chunk)
    chunk.layers = nn.ModuleDict({"2": _Block(h), "3": _Block(h)})
    chunk.forward = lambda x: chunk.layers["3"](chunk.layers["2"](x))
    wrapper = nn.Module()
    wrapper.module = chunk
    return wrapper


def test_chunk_layers_are_any_class():
    model = _chunk(4)
    assert [n for n, _ in chunk_layers(model)] == ["module.layers.2", "module.layers.3"]


def test_attach_labels_names_a_registered_layer_class():
    b, h = 3, 8
    model = _chunk(h)
    x = torch.randn(b, h)
    with SavedTensorMeter(exclude=model.parameters()) as meter:
        meter.attach_labels(model)
        model.module(x).sum().backward()
    # layer 2 saves x and its relu output; layer 3 saves its relu output (its input is 2's)
    assert meter.by_label == {"layer.2": 2 * b * h * F32, "layer.3": b * h * F32}


def test_attach_layers_names_a_registered_layer_class_phases():
    b, h = 3, 64
    model = _chunk(h)
    x = torch.randn(b, h)
    with MemoryTracker() as tracker:
        tracker.attach_layers([model])
        model.module(x)
    assert {"forward layer 2", "forward layer 3"} <= set(tracker.peaks_by_phase), (
        tracker.peaks_by_phase
    )
