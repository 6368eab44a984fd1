"""Continuous batching: a fixed set of slots, refilled from a request stream as rows finish.

The per-sequence rule is what makes this possible inside ``jit``: every row already has its
own cache lengths, pages, drafter state and sampling settings, so a finished row's slot can
take a new prompt without touching its neighbours. The loop, per round:

1. **admit** (jitted, one compile per (slots, rows, prompt bucket); rows: the requests
   admitted, rounded up to a power of two): up to ``refill_rows`` queued requests of one
   prompt bucket are prefilled into empty per-row views of the live caches
   (a paged view shares the pool) and scattered into free slots: lengths, lead pad, pages,
   MTP hidden state, seeds and sampling settings all per row. Pages of idle slots return to
   the pool first.
2. **decode** (jitted, one compile per slots): ``step`` in a ``while_loop`` until enough rows
   finished to refill (or ``sync_every`` steps, or every row is done). No host sync inside.
3. **harvest** (one device read): finished rows become ``Completion``s, yielded in
   completion order; their slots are free. The host clock at these boundaries gives each
   request its latency (queue wait, time to first token, inter-token; ``specjax.latency``).

Per-request sampling settings are data (``RowSampling``), never compile-time constants.
A request's seed is its own (explicit) or derived from (``seed``, request id): never from
its slot, so a seeded request gives the same tokens alone, in any batch, in any slot.

Paged pools are sized by ``pages`` (default: every slot's full capacity). A request is
admitted only when its worst-case page need fits beside the worst cases of the running
rows; otherwise it waits for a row to finish (no request fails for lack of pages).

On a mesh the slots split into one group per data shard, each with its own paged pool
(``pages / data`` pages: ``PagedKVCache.split_pool``). An admit fills up to
``ceil(refill_rows / data)`` slots of every group (group-major, so each shard prefills and
allocates only for its own slots); a request goes to the group with the most free slots
among those whose pool fits its worst case.
"""

from specjax.batch.job import batch_generate
from specjax.batch.requests import Completion, Request

__all__ = ["Completion", "Request", "batch_generate"]
