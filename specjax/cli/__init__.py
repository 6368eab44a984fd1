"""specjax: batched speculative decoding in JAX. Commands: generate (text from the bundled model
or a Hugging Face checkpoint), batch (a JSONL job file), bench (speed, bundled or at a real
model's shape), memory (bytes per device before a run), compile (compiled for a TPU slice from
any machine: fits or not), simulate (the two KV advance rules), train (the bundled model),
train-mtp (an MTP drafter for any model), train-drafter (a block drafter or an EAGLE-3 head).

One module per group of commands, each with its commands and their flags; ``args`` holds the
flags they share. Nothing heavy is imported before a command runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specjax.cli.args import Parser, show_defaults
from specjax.cli.drafter import train_drafter_command
from specjax.cli.simulate import SWEEP_BATCHES, simulate_command
from specjax.cli.text import batch_command, generate_command
from specjax.cli.tools import bench_command, compile_command, memory_command
from specjax.cli.train import train_command, train_mtp_command

__all__ = ["SWEEP_BATCHES", "build_parser", "console", "main"]

COMMANDS = (  # in --help's order
    simulate_command,
    generate_command,
    memory_command,
    compile_command,
    batch_command,
    bench_command,
    train_command,
    train_mtp_command,
    train_drafter_command,
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specjax", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def console() -> None:
    """The ``specjax`` command (and ``python -m specjax``): ``main`` with Ctrl-C handled from the
    first moment (``specjax`` imports nothing heavy before this runs: ``specjax.interrupt``)."""
    from specjax import interrupt

    interrupt.install()
    raise SystemExit(main())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    show_defaults(parser)
    args = parser.parse_args(argv)
    from specjax import interrupt

    interrupt.name(f"specjax {args.command}")
    from specjax.compile_cache import enable_compilation_cache

    enable_compilation_cache()  # the second run of a command compiles nothing ($SPECJAX_COMPILATION_CACHE=0: off)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C in a caller's process (console() leaves before this)
        print(f"\nspecjax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    console()
