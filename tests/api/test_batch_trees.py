"""Token trees in batch jobs: refilled slots give every request exactly what it gets alone
(a fixed tree: the same tokens and accepted drafts; under depth="auto": the same tokens), for
every drafter on dense and paged caches, on a tight pool with chunked prefill in the step's
forward and shared prefix pages; a sampled request's tokens do not depend on its neighbours."""

import pytest
from batch_models import DRAFT, EOS, MODEL, alone_run, make_requests

from specjax import Request, batch_generate
from specjax.auto.policy import CostTable


@pytest.mark.parametrize("drafter,tree,cache", [
    ("mtp", (2, 2, 1), "dense"),
    ("mtp", "dynamic:6,2", "paged"),
    ("draft_model", "dynamic:6,2", "paged"),
    ("ngram", "dynamic:6,3", "dense"),
])
def test_tree_rows_equal_generate_alone(drafter, tree, cache):
    reqs = make_requests(7, seed=len(drafter) + len(cache))
    kw = dict(drafter=drafter, tree=tree, depth=3, cache=cache, eos_id=EOS, ngram_n=2,
              draft_model=DRAFT if drafter == "draft_model" else None)
    out = {c.id: c for c in batch_generate(MODEL, reqs, slots=3, refill_rows=2, **kw)}
    accepted = 0
    for r in reqs:
        alone = alone_run(MODEL, r, **kw)
        assert out[r.id].tokens == alone.tokens[0], r
        assert out[r.id].metrics["accepted_trace"] == alone.metrics["row_accepted_trace"][0], r
        accepted += out[r.id].metrics["accepted_drafts"]
    assert accepted > 0 or drafter == "mtp"  # (this model's random MTP block accepts nothing)


def test_tree_jobs_on_a_tight_pool_with_chunked_prefill_and_shared_prefixes():
    """Prompts sharing a 16-token page, prefilled 8 tokens a chunk inside the tree steps'
    forwards, on 9 pages where 3 slots' rows need 4 each: every request equals its alone run."""
    head = [1, 2, 3, 4, 6, 7, 8, 9] * 2
    reqs = [Request(prompt=head + [10 + i, 11], id=i, max_new_tokens=n) for i, n in enumerate([20, 6, 14, 9, 20])]
    kw = dict(drafter="draft_model", draft_model=DRAFT, tree="dynamic:6,2", depth=3, cache="paged")
    out = {c.id: c for c in batch_generate(MODEL, reqs, slots=3, pages=9, prefill_chunk=8, **kw)}
    for r in reqs:
        assert out[r.id].tokens == alone_run(MODEL, r, **kw).tokens[0], r
    assert sum(c.metrics["cached_tokens"] for c in out.values()) > 0  # later rows started on shared pages


def test_sampled_tree_requests_do_not_depend_on_their_neighbours():
    reqs = [Request(r.prompt, id=r.id, max_new_tokens=r.max_new_tokens, temperature=1.0) for r in make_requests(6, 41)]
    kw = dict(drafter="draft_model", draft_model=DRAFT, tree="dynamic:6,2", depth=3)
    a = {c.id: c.tokens for c in batch_generate(MODEL, reqs, slots=3, **kw)}
    b = {c.id: c.tokens for c in batch_generate(MODEL, reqs[::-1], slots=2, **kw)}
    assert a == b


def test_the_tree_budget_in_a_batch_job():
    """depth="auto" with a tree: the tree, a chain or plain decoding each step (goodput); the
    same tokens as plain decoding alone."""
    reqs = make_requests(6, seed=17)
    table = CostTable.create((1, 2, 3, 4, 7), [1, 64], [[1.0, 1.1, 1.2, 1.3, 1.3]] * 2)
    kw = dict(drafter="draft_model", draft_model=DRAFT, tree="dynamic:6,2", depth="auto", max_depth=3, eos_id=EOS)
    out = {c.id: c for c in batch_generate(MODEL, reqs, slots=3, cost=table, **kw)}
    for r in reqs:
        assert out[r.id].tokens == alone_run(MODEL, r, drafter=None, eos_id=EOS).tokens[0], r
    assert max(max(c.metrics["accepted_trace"]) for c in out.values()) > 0
