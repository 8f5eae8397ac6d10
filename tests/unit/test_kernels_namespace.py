"""The top-level `kernels/` folder can never shadow an installed `kernels` package (Hugging
Face's, which transformers >= 5.25 imports), whatever the working directory: it has no
`__init__.py`, so it is only a namespace portion, which the import system ranks below any
regular package of that name (PEP 420). Our kernels are imported as `megatron_lite.kernels`."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_in_root(code: str) -> subprocess.CompletedProcess:
    """`python -c code` with the repository root as the working directory (so it is on
    sys.path, as for a user's script, notebook or REPL there) and no test-suite import hooks."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_top_level_kernels_folder_is_not_a_regular_package():
    assert os.path.isdir(os.path.join(ROOT, "kernels")), "the layout keeps kernels/ at the top"
    assert not os.path.exists(os.path.join(ROOT, "kernels", "__init__.py")), (
        "kernels/__init__.py makes the folder a regular package that shadows the installed "
        "`kernels` package for anyone working in the repository root; the package's __init__ "
        "belongs in megatron_lite/kernels/__init__.py"
    )


def test_import_kernels_from_the_root_finds_the_installed_package():
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the Hugging Face `kernels` package is not installed here")
    r = _run_in_root("import kernels; print(kernels.__file__)")
    assert r.returncode == 0, r.stderr
    found = os.path.realpath(r.stdout.strip())
    assert not found.startswith(os.path.realpath(ROOT) + os.sep), (
        f"`import kernels` in the repository root found {found}, ours, not the installed package"
    )


@pytest.mark.slow  # transformers' import: 6 s; the import check above is the main tier's
def test_transformers_builds_a_model_from_the_root():
    pytest.importorskip("transformers")
    code = (
        "import transformers as tf\n"
        "c = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,\n"
        "                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)\n"
        "tf.LlamaForCausalLM(c)\n"
        "import megatron_lite.kernels as k\n"
        "print(k.rms_norm.__module__)\n"
    )
    r = _run_in_root(code)
    assert r.returncode == 0, f"transformers from the repository root failed:\n{r.stderr[-2000:]}"
    assert r.stdout.strip() == "megatron_lite.kernels.rms_norm"


def test_public_kernel_names_come_from_megatron_lite_kernels():
    import megatron_lite.kernels as k

    for name in k.__all__:
        assert getattr(k, name) is not None, name
    assert callable(k.rms_norm) and callable(k.cross_entropy)
