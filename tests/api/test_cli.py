import json
import subprocess
import sys

import pytest
from paths import ROOT

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
    for shown in ("--max-new-tokens MAX_NEW_TOKENS tokens to generate per prompt (default: 128)",
                  "--temperature TEMPERATURE 0 = greedy (default: 0.8)",
                  "--cache {dense,paged} KV cache layout (default: dense for generate;", "(default: 0)",
                  "--depth DEPTH drafts per step (default: 3, a preset tree's own, or the block drafter's whole "
                  "block)"):
        assert shown in out, shown


def test_the_decoding_flags_are_the_generation_configs_fields():
    """Every ``GenerationConfig`` field is a ``generate`` and ``batch`` flag (or named in
    ``NOT_FLAGS``), with the API's default (``CLI_DEFAULTS``: where the text CLI samples) and
    the library's own choices; parsing no flags gives those settings."""
    import dataclasses

    from specjax.advance import KvAdvance
    from specjax.cache.base import ATTENTION_IMPLS
    from specjax.cli.args import AUTO_DRAFTER, CLI_DEFAULTS, DECODING_FLAGS, NO_DRAFTER, NOT_FLAGS, decoding_settings
    from specjax.drafters import AUTO, DRAFTERS
    from specjax.generation_config import CACHES, GenerationConfig

    fields = {f.name: f.default for f in dataclasses.fields(GenerationConfig)}
    assert {row[0] for row in DECODING_FLAGS} | set(NOT_FLAGS) == set(fields)
    choices = {"drafter": {*DRAFTERS, AUTO, NO_DRAFTER}, "kv_advance": {r.value for r in KvAdvance},
               "cache": set(CACHES), "attention_impl": set(ATTENTION_IMPLS)}
    assert AUTO_DRAFTER == AUTO
    for field, _flag, _kind, default, allowed, _text in DECODING_FLAGS:
        assert default == fields[field], field
        assert set(allowed or ()) == choices.get(field, set()), field
    from specjax.model.llama import LAYER_LOOPS

    subs = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    for command in (["generate", "x"], ["batch", "in.jsonl", "--out", "out.jsonl"]):
        layer_loop = next(a for a in subs[command[0]]._actions if a.dest == "layer_loop")
        assert set(layer_loop.choices) == set(LAYER_LOOPS)
        args = cli.build_parser().parse_args(command)
        given = decoding_settings(args)
        assert given == {f: CLI_DEFAULTS.get(f, fields[f]) for f in fields if f not in NOT_FLAGS}
        assert GenerationConfig(**given) == GenerationConfig().replace(**CLI_DEFAULTS)
        args = cli.build_parser().parse_args([*command, "--ngram-n", "5", "--attention", "xla", "--drafter", "none"])
        assert {k: decoding_settings(args)[k] for k in ("ngram_n", "attention_impl", "drafter")} == {
            "ngram_n": 5, "attention_impl": "xla", "drafter": NO_DRAFTER}


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

    for name in ("generate", "batch", "bench", "memory", "compile", "simulate", "train", "train-mtp"):
        assert re.search(rf"\b{name}\b(?!-)", described), name


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    from specjax.cli import text

    monkeypatch.setattr(text, "cmd_generate", interrupted)  # the parser is built inside main: it takes this one
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


def _interrupt(argv: list[str], delay: float, env: dict) -> tuple[int, str, float]:
    """``specjax ARGV`` in a real process, SIGINT after ``delay`` s: (exit code, stderr, seconds
    from the signal to the exit)."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "specjax", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    time.sleep(delay)
    sent = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err.decode(), time.perf_counter() - sent


@pytest.mark.parametrize("command", ["generate", "batch"])
def test_ctrl_c_at_any_moment_of_a_cold_run_is_one_line_and_exit_130(command, tmp_path):
    """Importing, loading, compiling (inside XLA, where Python's handler cannot run), decoding:
    a SIGINT is one line and exit 130 within a second, never a traceback, a hang, a crash or
    exit 0. A fresh compilation cache each time: the compile is cold. The delays count from
    when Python itself has started (its own start-up, before any of specjax runs, is measured
    first: a signal inside the interpreter's site import is Python's, not ours), and the exit
    is asked within 1.5 s: the watcher leaves 0.5 s after the signal, the rest is a loaded
    machine's scheduling."""
    import os
    import time

    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import specjax.cli"], check=True)
    started = 1.5 * (time.perf_counter() - t0)

    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": i, "prompt": f"def f{i}("}) + "\n" for i in range(6)))
    argv = {"generate": ["generate", "def parse_args(", "--max-new-tokens", "200"],
            "batch": ["batch", str(jobs), "--out", str(tmp_path / "out.jsonl"), "--max-new-tokens", "200"]}[command]
    for k, delay in enumerate((started, started + 1.5, started + 4.0)):
        env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
        env["SPECJAX_COMPILATION_CACHE"] = str(tmp_path / f"xla{k}")
        rc, err, took = _interrupt(argv, delay, env)
        assert rc == 130, (delay, rc, err)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        stopped = command == "batch" and lines[-1].startswith("specjax batch: stopped by SIGINT: ") and \
            lines[-1].endswith("rerun with --resume to finish")  # the job loop had started: its own line
        assert (lines[-1] == f"specjax {command}: interrupted" or stopped) and "Traceback" not in err, (delay, err)
        assert took < 1.5, (delay, took)


def test_a_slow_compile_shows_progress_on_stderr_when_it_is_not_a_terminal(capsys):
    """Not a terminal (a pipe, a log): a line after ``after`` seconds, then one every ``every``;
    ``done()`` stops them; ``--json`` (quiet) prints none."""
    import time

    from specjax.cli.runner import Status

    status = Status("specjax generate: compiling ...", after=0.05, every=0.1)
    lines, deadline = [], time.monotonic() + 10
    while len(lines) < 2 and time.monotonic() < deadline:  # a loaded machine schedules the thread late
        time.sleep(0.05)
        lines += capsys.readouterr().err.splitlines()
    status.done()
    assert len(lines) >= 2 and all(ln.startswith("specjax generate: compiling ... ") for ln in lines), lines
    time.sleep(0.3)
    assert len(capsys.readouterr().err.splitlines()) <= 1  # at most the line being written as it stopped
    quiet = Status("x", quiet=True, after=0.01)
    time.sleep(0.1)
    quiet.done()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("module", ["specjax.generation_config", "specjax.validate", "specjax.auto", "specjax.batch",
                                    "specjax.streaming", "specjax.cli"])
def test_each_entry_module_imports_first_in_a_fresh_process(module):
    """``import specjax`` loads nothing until a name is used, so whichever module a command
    imports first must import alone (an import cycle shows up only then)."""
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, capture_output=True)


def test_the_python_api_keeps_compiled_programs_on_disk_by_default(tmp_path):
    """No setting: ``generate`` turns the persistent cache on (``~/.cache/specjax/xla``; here
    ``$SPECJAX_CACHE_DIR/xla``) before it compiles, also after other jax work ran first; a folder
    that cannot be written is one line on stderr and the run goes on."""
    import os

    script = ("import jax, jax.numpy as jnp, specjax\n"
              "jnp.ones(3).sum().block_until_ready()\n"  # jax compiled before: its cache decision was made
              "from engine_models import TINY, sharp\n"
              "specjax.generate(sharp(TINY), [[1, 2, 3]], max_new_tokens=4, drafter='ngram')\n"
              "print(jax.config.jax_compilation_cache_dir)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "SPECJAX_COMPILATION_CACHE")}
    env.update(SPECJAX_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == str(tmp_path / "xla")
    assert any(p.name.startswith("jit_generate_loop") for p in (tmp_path / "xla").iterdir()), "the loop was not kept"
    env["SPECJAX_COMPILATION_CACHE"] = str(tmp_path / "a-file" / "xla")
    (tmp_path / "a-file").write_text("")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    warned = [ln for ln in out.stderr.splitlines() if "compilation cache" in ln]
    assert len(warned) == 1 and "cannot write" in warned[0] and "SPECJAX_COMPILATION_CACHE=0" in warned[0], out.stderr
    assert out.stdout.strip() == "None"


def test_ctrl_c_leaves_while_the_main_thread_is_stuck_in_c():
    """The watcher thread: a main thread inside a C call that releases the GIL and never checks
    for signals (an XLA compile; here PBKDF2 for several seconds) cannot run the Python handler,
    yet the process exits 130 with its one line about ``GRACE`` after the signal, not when the
    call ends."""
    import signal
    import time

    script = ("import hashlib, sys\n"
              "from specjax import interrupt\n"
              "interrupt.install(); interrupt.name('specjax test')\n"
              "print('ready', flush=True)\n"
              "hashlib.pbkdf2_hmac('sha256', b'x', b'y', 40_000_000)\n"  # ~20 s, the GIL released
              "print('finished', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # inside the C call
    sent = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    took = time.perf_counter() - sent
    assert proc.returncode == 130 and "finished" not in out, (proc.returncode, out, err)
    assert err.strip() == "specjax test: interrupted" and took < 3.0, (err, took)
