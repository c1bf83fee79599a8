"""`dkv_cache_hint`: which of a request's KV blocks the shared store already holds, so the engine fetches them before
prefill instead of recomputing them (MAX's distributed-KV hint).

The hint is a JSON object with one or both of:
  "block_hashes": ["<64 hex digits>", ...]   chain hashes (sha256) of blocks the store holds: the keys the engine
                                             computes for the prompt's full blocks (cache_salt and LoRA in the root)
  "num_cached_tokens": N                     the store holds the prompt's first N tokens (their whole blocks)
Any other key is refused by name. A hint is never trusted: only the hashes that are in the request's own hash chain
are fetched (others are ignored and counted), and a fetched block is used only if its blob checks out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

FIELD = "dkv_cache_hint"
KNOWN_KEYS = ("block_hashes", "num_cached_tokens")
MAX_HINT_HASHES = 8192  # a 128k-token context in 16-token blocks
HASH_HEX_CHARS = 64  # a sha256 chain hash
_HEX = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True)
class DkvHint:
    """A validated hint: the chain hashes it names (in its order, without repeats) and its token count."""

    block_keys: tuple[bytes, ...] = ()
    num_cached_tokens: int = 0

    def hinted_blocks(self, block_size: int) -> int:
        """The prompt's leading full blocks that num_cached_tokens covers."""
        return self.num_cached_tokens // block_size


def parse_dkv_cache_hint(value) -> DkvHint | None:
    """The hint as a DkvHint (None for None); ValueError naming dkv_cache_hint (and the key) for anything else."""
    if value is None:
        return None
    if isinstance(value, DkvHint):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{FIELD} must be an object (dict) or null, got {type(value).__name__}")
    unknown = [k for k in value if k not in KNOWN_KEYS]
    if unknown:
        raise ValueError(f"{FIELD} has unknown key(s) {unknown!r}; known: {list(KNOWN_KEYS)}")
    return DkvHint(_block_keys(value.get("block_hashes")), _num_cached_tokens(value.get("num_cached_tokens")))


def _block_keys(hashes) -> tuple[bytes, ...]:
    if hashes is None:
        return ()
    if not isinstance(hashes, (list, tuple)):
        raise ValueError(f"{FIELD}.block_hashes must be a list of hex strings, got {type(hashes).__name__}")
    if len(hashes) > MAX_HINT_HASHES:
        raise ValueError(f"{FIELD}.block_hashes has {len(hashes)} hashes; at most {MAX_HINT_HASHES} are accepted")
    keys = []
    for i, h in enumerate(hashes):
        if not isinstance(h, str) or not _HEX.fullmatch(h):
            shown = repr(h) if len(repr(h)) <= 80 else repr(h)[:77] + "..."
            raise ValueError(
                f"{FIELD}.block_hashes[{i}] must be a block's chain hash as {HASH_HEX_CHARS} hex digits, got {shown}"
            )
        keys.append(bytes.fromhex(h))
    return tuple(dict.fromkeys(keys))


def _num_cached_tokens(value) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{FIELD}.num_cached_tokens must be an integer >= 0, got {value!r}")
    return value


def plan_hinted_fetch(
    request_chain_hashes: Sequence[bytes], hinted_keys: Sequence[bytes], num_hinted_blocks: int = 0
) -> tuple[list[bytes], int]:
    """(keys to fetch from the store, hinted keys ignored): the hinted keys that are in the request's own chain
    (request_chain_hashes: its full prompt blocks' hashes, in order; the caller leaves out blocks it must compute),
    plus its first num_hinted_blocks hashes (a num_cached_tokens hint), in chain order without repeats. A hinted key
    outside the chain (another prompt, salt, adapter or model's block, or a made-up one) is never fetched: it is
    counted in num_ignored. The caller fetches the keys it does not already hold and uses blocks only up to the
    first one it neither holds nor fetched (a prefix cache needs every block before it)."""
    chain = list(request_chain_hashes)
    position = {key: i for i, key in enumerate(chain)}
    wanted = set(range(min(max(num_hinted_blocks, 0), len(chain))))
    num_ignored = 0
    for key in dict.fromkeys(hinted_keys):
        i = position.get(key)
        if i is None:
            num_ignored += 1
        else:
            wanted.add(i)
    return [chain[i] for i in sorted(wanted)], num_ignored
