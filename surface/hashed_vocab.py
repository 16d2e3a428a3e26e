"""A vocabulary given by a hash: the GPU-free engine's token ids, computable anywhere.

The GPU-free engine (workers.sim.tokenizer) splits text into word-level pieces and names
each piece by a hash of its text, so its ids need no vocabulary file. A gateway that
places rounds by the engines' prefix caches (gateway.engines.kv_index) hashes a prompt's
blocks from the same ids the engine hashed them from; the engine's published tokenizer
files split where the engine does, and say, under :data:`CONFIG_KEY`, that a piece's id
is :func:`piece_id` of its text - so the gateway computes the engine's ids with this
function alone, not with the engine's code.
"""

from __future__ import annotations

import hashlib

FIRST_ORDINARY_ID = 256  # ids below are the special tokens' (and reserved)
CONFIG_KEY = "ampd_hashed_vocab_size"  # in a model's tokenizer config: its ids are piece_id(piece, size)


def piece_id(piece: str, vocab_size: int) -> int:
    """The id of an ordinary (not special) piece of text in a vocabulary of ``vocab_size``."""
    digest = hashlib.blake2b(piece.encode(), digest_size=8).digest()
    return FIRST_ORDINARY_ID + int.from_bytes(digest, "little") % (vocab_size - FIRST_ORDINARY_ID)
