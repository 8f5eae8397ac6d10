"""The test suite. Importing it (pytest's conftest, every forked rank that unpickles a test
function) makes `import kernels` find the installed PyPI package of that name, if any."""

import importlib.abc
import importlib.machinery
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _InstalledKernelsFirst(importlib.abc.MetaPathFinder):
    """The repository root is on sys.path under pytest, so our top-level kernels/ (installed as
    megatron_lite.kernels) would shadow the Hugging Face `kernels` package, which
    transformers>=5.25 requires and imports (`from kernels import CUDAProperties`). This finder
    looks `kernels` up on sys.path without the root; it imports nothing itself (an import of
    the package costs ~0.7 s, and every forked rank imports this module). No code of ours
    imports a top-level `kernels`."""

    def find_spec(self, name, path=None, target=None):
        if name != "kernels":
            return None
        elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT]
        return importlib.machinery.PathFinder.find_spec(name, elsewhere)


if not any(isinstance(f, _InstalledKernelsFirst) for f in sys.meta_path):
    sys.meta_path.insert(0, _InstalledKernelsFirst())
