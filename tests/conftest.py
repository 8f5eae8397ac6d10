import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Triton reads TRITON_INTERPRET when it is first imported: without a GPU its kernels can only run
# in the interpreter, so set it before any test module imports triton (tests/kernels relies on it).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def fake_te(monkeypatch):
    """tests/fake_te importable as `transformer_engine` for one test; yields its `pytorch`
    module (fresh: later tests must not find the stand-in as installed, so it is unloaded)."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_te"))
    import transformer_engine.pytorch as te

    yield te
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]
