import logging

import pytest

from specjax import advance as kva
from specjax.advance import KvAdvance, kv_advance


@pytest.fixture(autouse=True)
def fresh_latch(monkeypatch):
    monkeypatch.delenv(kva.ENV_VAR, raising=False)
    kva._reset_latch()
    yield
    kva._reset_latch()


def test_default_is_per_sequence_and_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="specjax"):
        assert kv_advance() is KvAdvance.PER_SEQUENCE
        assert kv_advance() is KvAdvance.PER_SEQUENCE
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["specjax kv_advance = per_sequence (from default)"]


def test_env_var_is_latched(monkeypatch, caplog):
    monkeypatch.setenv(kva.ENV_VAR, "cohort")
    with caplog.at_level(logging.INFO, logger="specjax"):
        assert kv_advance() is KvAdvance.COHORT
        monkeypatch.setenv(kva.ENV_VAR, "per_sequence")
        assert kv_advance() is KvAdvance.COHORT  # latched
    assert [r.getMessage() for r in caplog.records] == [
        f"specjax kv_advance = cohort (from environment variable {kva.ENV_VAR})"
    ]


def test_explicit_argument_wins():
    assert kv_advance("cohort") is KvAdvance.COHORT
    assert kv_advance(KvAdvance.PER_SEQUENCE) is KvAdvance.PER_SEQUENCE
    assert kv_advance("PER_SEQUENCE") is KvAdvance.PER_SEQUENCE


def test_invalid_values_list_allowed(monkeypatch):
    with pytest.raises(ValueError, match=r"\['cohort', 'per_sequence'\], got 'min'"):
        kv_advance("min")
    monkeypatch.setenv(kva.ENV_VAR, "both")
    with pytest.raises(ValueError, match=r"SPECJAX_KV_ADVANCE must be one of .*'both'"):
        kv_advance()
