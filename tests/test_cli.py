import json
import subprocess
import sys

import pytest

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


def test_simulate_plot_into_a_missing_folder_is_one_line(capsys, tmp_path):
    assert cli.main(["simulate", "--batch", "4", "--steps", "5", "--plot", str(tmp_path / "no" / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--plot" in err and "does not exist" in err


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda d: d / "missing.txt", "no such file"),
        (lambda d: d, "is a directory"),
        (lambda d: _write(d / "latin1.txt", "caf\xe9\n".encode("latin-1")), "not UTF-8 text"),
        (lambda d: _write(d / "empty.txt", b"\n  \n"), "holds no prompt"),
    ],
)
def test_generate_batch_file_errors_are_one_line(make, match, tmp_path, capsys):
    path = make(tmp_path)
    assert cli.main(["generate", "--batch-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--batch-file {path}" in err and match in err


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_python_dash_m_specjax_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "specjax", "simulate", "--batch", "4", "--steps", "5", "--json"],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["config"]["batch"] == 4


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for shown in ("--max-new-tokens MAX_NEW_TOKENS default: 128", "--temperature TEMPERATURE 0 = greedy (default: 0.8)",
                  "--cache {dense,paged} default: dense", "--seed SEED default: 0"):
        assert shown in out, shown


@pytest.mark.parametrize("argv,match", [
    (["generate", "--batch-file", "/no/such/prompts.txt"], "--batch-file /no/such/prompts.txt: no such file"),
    (["generate", "--batch-file", "/tmp"], "is a directory"),
    (["simulate", "--batch", "4", "--steps", "5", "--plot", "/no/such/dir/x.png"], "--plot"),
    (["simulate", "--steps", "5", "--match", "0.9", "--burst", "2"], "Matches.rate=0.9 needs burst >= rate"),
    (["generate", "x", "--temperature", "nan"], "temperature=nan is invalid"),
    (["generate", "x", "--depth", "deep"], "argument --depth: must be an int or 'auto', got 'deep'"),
    (["generate", "x", "--tree", "2x0"], "tree='2x0' is invalid: must be 1 .. 8 ints >= 1"),
    (["generate", "y" * 300], "prompts[0]='301 tokens' is invalid"),
    (["batch", "/no/such/jobs.jsonl", "--out", "/tmp/never-written.jsonl"], "/no/such/jobs.jsonl: no such file"),
    (["generate", "x", "--mesh", "4by2"], "argument --mesh: mesh '4by2' must be DATAxMODEL"),
    (["generate", "x", "--mesh", "2x2"], "mesh data=2 x model=2 must cover the 1 devices exactly"),
    (["memory", "--mesh", "4x2", "--batch", "6"], "batch=6 is invalid: must divide by the mesh's data axis (4)"),
    (["generate", "x", ""], "prompt 2 is empty: give some text to continue"),
    (["generate", "x", "--model", "tests/fixtures/hf/gemma3", "--draft-model", "checkpoints/default"],
     "--draft-model checkpoints/default is a specjax bundle: a Hugging Face target takes a Hugging Face draft"),
])
def test_cli_errors_are_one_line_in_a_real_process(argv, match):
    """Run as a user does (``python -m specjax``): one error line, exit 2, no traceback."""
    import os

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-m", "specjax", *argv], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and match in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_memory_sizes_a_llama3_8b_shaped_config_on_a_v5e8_shaped_mesh(capsys):
    """Sizing needs no devices (abstract shapes): per-device bytes from the sharding table."""
    import json

    assert cli.main(["memory", "--config", "llama3-8b", "--mesh", "4x2", "--batch", "64", "--context", "8192",
                     "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    # bf16 Llama-3-8B: 8.03e9 weights x 2 bytes, split over the model axis of 2 (norms aside)
    assert 8.0e9 < got["params"] < 8.06e9
    # K and V: 16 rows x capacity x 32 layers x 4 of the 8 KV heads x 128 x 2 bytes (+ per-row lengths)
    assert 0 <= got["kv_cache"] - 16 * got["capacity"] * 32 * 4 * 128 * 2 * 2 < 1024
    assert got["total"] >= got["params"] + got["kv_cache"]
    assert cli.main(["memory", "--config", "llama3-8b", "--mesh", "1x8", "--batch", "64", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert "per device" in out and "kv_cache" in out and "GiB" in out


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    described = out.split("positional arguments")[0]  # the description, not argparse's own list
    import re

    for name in ("generate", "batch", "bench", "memory", "simulate", "train", "train-mtp"):
        assert re.search(rf"\b{name}\b(?!-)", described), name


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_generate", interrupted)  # the parser is built inside main: it takes this one
    try:
        rc = cli.main(["generate", "x"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped cli.main as a traceback")
    assert rc == 130
    err = capsys.readouterr().err
    assert err.strip() == "specjax generate: interrupted"


def test_backslash_n_on_the_command_line_is_a_newline(monkeypatch, capsys):
    seen = {}

    def fake_generate(model, prompts, **kw):
        seen["prompts"] = prompts
        raise ValueError("stop here")

    monkeypatch.setattr("specjax.generation.generate", fake_generate)
    assert cli.main(["generate", "import os\\nimport "]) == 2
    from specjax import load_model

    assert seen["prompts"] == [load_model().tokenizer.encode("import os\nimport ", bos=True)]


def test_the_cli_keeps_compiled_programs_on_disk(tmp_path, monkeypatch):
    """Every command turns on the persistent compilation cache (``$SPECJAX_COMPILATION_CACHE``
    picks the folder, ``0`` turns it off); a folder the user set is kept."""
    import jax

    from specjax.compile_cache import cache_dir, enable_compilation_cache

    monkeypatch.setenv("SPECJAX_COMPILATION_CACHE", "0")
    assert cache_dir() is None
    monkeypatch.setenv("SPECJAX_COMPILATION_CACHE", str(tmp_path / "xla"))
    assert cache_dir() == tmp_path / "xla"
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert enable_compilation_cache() == tmp_path / "xla" and (tmp_path / "xla").is_dir()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
        assert enable_compilation_cache(tmp_path / "other") == tmp_path / "xla"  # set: kept
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
