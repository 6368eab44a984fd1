"""The latched KV advance rule: ``KvAdvance`` and ``kv_advance()``."""

from __future__ import annotations

import enum
import logging
import os

__all__ = ["ENV_VAR", "KvAdvance", "kv_advance", "parse_kv_advance"]

ENV_VAR = "SPECJAX_KV_ADVANCE"
logger = logging.getLogger("specjax")


class KvAdvance(enum.Enum):
    """How each row's cache length moves after verification."""

    COHORT = "cohort"  # every row advances by min_i committed_i
    PER_SEQUENCE = "per_sequence"  # every row advances by its own committed_i


_ALLOWED = [r.value for r in KvAdvance]
_latched: KvAdvance | None = None
_logged: set[tuple[KvAdvance, str]] = set()


def parse_kv_advance(value: object, *, what: str = "kv_advance") -> KvAdvance:
    """``KvAdvance`` from an enum member or its name (case-insensitive)."""
    if isinstance(value, KvAdvance):
        return value
    if isinstance(value, str) and value.strip().lower() in _ALLOWED:
        return KvAdvance(value.strip().lower())
    raise ValueError(f"{what} must be one of {_ALLOWED}, got {value!r}")


def _log_once(rule: KvAdvance, source: str) -> None:
    if (rule, source) not in _logged:
        _logged.add((rule, source))
        logger.info("specjax kv_advance = %s (from %s)", rule.value, source)


def kv_advance(value: object = None) -> KvAdvance:
    """Resolve the KV advance rule.

    An explicit ``value`` wins for this call. Otherwise the rule comes from the
    environment variable ``SPECJAX_KV_ADVANCE`` or defaults to ``PER_SEQUENCE``; that
    resolution happens once and is latched for the life of the process. Each
    (rule, source) pair is logged once.
    """
    global _latched
    if value is not None:
        rule = parse_kv_advance(value)
        _log_once(rule, "argument")
        return rule
    if _latched is None:
        env = os.environ.get(ENV_VAR)
        if env is not None and env != "":
            rule = parse_kv_advance(env, what=f"environment variable {ENV_VAR}")
            source = f"environment variable {ENV_VAR}"
        else:
            rule, source = KvAdvance.PER_SEQUENCE, "default"
        _latched = rule
        _log_once(rule, source)
    return _latched


def _reset_latch() -> None:
    """Forget the latched rule (tests only)."""
    global _latched
    _latched = None
    _logged.clear()
