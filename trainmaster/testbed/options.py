"""What a testbed is made of: typed options, validated once, the rate notation of ``tc``, and
where testbeds are recorded."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from trainmaster.errors import UserError
from trainmaster.store.db import home

MAX_HOSTS = 200  # host i has address .i of the testbed's /24; .254 is the switch
PREFIX_PATTERN = re.compile(r"^[a-z][a-z0-9]{0,9}$")  # short: namespace names stay readable
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)?\s*$", re.IGNORECASE)
_UNIT = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
UNCAPPED = ("none", "uncapped", "0", "")


def state_dir() -> Path:
    """Where testbeds are recorded (one ``<prefix>.json`` each) and their host agents keep state."""
    return home() / "testbed"


def parse_rate(text: str, option: str = "--link") -> int | None:
    """``"100mbit"`` -> 100_000_000 bits/s; ``"none"`` -> None (the link is not capped).

    Units are those of ``tc`` (bit, kbit, mbit, gbit; powers of ten), so what the user writes
    is what ``tc qdisc show`` prints back."""
    if text.strip().lower() in UNCAPPED:
        return None
    match = _RATE.match(text)
    if not match:
        raise UserError(f"{option}: {text!r} is not a rate; write e.g. 100mbit, 1gbit, 500kbit or none (uncapped)")
    bits = int(float(match.group(1)) * _UNIT[(match.group(2) or "bit").lower()])
    if bits < 8000:
        raise UserError(f"{option}: {text!r} is below 8kbit, too slow for any use; give a larger rate or none")
    return bits


def format_rate(bits: int | None) -> str:
    if bits is None:
        return "uncapped"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits >= _UNIT[unit] and bits % _UNIT[unit] == 0:
            return f"{bits // _UNIT[unit]}{unit}"
    return f"{bits}bit"


@dataclass(frozen=True)
class TestbedOptions:
    """One testbed: ``hosts`` hosts ``h1..hN`` and a switch host ``sw`` joined by capped links.

    ``link_rate`` caps each host's link in both directions (bits/s, None = uncapped);
    ``switch_link_rate`` caps what the switch host's own processes send, in total (a forwarding
    node's fan-out), None = only the per-link caps apply. ``prefix`` names every namespace
    (``<prefix>-h1``...), so testbeds of parallel tests or users never collide.
    """

    __test__ = False  # not a pytest test class despite the name

    hosts: int = 2
    link_rate: int | None = 1_000_000_000
    switch_link_rate: int | None = None
    mtu: int = 9000
    prefix: str = "tm"
    queue_ms: int = 200  # how long a burst may wait in a link's queue before it is dropped

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.hosts <= MAX_HOSTS:
            problems.append(f"--hosts must be between 1 and {MAX_HOSTS}, got {self.hosts}")
        if not 1280 <= self.mtu <= 65535:
            problems.append(f"--mtu must be between 1280 and 65535, got {self.mtu}")
        if not PREFIX_PATTERN.match(self.prefix):
            problems.append(
                f"--prefix must be 1-10 lowercase letters/digits starting with a letter, got {self.prefix!r}"
            )
        if not 1 <= self.queue_ms <= 10_000:
            problems.append(f"queue_ms must be between 1 and 10000, got {self.queue_ms}")
        for name, rate in (("--link", self.link_rate), ("--switch-link", self.switch_link_rate)):
            if rate is not None and rate < 8000:
                problems.append(f"{name} must be at least 8kbit")
        if problems:
            raise UserError("invalid testbed options", details=problems)
