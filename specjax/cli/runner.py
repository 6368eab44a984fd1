"""What ``specjax generate`` and ``specjax batch`` share: the model they run (a bundle or a
Hugging Face checkpoint, with its tokenizer and drafters), its decoding settings, and the
progress line of a slow compile."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import TYPE_CHECKING

from specjax.cli.args import NO_DRAFTER, decoding_settings

if TYPE_CHECKING:
    from specjax.generation_config import GenerationConfig


def is_bundle(path: str | None) -> bool:
    import pathlib

    if path is None or not pathlib.Path(path).exists():
        return True  # the bundle loader reports a missing path
    cfg = pathlib.Path(path) / "config.json"
    try:
        return cfg.is_file() and json.loads(cfg.read_text()).get("format") == "specjax-bundle"
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


class TextRunner:
    """Text in/out over either a specjax bundle (byte tokenizer) or a HF checkpoint."""

    def __init__(self, args: argparse.Namespace) -> None:
        from specjax.sharding import make_mesh, place

        self.mesh = None if args.mesh is None else make_mesh(*args.mesh)
        if is_bundle(args.model):
            from specjax.checkpoint import load_model

            if args.draft_model:
                raise ValueError("--draft-model applies to Hugging Face checkpoints; a bundle carries its own")
            flag = next((f for f, v in (("--chat", args.chat), ("--mtp", args.mtp)) if v), None)
            if flag:
                raise ValueError(f"{flag} applies to Hugging Face checkpoints (a bundle carries its own MTP module "
                                 "and no chat template)")
            self.bundle = load_model(args.model, dtype=args.dtype or "float32", mesh=self.mesh)
            self.model, self.draft = self.bundle.model, self.bundle.draft_model
            self.encode = lambda p: self.bundle.tokenizer.encode(p, bos=True)
            self.decode = self.bundle.tokenizer.decode
            self.eos = self.bundle.tokenizer.eos_id
        else:
            from specjax.hf import load_hf_checkpoint, load_tokenizer

            if args.draft_model and pathlib.Path(args.draft_model).exists() and is_bundle(args.draft_model):
                raise ValueError(f"--draft-model {args.draft_model} is a specjax bundle: a Hugging Face target takes "
                                 "a Hugging Face draft checkpoint with its tokenizer (a bundle carries its own draft "
                                 "model)")
            self.model = load_hf_checkpoint(args.model, dtype=args.dtype, mtp=args.mtp, mesh=self.mesh)
            tok = load_tokenizer(args.model)
            self.draft = load_hf_checkpoint(args.draft_model, dtype=args.dtype, mesh=self.mesh) if args.draft_model \
                else None
            if args.chat and tok.chat_template is None:
                raise ValueError(f"--chat: {args.model} has no chat_template in tokenizer_config.json")
            self.encode = (lambda p: tok.encode_chat([{"role": "user", "content": p}])) if args.chat else tok.encode
            self.decode = tok.decode
            self.eos = tok.eos_id
        if args.draft_checkpoint:
            from specjax.drafter_checkpoints import load_drafter

            if self.mesh is not None:
                raise ValueError("--draft-checkpoint does not run on a --mesh yet (a loaded drafter is not sharded)")
            self.model = load_drafter(args.draft_checkpoint, self.model, dtype=args.dtype)
        from specjax.model import with_layer_loop

        self.model = with_layer_loop(self.model, args.layer_loop)
        self.draft = None if self.draft is None else with_layer_loop(self.draft, args.layer_loop)
        if self.mesh is not None and args.layer_loop == "scan":  # the stacks placed by the table again
            self.model = self.model.replace(params=place(self.model.params, self.mesh))
            self.draft = None if self.draft is None else self.draft.replace(params=place(self.draft.params, self.mesh))


def drafter_for(args: argparse.Namespace, run: TextRunner) -> str | None:
    """``--drafter``; by default the API's rule (``specjax.drafters.default_drafter``)."""
    from specjax.drafters import AUTO, default_drafter

    if args.drafter == NO_DRAFTER:
        return None
    return default_drafter(args.drafter or AUTO, run.model, run.draft)


class Status:
    """Progress on stderr while something slow runs (a compile), cleared by ``done()``: on a
    terminal one transient line at once; elsewhere (a pipe, a log) a line after ``after``
    seconds and one every ``every`` seconds more, so a log shows the wait. ``quiet``
    (``--json``): none."""

    def __init__(self, text: str, quiet: bool = False, after: float = 2.0, every: float = 10.0) -> None:
        import threading
        import time

        self.text, self.t0, self.clock = text, time.perf_counter(), time.perf_counter
        self.tty = not quiet and sys.stderr.isatty()
        self.stop = threading.Event()
        if self.tty:
            sys.stderr.write(text)
            sys.stderr.flush()
        elif not quiet:
            threading.Thread(target=self._lines, args=(after, every), daemon=True, name="specjax-status").start()

    def _lines(self, after: float, every: float) -> None:
        wait = after
        while not self.stop.wait(wait):
            print(f"{self.text} {self.clock() - self.t0:.0f} s", file=sys.stderr, flush=True)
            wait = every

    def done(self) -> None:
        self.stop.set()
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.tty = False


COMPILING = "compiling (once per shape: later runs read the compilation cache) ..."


def settings_for(args: argparse.Namespace, run: TextRunner, drafter) -> GenerationConfig:
    """The generation settings ``generate`` and ``batch`` share, from their flags (checked here:
    a bad value is a one-line error before anything loads or compiles further)."""
    from specjax.generation_config import GenerationConfig

    return GenerationConfig(**(decoding_settings(args) | {"drafter": drafter, "eos_id": run.eos}))
