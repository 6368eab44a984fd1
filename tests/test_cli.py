import json

from specjax import cli


def test_simulate_json(capsys):
    assert cli.main(["simulate", "--batch", "16", "--steps", "50", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"config", "rows"}
    assert out["config"]["batch"] == 16
    assert [r["rule"] for r in out["rows"]] == ["cohort", "per_sequence", "alone"]
    rows = {r["rule"]: r for r in out["rows"]}
    assert rows["per_sequence"]["vs_b1"] == 0.0 and rows["alone"]["vs_b1"] == 0.0
    assert rows["cohort"]["vs_b1"] < 0
    ratio = rows["cohort"]["tok_per_step"] / rows["alone"]["tok_per_step"] - 1
    assert abs(rows["cohort"]["vs_b1"] - ratio) < 1e-12


def test_simulate_table_and_plot(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "SWEEP_BATCHES", (1, 4))
    png = tmp_path / "sweep.png"
    assert cli.main(["simulate", "--batch", "4", "--steps", "20", "--beta", "2", "3", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "rule" in out and "cohort" in out and "per_sequence" in out and "alone" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_bad_input_is_clear(capsys):
    assert cli.main(["simulate", "--batch", "0"]) == 2
    assert "batch must be an int >= 1, got 0" in capsys.readouterr().err
