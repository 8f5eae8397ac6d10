"""SavedTensorMeter against hand-counted bytes of tiny autograd graphs."""

import torch
from torch import nn

from megatron_lite.training.activation_memory import SavedTensorMeter

F32 = 4


def test_matmul_relu_counts_saved_input_and_output_then_frees():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    with SavedTensorMeter(exclude=[w]) as meter:
        y = (x @ w).relu()  # mm saves x and w (excluded), relu saves its output [4, 16]
        expected = 4 * 8 * F32 + 4 * 16 * F32
        assert meter.current_bytes == expected
        y.sum().backward()  # sum saves nothing
        assert meter.current_bytes == 0, "the graph freed its saved tensors"
    assert meter.peak_bytes == expected
    assert meter.by_label == {}


def test_parameters_are_excluded_without_being_listed():
    lin = nn.Linear(8, 16, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorMeter() as meter:
        lin(x).sum().backward()
    assert meter.peak_bytes == 4 * 8 * F32  # the input only; the weight view is a parameter's


def test_views_count_their_whole_storage_once():
    base = torch.randn(6, 8, requires_grad=True)
    x = base * 1.0  # a non-leaf storage [6, 8]
    with SavedTensorMeter() as meter:
        z = x[:2] * x[2:4]  # mul saves two views of one storage
        assert meter.current_bytes == 6 * 8 * F32, "one storage, counted whole"
        z.sum().backward()
    assert meter.current_bytes == 0 and meter.peak_bytes == 6 * 8 * F32


def test_excluded_storage_matches_its_views():
    w = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorMeter(exclude=[w]) as meter:
        (x @ w.t()).sum().backward()  # saves the view w.t() of the excluded storage
    assert meter.peak_bytes == 4 * 8 * F32


def test_labels_attribute_first_saves():
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorMeter() as meter:
        with meter.label("a"):
            r = x.relu()  # saves r
        with meter.label("b"):
            y = (r * r).exp()  # mul saves r (already counted under "a"), exp saves its output
        y.sum().backward()
    assert meter.by_label == {"a": 4 * 8 * F32, "b": 4 * 8 * F32}
    assert meter.peak_bytes == 2 * 4 * 8 * F32


class _Layer(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.lin = nn.Linear(h, h, bias=False)

    def forward(self, x):
        return self.lin(x).relu()  # saves its input and its output


class _Model(nn.Module):
    def __init__(self, v, h):
        super().__init__()
        self.embedding = nn.Embedding(v, h)
        self.layers = nn.ModuleDict({"3": _Layer(h), "4": _Layer(h)})
        self.head = nn.Linear(h, v, bias=False)

    def forward(self, ids):
        x = self.embedding(ids)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x)


def test_attach_labels_per_layer_embedding_and_output():
    b, s, h, v = 2, 5, 8, 12
    model = _Model(v, h)
    ids = torch.randint(0, v, (b, s))
    with SavedTensorMeter(exclude=model.parameters()) as meter:
        meter.attach_labels(model, module_types=(_Layer,))
        model(ids).square().sum().backward()  # square saves the logits
    assert meter.by_label == {
        "embedding": b * s * 8,  # the int64 indices
        "layer.3": 2 * b * s * h * F32,  # its input (the embedding output) and relu output
        "layer.4": b * s * h * F32,  # its input is layer.3's output, counted there
        "output/loss": b * s * v * F32,  # the head's input was counted in layer.4
    }
    assert meter.current_bytes == 0
    assert meter.peak_bytes == sum(meter.by_label.values())
    assert model.layers["3"]._forward_hooks == {}, "hooks removed on exit"


def test_recomputation_in_backward_is_not_a_forward_label():
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorMeter() as meter:
        with meter.label("layer"):
            y = checkpoint(lambda t: t.relu().exp(), x, use_reentrant=True)
        y.sum().backward()
    assert meter.by_label == {"layer": 4 * 8 * F32}  # the checkpoint saves its input only
    assert meter.recomputed_bytes == 2 * 4 * 8 * F32  # relu and exp outputs, in backward
    assert meter.current_bytes == 0
