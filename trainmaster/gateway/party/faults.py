"""Fault injection for the tests (``fault_stream`` in a party's config; off by default)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


async def corrupt(frames: AsyncIterator[bytes], mode: str) -> AsyncIterator[bytes]:
    """Drop the last chunk, swap the first two, flip a bit, or send slowly (a pause before every
    chunk: a party on a slow link)."""
    held: list[bytes] = []
    index = -1
    async for f in frames:
        index += 1
        if mode == "slow" and index:
            await asyncio.sleep(0.1)
        if mode == "reorder" and index == 1:
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
        if mode == "reorder" and held and index == 2:
            yield held.pop()
