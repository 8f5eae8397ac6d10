import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Triton reads TRITON_INTERPRET when it is first imported: without a GPU its kernels can only run
# in the interpreter, so set it before any test module imports triton (tests/kernels relies on it).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
