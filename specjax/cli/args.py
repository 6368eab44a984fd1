"""The CLI's shared argument types and parser: decoding flags, ``--mesh``, ``--depth``, and a
parser whose errors are one line."""

from __future__ import annotations

import argparse
import sys


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option with a default says it in ``--help`` (unless its help already names one)."""
    for action in parser._actions:  # argparse keeps no public list of actions
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)
            continue
        if not action.option_strings or any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            continue
        if "default" not in (action.help or ""):
            action.help = f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"


def mesh_arg(text: str) -> tuple[int, int]:
    """``--mesh DATAxMODEL``."""
    from specjax.sharding import parse_mesh

    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def depth_arg(text: str) -> int | str:
    """``--depth``: an int, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int or 'auto', got {text!r}") from None


# ``GenerationConfig``'s fields as ``generate`` / ``batch`` flags, one row each: (field, flag,
# type, default, choices, help). Defaults and choices are the library's (``CLI_DEFAULTS``: where
# the text CLI deliberately differs: it samples); the table is written out, not read from
# ``GenerationConfig``, because the CLI imports nothing heavy before a command runs, and
# tests/api/test_cli.py fails when a field, a default or a choice drifts from the API's.
AUTO_DRAFTER, NO_DRAFTER = "auto", "none"
CLI_DEFAULTS = {"max_new_tokens": 128, "temperature": 0.8, "top_p": 0.95}  # a text CLI samples
PER_REQUEST = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")  # a job line may set its own
NOT_FLAGS = {"eos_id": "the tokenizer's end-of-sequence ids"}  # fields no flag sets
DECODING_FLAGS = (
    ("drafter", "--drafter", str, AUTO_DRAFTER, ("mtp", "draft_model", "ngram", "block", AUTO_DRAFTER, NO_DRAFTER),
     "auto: mtp if the model has it, else block if it has a block drafter (a bundle's, or --draft-checkpoint's), "
     "else draft_model if given, else ngram; none: plain decoding"),
    ("depth", "--depth", depth_arg, None, None,
     "drafts per step (default: 3, a preset tree's own, or the block drafter's whole block), or 'auto': each step "
     "picks its window (1 .. --max-depth + 1) and each row its drafts by expected tokens per second"),
    ("max_depth", "--max-depth", int, 3, None, "the most drafts --depth auto may propose"),
    ("tree", "--tree", str, None, None,
     "verify a token tree each step instead of a chain: children per node at each draft depth, e.g. 2x2x1 (10 "
     "nodes, depth 3; the MTP drafter; --depth is the tree's), or dynamic:N,K; with --depth auto each step verifies "
     "the tree, a chain or none, as the cost table prices them"),
    ("cost", "--cost", str, None, None,
     "--depth auto: a step-cost table (JSON: windows, batches, seconds); default: measured at warm-up and kept in "
     "$SPECJAX_CACHE_DIR (~/.cache/specjax)"),
    ("ngram_n", "--ngram-n", int, 3, None, "the n-gram drafter's n: the suffix it matches"),
    ("kv_advance", "--kv-advance", str, None, ("per_sequence", "cohort"),
     "KV advance rule (default: $SPECJAX_KV_ADVANCE, else per_sequence)"),
    ("cache", "--cache", str, None, ("dense", "paged"),
     "KV cache layout (default: dense for generate; paged for batch jobs where the model's layers are all global, "
     "so requests share cached prompt prefixes)"),
    ("attention_impl", "--attention", str, "auto", ("xla", "pallas", "auto"),
     "attention path: Pallas kernels (interpret mode on CPU) or XLA; auto = Pallas on TPU, XLA on GPU and CPU"),
    ("temperature", "--temperature", float, 0.0, None, "0 = greedy"),
    ("top_k", "--top-k", int, None, None, "sample among the k most probable tokens"),
    ("top_p", "--top-p", float, None, None, "1 = no top-p filter"),
    ("max_new_tokens", "--max-new-tokens", int, 64, None, "tokens to generate per prompt"),
    ("seed", "--seed", int, 0, None, "each row's seed derives from this and the row"),
)


def add_decoding_args(p: argparse.ArgumentParser, per_request: bool = False) -> None:
    """The model and decoding options ``generate`` and ``batch`` share: ``DECODING_FLAGS`` (each
    sets the ``GenerationConfig`` field it names) and the model's. ``per_request``: a batch job,
    whose lines may set the sampling ones themselves."""
    p.add_argument("--model", default=None,
                   help="a specjax bundle or a local Hugging Face checkpoint directory (default: checkpoints/default)")
    p.add_argument("--draft-model", default=None, help="checkpoint of a smaller model with the same tokenizer")
    p.add_argument("--draft-checkpoint", default=None, metavar="DIR",
                   help="a drafter's public checkpoint folder for the model (format read from its config.json: "
                        "DFlash -> the block drafter)")
    for field, flag, kind, default, choices, text in DECODING_FLAGS:
        if per_request and field in PER_REQUEST:
            text = f"for lines without {field}; {text}"
        p.add_argument(flag, dest=field, type=kind, choices=choices, default=CLI_DEFAULTS.get(field, default),
                       help=text)
    p.add_argument("--mesh", type=mesh_arg, default=None, metavar="DATAxMODEL",
                   help="run on a (data, model) device mesh covering every device, e.g. 4x2: the batch split over "
                        "data, the model over model (README: Many devices, many hosts)")
    p.add_argument("--layer-loop", choices=["unrolled", "scan"], default="unrolled",
                   help="scan: the layers as one lax.scan (compile time flat in depth); unrolled: every layer "
                        "compiled (faster decode on CPU)")
    p.add_argument("--chat", action="store_true",
                   help="Hugging Face checkpoints: each prompt as a user message through the model's chat template")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights and KV caches in this dtype (default: a Hugging Face checkpoint's own; float32 for a "
                        "bundle)")
    p.add_argument("--mtp", default=None, metavar="DIR",
                   help="Hugging Face checkpoints: the MTP module `specjax train-mtp` wrote to DIR (default: the "
                        "checkpoint directory's own, if any)")


def decoding_settings(args: argparse.Namespace) -> dict:
    """``DECODING_FLAGS``' values as ``GenerationConfig`` keywords (the drafter as given)."""
    return {field: getattr(args, field) for field, *_ in DECODING_FLAGS}


class Parser(argparse.ArgumentParser):
    """Usage errors as one line (``specjax generate: error: ...``, exit 2), like every other
    CLI error; ``--help`` still shows the usage."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)
