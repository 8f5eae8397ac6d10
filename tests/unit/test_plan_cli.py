"""The planner CLI end to end on the Llama-3 configs: report, chart and error path."""

from megatron_lite.config import load_config
from megatron_lite.plan.__main__ import main, with_vocab


def test_plan_prints_every_pipeline_rank_and_writes_the_chart(tmp_path, capsys):
    chart = tmp_path / "mem.png"
    assert main(["--config", "configs/llama3_70b.yaml", "--chart", str(chart)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.rstrip().endswith(("yes", "NO"))]
    assert len(rows) == 4 and all(r.rstrip().endswith("yes") for r in rows), out
    assert "step time" in out and "MFU" in out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_reports_an_invalid_layout_as_a_config_error(capsys):
    assert main(["--config", "configs/llama3_70b.yaml", "parallel.tp=3"]) == 2
    assert "error:" in capsys.readouterr().err


def test_plan_takes_the_vocabulary_from_the_configured_tokenizer(capsys):
    """The default config has model.vocab_size null (the corpus tokenizer's, not yet built):
    the planner sizes the embedding and logits from data.tokenizer_vocab_size."""
    assert main(["--config", "configs/quickstart.yaml"]) == 0
    assert "layout on 8 GPUs" in capsys.readouterr().out
    cfg = with_vocab(load_config("configs/quickstart.yaml", ["data.tokenizer_vocab_size=8000"]))
    assert cfg.model.vocab_size == 8000
    args = ["data.mock=false", "data.paths=[x]", "model.vocab_size=null"]
    assert main(["--config", "configs/smoke.yaml", *args, "--search", "--world", "1"]) == 2
    assert "model.vocab_size=None" in capsys.readouterr().err  # only the data would know
