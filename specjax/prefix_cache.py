"""The prefix cache's host side: which pages of a paged pool hold which prompt prefixes.

A prompt's full pages are named by chain keys: page ``i``'s key is a hash of page ``i - 1``'s
key and page ``i``'s tokens, so one key names a page's tokens *and* every token before them
(two prompts share page ``i``'s key only if they agree up to its end). A request reuses the
longest run of its keys found in the map: its rows start on those pages
(``PagedKVCache.rows_view(shared=...)``) and compute only the rest of the prompt; the last
prompt token is always computed (its logits give the first new token).

The device owns the pages (``PagedKVCache``: reference counts, and ``cached`` pages kept deep in
the free stack, evicted least recently released first). The host map only names them: it is
told which pages an admit wrote (``add``), and before each lookup it forgets the pages the
device has since evicted (``forget``, from the pools' ``cached`` flags). A job with several
pools (the target's and a draft model's) keeps one page per pool under each key: a key
stays only while every pool still holds its page.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["PrefixCache", "page_keys"]


def page_keys(prompt: Sequence[int], page_size: int, ahead: int = 0) -> list[bytes]:
    """The chain keys of ``prompt``'s full pages (``(len(prompt) - ahead) // page_size`` of
    them). ``ahead``: each key also covers that many tokens past its page (an MTP block's
    entry at a position reads the next token: its last one on a page reads the next page's
    first), so two prompts share a page only if they agree that far too."""
    keys, prev = [], b""
    arr = np.asarray(prompt, np.int64)
    for i in range((len(arr) - ahead) // page_size):
        prev = hashlib.sha256(prev + arr[i * page_size : (i + 1) * page_size + ahead].tobytes()).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    """Chain key -> one page id per pool, one map per pool group (``PagedKVCache.split_pool``:
    ids are group-local), and the tokens each lookup served (``hit_rate``)."""

    def __init__(self, page_size: int, groups: int = 1, pools: int = 1):
        self.page_size, self.pools = page_size, pools
        self._page: list[dict[bytes, tuple[int, ...]]] = [{} for _ in range(groups)]  # key -> page per pool
        self._key: list[list[dict[int, bytes]]] = [[{} for _ in range(pools)] for _ in range(groups)]  # page -> key
        self.prompt_tokens = 0  # prompt tokens of admitted requests
        self.cached_tokens = 0  # of which served from cached pages

    def match(self, keys: Sequence[bytes], prompt_len: int, group: int = 0) -> list[tuple[int, ...]]:
        """The pages (one per pool each) of the longest run of ``keys`` in the map (from the
        first), leaving at least the prompt's last token to compute."""
        out, table = [], self._page[group]
        for key in keys[: (prompt_len - 1) // self.page_size]:
            page = table.get(key)
            if page is None:
                break
            out.append(page)
        return out

    def count(self, prompt_len: int, shared: int) -> None:
        """An admitted request: ``prompt_len`` tokens, ``shared`` pages of them cached."""
        self.prompt_tokens += prompt_len
        self.cached_tokens += shared * self.page_size

    def add(self, keys: Sequence[bytes], pages: np.ndarray, group: int = 0) -> None:
        """Key ``keys[i]`` now names pages ``pages[i] [pools]`` (a page's earlier key is dropped)."""
        for key, ids in zip(keys, np.asarray(pages, np.int64).reshape(len(keys), self.pools).tolist(), strict=True):
            self._drop(self._page[group].get(key, ()), group)
            for pool, page in enumerate(ids):
                self._drop_key(self._key[group][pool].get(page), group)
            self._page[group][key] = tuple(ids)
            for pool, page in enumerate(ids):
                self._key[group][pool][page] = key

    def _drop(self, ids: Sequence[int], group: int) -> None:
        for pool, page in enumerate(ids):
            self._key[group][pool].pop(page, None)

    def _drop_key(self, key: bytes | None, group: int) -> None:
        if key is not None:
            self._drop(self._page[group].pop(key, ()), group)

    def forget(self, cached: Sequence[np.ndarray]) -> None:
        """Drop the keys whose page some pool no longer holds as cached (``cached``: each
        pool's ``[groups * pages]`` flags; a popped page was evicted)."""
        for pool, flags in enumerate(cached):
            flags = np.asarray(flags, bool).reshape(len(self._page), -1)
            for g in range(len(self._page)):
                for page in [p for p in self._key[g][pool] if not flags[g, p]]:
                    self._drop_key(self._key[g][pool].get(page), g)

    @property
    def size(self) -> int:
        """Keys held (full prompt pages named), over all groups."""
        return sum(len(t) for t in self._page)

    @property
    def hit_rate(self) -> float:
        """The share of admitted prompt tokens served from cached pages."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
