"""``specjax batch IN.jsonl --out OUT.jsonl``: the job-file contract on the bundled model.

One output line per request, each complete; an existing OUT refused untouched; ``--resume``
finishing an interrupted job (a partial last line redone, SIGINT mid-job); bad input refused
with one line naming the line and field, before anything runs or is written. Greedy tokens
do not depend on the slot count, so runs with different ``--slots`` must agree.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from specjax import cli
from specjax.bench import bench_prompts

N_REQ = 14


def _jobs(n=N_REQ):
    prompts = bench_prompts()
    return [{"prompt": prompts[i % len(prompts)][:80], "max_new_tokens": 6 + (7 * i) % 30} for i in range(n)]


def _write(path, objs, raw=None):
    path.write_text(raw if raw is not None else "".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def _read(path):
    return [json.loads(line) for line in open(path).read().splitlines()]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """One uninterrupted run: ``(input path, {id: output line})``."""
    d = tmp_path_factory.mktemp("clean")
    src = _write(d / "in.jsonl", _jobs())
    out = str(d / "out.jsonl")
    assert cli.main(["batch", src, "--out", out, "--slots", "8", "--json", "--stats", str(d / "stats.json")]) == 0
    return src, {r["id"]: r for r in _read(out)}


def test_stats_file_holds_the_jobs_latency_percentiles(clean):
    src, _ = clean
    stats = json.loads(open(os.path.join(os.path.dirname(src), "stats.json")).read())
    assert (stats["requests"], stats["written"]) == (N_REQ, N_REQ)
    lat = stats["latency"]
    assert set(lat) == {"queue_s", "ttft_s", "tpot_s", "itl_s", "e2e_s"}
    for s in lat.values():
        assert 0 <= s["p50"] <= s["p95"] <= s["p99"] <= s["max"]
    # 14 requests through 8 slots: the last six waited for a row to finish
    assert lat["queue_s"]["max"] > 0 and lat["ttft_s"]["p50"] >= lat["queue_s"]["p50"]
    assert lat["e2e_s"]["max"] <= stats["seconds"]


def test_prefill_chunks_give_the_clean_runs_text(clean, tmp_path, capsys):
    """Sampled rows keyed by seed and position: prompts prefilled 16 tokens at a time give the
    clean run's text; a bad chunk size is one line before anything runs."""
    src, lines = clean
    out = tmp_path / "out.jsonl"
    assert cli.main(["batch", src, "--out", str(out), "--slots", "4", "--prefill-chunk", "16", "--json"]) == 0
    assert {r["id"]: r["text"] for r in _read(out)} == {i: r["text"] for i, r in lines.items()}
    bad = tmp_path / "bad.jsonl"
    assert cli.main(["batch", src, "--out", str(bad), "--prefill-chunk", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prefill_chunk=0 is invalid" in err, err
    assert not bad.exists()


def test_a_shared_header_is_reused_and_gives_the_uncached_text(tmp_path, capsys):
    """Requests behind one 49-byte header, paged pool: the later ones start on its three cached
    pages (the summary says how many prompt tokens were reused) and every sampled text equals
    the run with ``--no-prefix-cache``."""
    header = "# each request of this job begins with this one.\n"  # 49 bytes: three whole pages and one
    src = _write(tmp_path / "in.jsonl", [{"prompt": header + f"{i}: " + p[:20], "max_new_tokens": 8}
                                         for i, p in enumerate(bench_prompts()[:6])])
    base = ["batch", src, "--slots", "4", "--cache", "paged", "--drafter", "ngram"]
    assert cli.main(base + ["--out", str(tmp_path / "on.jsonl"), "--stats", str(tmp_path / "on.json")]) == 0
    assert "prefix cache: 240 of " in capsys.readouterr().out  # 5 requests x 3 pages x 16 tokens
    stats = json.loads((tmp_path / "on.json").read_text())["prefix_cache"]
    assert stats["cached_tokens"] == 240 and 0 < stats["hit_rate"] < 1
    assert cli.main(base + ["--out", str(tmp_path / "off.jsonl"), "--no-prefix-cache", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prefix_cache"]["cached_tokens"] == 0
    assert {r["id"]: r["text"] for r in _read(tmp_path / "on.jsonl")} == \
        {r["id"]: r["text"] for r in _read(tmp_path / "off.jsonl")}


def test_stats_onto_the_output_file_is_refused(clean, tmp_path, capsys):
    src, _ = clean
    out = str(tmp_path / "out.jsonl")
    assert cli.main(["batch", src, "--out", out, "--stats", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--stats" in err and "output file" in err, err
    assert not os.path.exists(out)


def test_one_complete_line_per_request(clean):
    src, lines = clean
    assert sorted(lines) == list(range(1, N_REQ + 1))  # ids default to line numbers
    jobs = _jobs()
    for i, r in lines.items():
        assert set(r) == {"id", "text", "finish_reason", "num_tokens", "tok_per_step"}
        assert r["finish_reason"] in ("eos", "length")
        assert 1 <= r["num_tokens"] <= jobs[i - 1]["max_new_tokens"]
        assert r["finish_reason"] == "eos" or r["num_tokens"] == jobs[i - 1]["max_new_tokens"]
        assert r["tok_per_step"] >= 1.0


def test_existing_out_is_refused_and_left_untouched(clean, tmp_path, capsys):
    src, _ = clean
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    assert cli.main(["batch", src, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists: pass --resume" in err
    assert out.read_text() == "precious\n"


def test_resume_redoes_a_partial_last_line(clean, tmp_path):
    src, lines = clean
    out = tmp_path / "out.jsonl"
    first = [json.dumps(lines[i]) for i in (3, 1, 7)]
    out.write_text("\n".join(first) + "\n" + json.dumps(lines[2])[:25])  # a write cut mid-line
    assert cli.main(["batch", src, "--out", str(out), "--resume", "--slots", "3", "--json"]) == 0
    got = _read(out)
    assert sorted(r["id"] for r in got) == sorted(lines)  # every id exactly once
    assert {r["id"]: r["text"] for r in got} == {i: r["text"] for i, r in lines.items()}


def test_sigint_mid_job_then_resume_gives_the_clean_run(clean, tmp_path):
    src, lines = clean
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "specjax", "batch", src, "--out", str(out), "--slots", "2",
                             "--json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 1:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the job ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "stopped by SIGINT" in err and "Traceback" not in err
    partial = out.read_text()
    assert partial.endswith("\n")
    done = _read(out)
    assert 1 <= len(done) < N_REQ
    assert cli.main(["batch", src, "--out", str(out), "--resume", "--slots", "4", "--json"]) == 0
    got = _read(out)
    assert sorted(r["id"] for r in got) == sorted(lines)
    assert {r["id"]: r["text"] for r in got} == {i: r["text"] for i, r in lines.items()}


@pytest.mark.parametrize("raw,match", [
    ('{"prompt": "a"}\n{"prompt": "b"\n', r"in\.jsonl line 2: not JSON"),
    ('{"prompt": "a"}\n\n{"id": 4}\n', r"in\.jsonl line 3: field 'prompt' is missing"),
    ('{"prompt": "a", "temperature": "hot"}\n', r"line 1: field 'temperature' must be a number"),
    ('{"prompt": "a", "top_p": 2.0}\n', r"line 1: top_p=2\.0 is invalid: must lie in \(0, 1\]"),
    ('{"prompt": "a", "colour": 1}\n', r"line 1: field 'colour' is not allowed"),
    ('{"id": "x", "prompt": "a"}\n{"id": "x", "prompt": "b"}\n', r"line 2: field 'id': 'x' repeats the id of line 1"),
    ('{"prompt": "' + "y" * 300 + '"}\n', r"line 1: prompt='301 tokens' is invalid: .* max_seq_len=256"),
    ('[1, 2]\n', r"line 1: must be a JSON object"),
    ('{"prompt": "a", "max_new_tokens": 100000}\n', r"line 1: max_new_tokens=100000 is invalid: must be < the "
                                                     r"model's max_seq_len=256"),
    ("", r"holds no request"),
])
def test_bad_input_is_one_line_and_nothing_runs(raw, match, tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", None, raw)
    out = tmp_path / "out.jsonl"
    assert cli.main(["batch", src, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specjax batch: error:"), err
    import re

    assert re.search(match, err), err
    assert not out.exists()


def test_out_into_a_missing_folder_is_one_line_before_anything_runs(tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", [{"prompt": "a"}])
    out = tmp_path / "no" / "such" / "out.jsonl"
    assert cli.main(["batch", src, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {out}: its folder {out.parent} does not exist" in err, err


def test_bundle_batch_generate_is_text_in_text_out():
    from specjax import load_model

    bundle = load_model()
    reqs = ["def parse(", {"prompt": "import os\n", "max_new_tokens": 5, "id": "os"}, "class Stack:"]
    got = {c.id: (text, c) for text, c in bundle.batch_generate(reqs, max_new_tokens=12, slots=2)}
    assert sorted(got, key=str) == [0, 2, "os"]
    for rid, prompt, n in ((0, "def parse(", 12), ("os", "import os\n", 5), (2, "class Stack:", 12)):
        texts, _ = bundle.generate([prompt], max_new_tokens=n)
        assert got[rid][0] == texts[0]
        assert got[rid][1].metrics["num_tokens"] <= n
    with pytest.raises(ValueError, match=r"requests\[0\]\.prompt=\[1, 2\] is invalid: must be a string"):
        list(bundle.batch_generate([{"prompt": [1, 2]}]))


def test_a_job_behind_a_shared_header_shares_its_prefix_with_default_flags(tmp_path, capsys):
    """No flags: the bundled model's layers are all global, so a batch job runs on the paged
    cache and later requests start on the header's cached pages (hit rate above one half)."""
    header = "# a job's shared instructions, the same bytes at the head of every request of it, " \
             "long enough for several pages.\n"  # 130 bytes: eight whole pages
    src = _write(tmp_path / "in.jsonl", [{"prompt": header + p[:12], "max_new_tokens": 4}
                                         for p in bench_prompts()[:10]])
    assert cli.main(["batch", src, "--out", str(tmp_path / "out.jsonl"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["prefix_cache"]
    assert stats["hit_rate"] > 0.5, stats
