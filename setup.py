"""Packaging for megatron_lite. `kernels/` is installed as `megatron_lite.kernels`."""

from setuptools import find_packages, setup

packages = find_packages(include=["megatron_lite", "megatron_lite.*"])
packages.append("megatron_lite.kernels")

setup(
    name="megatron_lite",
    version="0.1.0",
    description="Megatron-style DP x TP x PP x CP x EP pretraining on PyTorch, tested on CPU",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"megatron_lite.kernels": "kernels"},
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
        ],
        "gpu": ["flash-attn>=2.6", "transformer-engine[pytorch]>=1.11"],
        # tools/bench_data_parallel.py's DeepSpeed ZeRO peer (skipped, saying why, without it)
        "bench": ["deepspeed==0.19.8"],
    },
    entry_points={"console_scripts": ["megatron-lite-train=megatron_lite.train:main"]},
)
