"""Fault injection for the tests (``fault_stream`` in a party's config; off by default)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator


def corrupt(frames: Iterable[bytes | memoryview], mode: str) -> Iterator[bytes]:
    """Drop the last chunk, swap the first two, flip a bit, or send slowly (a pause before every
    chunk: a party on a slow link). Frames are copied: the sender reuses its buffer."""
    held: list[bytes] = []
    for index, view in enumerate(frames):
        f = bytes(view)
        if mode == "slow" and index:
            time.sleep(0.1)
        if mode == "reorder" and index == 0:
            held.append(f)
            continue
        if mode == "flip" and index == 1:
            f = f[:-1] + bytes([f[-1] ^ 1])
        if mode == "truncate":
            if held:
                yield held.pop()
            held.append(f)
            continue
        yield f
        if mode == "reorder" and held and index == 1:
            yield held.pop()
    if mode == "reorder":
        yield from held
