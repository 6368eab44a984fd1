"""``specjax batch IN.jsonl --out OUT.jsonl``: a resumable job file through continuous batching.

Input: one JSON object per line, ``{"id", "prompt", "max_new_tokens", "temperature", "top_p",
"top_k", "seed"}`` (only ``prompt`` is required; ``id`` defaults to the line number). Blank
lines are skipped. Everything is checked before anything compiles or is written.

Output: one line per request, in completion order, flushed and fsynced as it completes:
``{"id", "text", "finish_reason", "num_tokens", "tok_per_step"}``. ``--resume`` skips ids
already complete in OUT (a partial last line is cut off and redone); without it an existing
OUT is refused and left untouched. SIGINT/SIGTERM stop the job at the next round: OUT then
holds only complete lines, and the exit status is 130/143.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from typing import Any

from specjax import interrupt

__all__ = ["FIELDS", "JobFiles", "completed_ids", "read_requests", "read_text", "run_job"]

FIELDS = ("id", "prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed")
_TYPES = {"max_new_tokens": (int,), "top_k": (int,), "seed": (int,), "temperature": (int, float),
          "top_p": (int, float)}


def read_text(path: str, name: str, what: str) -> str:
    """A UTF-8 text file's contents; a one-line ``ValueError`` starting with ``name`` for a
    missing, directory, unreadable or non-UTF-8 one (``what``: what the file should be)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{name}: is a directory, not {what}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{name}: cannot read ({e.strerror})") from None


def _line_error(path: str, n: int, what: str) -> ValueError:
    return ValueError(f"{path} line {n}: {what}")


def read_requests(path: str) -> list[tuple[int, dict]]:
    """``(line number, request dict)`` per non-blank line; a ``ValueError`` naming the line and
    the field for anything malformed (not JSON, not an object, no prompt, an unknown field,
    a wrong type, a duplicate id)."""
    lines = read_text(path, path, "a JSONL job file").split("\n")
    out: list[tuple[int, dict]] = []
    first_line: dict[Any, int] = {}
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _line_error(path, n, f"not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise _line_error(path, n, f"must be a JSON object with a 'prompt', got {type(obj).__name__}")
        unknown = [k for k in obj if k not in FIELDS]
        if unknown:
            raise _line_error(path, n, f"field {unknown[0]!r} is not allowed (allowed: {', '.join(FIELDS)})")
        if "prompt" not in obj:
            raise _line_error(path, n, "field 'prompt' is missing")
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise _line_error(path, n, f"field 'prompt' must be a non-empty string, got {obj['prompt']!r}")
        for key, types in _TYPES.items():
            if key in obj and obj[key] is not None and (isinstance(obj[key], bool) or not isinstance(obj[key], types)):
                kind = "an integer" if types == (int,) else "a number"
                raise _line_error(path, n, f"field {key!r} must be {kind}, got {obj[key]!r}")
        rid = obj.get("id", n)
        if isinstance(rid, bool) or not isinstance(rid, int | str):
            raise _line_error(path, n, f"field 'id' must be a string or an integer, got {rid!r}")
        if rid in first_line:
            raise _line_error(path, n, f"field 'id': {rid!r} repeats the id of line {first_line[rid]}")
        first_line[rid] = n
        out.append((n, {**obj, "id": rid}))
    if not out:
        raise ValueError(f"{path}: holds no request (one JSON object per line)")
    return out


def completed_ids(path: str) -> set:
    """Ids already complete in an output file. A partial last line (an interrupted write) is
    cut off the file so the job can append after it; a malformed complete line is an error."""
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1  # past the last complete line
    done = set()
    for n, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
        try:
            done.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise ValueError(f"{path} line {n}: not an output line of specjax batch; refusing to resume") from None
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return done


def _check_writable(flag: str, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: its folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: its folder {folder} is not writable")


@dataclasses.dataclass(frozen=True)
class JobFiles:
    """Where a job reads and writes: ``input`` (JSONL requests), ``out`` (JSONL completions,
    appended), ``stats`` (the summary as JSON, or None); ``resume``: continue ``out``."""

    input: str
    out: str
    stats: str | None = None
    resume: bool = False

    def check(self) -> None:
        """Each path usable before anything compiles or is written; an error names the flag."""
        if os.path.exists(self.out) and not self.resume:
            raise ValueError(f"--out {self.out} exists: pass --resume to continue it, or choose another file")
        if os.path.isdir(self.out):
            raise ValueError(f"--out {self.out} is a directory")
        _check_writable("--out", self.out)
        if self.stats is not None:
            if os.path.abspath(self.stats) in (os.path.abspath(self.out), os.path.abspath(self.input)):
                raise ValueError(f"--stats {self.stats} is the job's input or output file")
            if os.path.isdir(self.stats):
                raise ValueError(f"--stats {self.stats} is a directory")
            _check_writable("--stats", self.stats)


@dataclasses.dataclass
class _Tally:
    """What the written completions add up to, and the progress bar's figures."""

    written: int = 0
    tokens: int = 0
    accepted: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # the prefix cache's hits
    timings: list = dataclasses.field(default_factory=list)  # each written request's latency figures
    first: tuple[float, int] | None = None  # (time, tokens) at the first completion: the rate counts from there

    def add(self, m: dict, fields: tuple) -> None:
        self.written += 1
        self.tokens += m["num_tokens"]
        self.accepted += m["accepted_drafts"]
        self.steps += m["steps"]
        self.prompt_tokens += m["prompt_tokens"]
        self.cached_tokens += m["cached_tokens"]
        self.timings.append({k: m[k] for k in fields})

    def postfix(self, bar) -> None:
        now, mean = time.perf_counter(), f"{(self.accepted + self.steps) / max(self.steps, 1):.2f}"
        if self.first is None:  # compile and the first rows' decode are behind: no honest rate yet
            self.first = (now, self.tokens)
            bar.set_postfix(mean_acc_len=mean)
        else:
            rate = (self.tokens - self.first[1]) / max(now - self.first[0], 1e-9)
            bar.set_postfix(tok_s=f"{rate:.0f}", mean_acc_len=mean)


def run_job(files: JobFiles, runner, kw: dict, *, json_out: bool = False, progress: bool = True) -> int:
    """Run the job in ``files`` with ``runner`` (model, encode, decode); ``kw``: ``batch_generate``
    keywords. Prints a summary (one JSON line with ``json_out``); returns the exit status."""
    from tqdm import tqdm

    from specjax.batch import batch_generate
    from specjax.latency import LATENCY_FIELDS

    reqs = read_requests(files.input)
    files.check()
    encoded = [{**r, "prompt": runner.encode(r["prompt"])} for _, r in reqs]
    where = [f"{files.input} line {n}" for n, _ in reqs]
    skip = completed_ids(files.out) if files.resume and os.path.exists(files.out) else set()
    todo = [i for i, r in enumerate(encoded) if r["id"] not in skip]
    stopped: list[int] = []
    # validates every request (naming its line) before anything compiles or is written
    jobs = batch_generate(runner.model, [encoded[i] for i in todo], where=[where[i] for i in todo],
                          stop=lambda: bool(stopped), **kw)
    old = {s: signal.signal(s, lambda signum, frame: stopped.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    t0, tally = time.perf_counter(), _Tally()
    bar = tqdm(total=len(todo), desc="batch", unit="req", disable=json_out or not progress, file=sys.stderr)
    bar.set_postfix_str("compiling (once per shape; later runs read the compilation cache)")

    def stopped_line() -> str:  # the one line of a stop, graceful or not (lines are fsynced as written)
        name = "SIGTERM" if stopped and stopped[0] == signal.SIGTERM else "SIGINT"
        return (f"specjax batch: stopped by {name}: {tally.written} requests written to {files.out}; rerun with "
                "--resume to finish")

    try:
        with interrupt.saying(stopped_line), open(files.out, "a", encoding="utf-8") as out:
            for c in jobs:
                line = {"id": c.id, "text": runner.decode(c.tokens), "finish_reason": c.finish_reason,
                        "num_tokens": c.metrics["num_tokens"], "tok_per_step": c.metrics["tok_per_step"]}
                out.write(json.dumps(line) + "\n")
                out.flush()
                os.fsync(out.fileno())
                tally.add(c.metrics, LATENCY_FIELDS)
                bar.update(1)
                tally.postfix(bar)
                if stopped:
                    break
    finally:
        bar.close()
        for s, h in old.items():
            signal.signal(s, h)
    summary = _summary(tally, len(reqs), len(skip & {r["id"] for r in encoded}), time.perf_counter() - t0, files.out)
    if files.stats is not None:
        with open(files.stats, "w", encoding="utf-8") as f:
            f.write(json.dumps(summary, indent=1) + "\n")
    if stopped:
        interrupt.say_once(stopped_line())
        return 130 if stopped[0] == signal.SIGINT else 143
    _report(summary, json_out)
    return 0


def _summary(tally: _Tally, requests: int, skipped: int, dt: float, out: str) -> dict:
    from specjax.latency import latency_summary

    n_tok, steps, prompt_tok, cached_tok = tally.tokens, tally.steps, tally.prompt_tokens, tally.cached_tokens
    return {"requests": requests, "skipped": skipped, "written": tally.written,
            "new_tokens": n_tok, "seconds": dt, "tok_per_s_incl_compile": n_tok / dt if dt else 0.0,
            "mean_accepted_length": (tally.accepted + steps) / steps if steps else 0.0, "out": out,
            "latency": latency_summary(tally.timings),
            "prefix_cache": {"prompt_tokens": prompt_tok, "cached_tokens": cached_tok,
                             "hit_rate": cached_tok / prompt_tok if prompt_tok else 0.0}}


def _report(summary: dict, json_out: bool) -> None:
    from specjax.latency import latency_line

    if json_out:
        print(json.dumps(summary))
        return
    print(f"{summary['written']} requests ({summary['skipped']} skipped as already done) -> {summary['out']}: "
          f"{summary['new_tokens']} tokens, {summary['tok_per_s_incl_compile']:.1f} tok/s (incl. compile), "
          f"mean accepted length {summary['mean_accepted_length']:.2f}")
    if summary["written"]:
        print(latency_line(summary["latency"]))
    cache = summary["prefix_cache"]
    if cache["cached_tokens"]:
        print(f"prefix cache: {cache['cached_tokens']} of {cache['prompt_tokens']} prompt tokens reused "
              f"({100 * cache['hit_rate']:.1f}%)")
