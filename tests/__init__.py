"""The test suite. Importing it (pytest's conftest, every forked rank that unpickles a test
function) first makes `import kernels` mean the installed PyPI package of that name."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _installed_kernels_first():
    """Make `import kernels` mean the installed PyPI package of that name, not our kernels/.

    The repository root is on sys.path under pytest, so our top-level kernels/ (installed as
    megatron_lite.kernels) shadows the Hugging Face `kernels` package, which transformers>=5.25
    requires and imports (`from kernels import CUDAProperties`). Importing the installed one
    with the root off sys.path puts it in sys.modules, where every later import finds it. No
    code of ours imports a top-level `kernels`."""
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT]
    try:
        import kernels  # noqa: F401
    except ImportError:
        pass  # not installed: there is nothing to shadow
    finally:
        sys.path[:] = saved


_installed_kernels_first()
