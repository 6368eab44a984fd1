"""Byte-level tokenizer: ids 0..255 are the bytes themselves, then three specials.

``decode(encode(s)) == s`` for every ``str`` (UTF-8, ``surrogateescape`` for text that
came from undecodable bytes); specials never appear in ``encode`` output.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "VOCAB_SIZE", "ByteTokenizer"]

PAD_ID = 256
BOS_ID = 257  # starts every document in the corpus and every prompt
EOS_ID = 258  # ends every document in the corpus
VOCAB_SIZE = 259


class ByteTokenizer:
    """UTF-8 bytes as token ids. ``bos``/``eos`` wrap a document when asked."""

    vocab_size = VOCAB_SIZE
    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID
    chat_template = None  # bytes have no chat format (``generate_text(chat=True)`` refuses it)

    def encode(self, text: str | bytes, *, bos: bool = False, eos: bool = False) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape")
        return ([BOS_ID] if bos else []) + list(data) + ([EOS_ID] if eos else [])

    def encode_array(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, np.uint8).astype(np.int32)

    def decode_bytes(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> bytes:
        """Bytes of ``ids`` (specials dropped; stops at the first EOS if asked)."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if i == EOS_ID and stop_at_eos:
                break
            if not 0 <= i < VOCAB_SIZE:
                raise ValueError(f"token id {i} is outside the byte vocabulary [0, {VOCAB_SIZE})")
            if i < 256:
                out.append(i)
        return bytes(out)

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 (a cut multi-byte char) round-trips via surrogateescape."""
        return self.decode_bytes(ids, stop_at_eos=stop_at_eos).decode("utf-8", "surrogateescape")
