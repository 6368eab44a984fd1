"""Per-request latency of batch jobs: the timeline's arithmetic against hand-computed figures,
and a job run on a driven clock, where an admit's stall must land in exactly the rows that
were live across it."""

import numpy as np
import pytest
from batch_models import MODEL, alone

import specjax.batch.scheduler as batch_mod
import specjax.latency as latency
from specjax import Request, batch_generate


def _timeline():
    t = latency.Timeline()
    t.add(0, 4, 10.0, 18.0)  # four steps in 8 s: each ends 2 s after the one before
    t.add(4, 4, 18.0, 19.0)  # a call that took no step: nothing to place
    t.add(4, 6, 20.0, 30.0)  # the host's 2 s between calls fall into step 4
    return t


def test_each_step_ends_its_share_into_its_call():
    np.testing.assert_allclose(_timeline().step_end(np.arange(6)), [12, 14, 16, 18, 25, 30])
    with pytest.raises(ValueError, match="outside the recorded decode calls"):
        _timeline().step_end(np.array([6]))
    t = _timeline()
    t.drop_before(4)  # the first call ended before step 4: forgotten; the last is kept
    np.testing.assert_allclose(t.step_end(np.array([4, 5])), [25, 30])
    with pytest.raises(ValueError, match="outside the recorded decode calls"):
        t.step_end(np.array([3]))


def test_a_requests_figures_follow_its_steps_and_its_cut_last_step():
    # decode steps at global 2, 3, 4 accept 2, 0, 3 drafts; the budget cut the last step to
    # 2 of its 4 tokens: 1 (prefill) + 3 + 1 + 2 = 7 tokens
    m = latency.request_latency(_timeline(), arrival=1.0, admit_start=4.0, admit_end=9.0, start_step=2,
                                trace=np.array([2, 0, 3]), num_tokens=7)
    assert m["queue_s"] == 3.0 and m["ttft_s"] == 8.0
    np.testing.assert_allclose(m["itl_s"], [16 - 9, 18 - 16, 25 - 18])
    assert m["e2e_s"] == 24.0
    assert m["tpot_s"] == pytest.approx((25 - 9) / 6)
    # a row done at its prefill: one token, no step
    m = latency.request_latency(_timeline(), arrival=1.0, admit_start=4.0, admit_end=9.0, start_step=5,
                                trace=np.array([], int), num_tokens=1)
    assert (m["itl_s"], m["tpot_s"], m["e2e_s"]) == ([], 0.0, 8.0)


def test_the_summary_pools_every_step_of_every_request():
    ms = [{"ttft_s": 1.0, "itl_s": [0.1, 0.2]}, {"ttft_s": 3.0, "itl_s": [0.3]}]
    s = latency.latency_summary(ms)
    assert s["ttft_s"]["mean"] == 2.0 and s["ttft_s"]["max"] == 3.0
    assert s["itl_s"]["p50"] == pytest.approx(0.2)
    assert s["itl_s"]["p99"] == pytest.approx(np.percentile([0.1, 0.2, 0.3], 99))
    assert s["e2e_s"] == {}


def test_an_admit_stalls_exactly_the_rows_live_across_it(monkeypatch):
    """The clock stands still except inside an admit, which takes 1000 s. Two slots, one row
    per admit: A and B are admitted one after the other, B finishes first, C's admit runs
    while A is live. So A waits 1000 s before its first step (B's admit) and once more
    between two of its steps (C's), B and C never; queues and first tokens count every
    admit before a request's own."""
    clock = [0.0]
    real_admit = batch_mod.admit

    def slow_admit(*args):
        out = real_admit(*args)
        clock[0] += 1000.0
        return out

    monkeypatch.setattr(latency, "now", lambda: clock[0])
    monkeypatch.setattr(batch_mod, "admit", slow_admit)
    reqs = [Request([1, 2, 3], id="A", max_new_tokens=40), Request([4, 5], id="B", max_new_tokens=4),
            Request([6, 7, 8], id="C", max_new_tokens=4)]
    got = {c.id: c for c in batch_generate(MODEL, reqs, slots=2, refill_rows=1, drafter="ngram", depth=3, ngram_n=2)}
    a, b, c = (got[k].metrics for k in "ABC")
    assert (a["queue_s"], a["ttft_s"]) == (0.0, 1000.0)
    assert (b["queue_s"], b["ttft_s"], b["e2e_s"]) == (1000.0, 2000.0, 2000.0)
    assert (c["queue_s"], c["ttft_s"], c["e2e_s"]) == (2000.0, 3000.0, 3000.0)
    assert a["itl_s"][0] == 1000.0 and sorted(a["itl_s"])[-3:] == [0.0, 1000.0, 1000.0] and a["e2e_s"] == 3000.0
    assert b["itl_s"] == [0.0] * b["steps"] and c["itl_s"] == [0.0] * c["steps"]
    assert len(a["itl_s"]) == a["steps"] and a["tpot_s"] == pytest.approx(2000.0 / 39)
    assert got["A"].tokens == alone(MODEL, reqs[0], drafter="ngram", depth=3, ngram_n=2)  # timing changes nothing


def test_a_row_keeps_its_timeline_while_newer_rows_run_beside_it():
    """The timeline forgets only calls older than the oldest running row: A (admitted first)
    is still running when C finishes beside D (admitted later), and its figures need every
    call since its own admit."""
    reqs = [Request([1, 2, 3], id="A", max_new_tokens=40), Request([4, 5], id="B", max_new_tokens=4),
            Request([6, 7, 8], id="C", max_new_tokens=5), Request([9, 10], id="D", max_new_tokens=40),
            Request([11, 12], id="E", max_new_tokens=4)]  # E queued: C's round ends when C finishes
    done = list(batch_generate(MODEL, reqs, slots=3, refill_rows=1, drafter="ngram", depth=3, ngram_n=2))
    assert [c.id for c in done][:2] == ["B", "C"]  # A and D (admitted later) run on after C
    for c in done:
        m = c.metrics
        assert len(m["itl_s"]) == m["steps"] and m["ttft_s"] + sum(m["itl_s"]) == pytest.approx(m["e2e_s"])
