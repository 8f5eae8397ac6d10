"""The planner CLI end to end on the Llama-3 configs: report, chart and error path."""

from megatron_lite.plan.__main__ import main


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
