"""Packaging for megatron_lite. The top-level `kernels/` folder holds the modules of
`megatron_lite.kernels` (whose `__init__.py` sits in megatron_lite/kernels/, so that `kernels/`
is never an importable top-level package: see that file); a built wheel copies them in."""

import glob
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    """Copies kernels/*.py into megatron_lite/kernels/ of the build (wheels, non-editable
    installs); a source tree and an editable install reach them through the package's __path__."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # the package's __path__ reaches kernels/
            return
        dest = os.path.join(self.build_lib, "megatron_lite", "kernels")
        self.mkpath(dest)
        for path in sorted(glob.glob(os.path.join("kernels", "*.py"))):
            self.copy_file(path, os.path.join(dest, os.path.basename(path)))


setup(
    name="megatron_lite",
    version="0.1.0",
    description="Megatron-style DP x TP x PP x CP x EP pretraining on PyTorch, tested on CPU",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_lite", "megatron_lite.*"]),
    cmdclass={"build_py": BuildPyWithKernels},
    install_requires=[
        # torch is listed without a CUDA/CPU pin: install it first (see README) so pip never
        # replaces an existing build with a multi-GB CUDA wheel.
        "torch>=2.6",
        "triton>=3.2",
        "sentencepiece>=0.2",
        "tokenizers>=0.15",  # Hugging Face tokenizer.json files
        "wandb>=0.17",
        "numpy>=1.24",
        "pyyaml>=6.0",
        "tqdm>=4.60",
    ],
    extras_require={
        "dev": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "ruff>=0.6",
            "matplotlib>=3.7",
            "transformers>=4.45",  # Hugging Face checkpoint conversion tests
            "safetensors>=0.4",
            # the tests of the data formats, TensorBoard and HF datasets read back with the
            # peers' own readers
            "pyarrow>=14",
            "zstandard>=0.22",
            "datasets>=2.16",
            "tensorboard>=2.14",
            "torchao>=0.18,<0.19",  # model.fp8=tensorwise|rowwise (its float8 training)
        ],
        # tools/preprocess_data.py's Parquet, .jsonl.zst and saved-HF-dataset inputs
        "data": ["pyarrow>=14", "zstandard>=0.22"],
        # log.tensorboard=true
        "tensorboard": ["tensorboard>=2.14"],
        # model.fp8=tensorwise|rowwise: torchao's float8 training recipes (docs/fp8.md)
        "fp8": ["torchao>=0.18,<0.19"],
        "gpu": ["flash-attn>=2.6", "transformer-engine[pytorch]>=1.11"],
        # tools/bench_data_parallel.py's DeepSpeed ZeRO peer (skipped, saying why, without it)
        "bench": ["deepspeed==0.19.8"],
    },
    entry_points={"console_scripts": ["megatron-lite-train=megatron_lite.train:main"]},
)
