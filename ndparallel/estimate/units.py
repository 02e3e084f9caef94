"""Units of the planner's inputs: sizes, bandwidths and counts as people write them (``80GiB``, ``450GB/s``,
``989T``), parsed into plain SI numbers (bytes, bytes/s, FLOP/s) so the formulas of docs/planning.md read
without conversions."""

from __future__ import annotations

import re

from ndparallel.errors import ConfigError

__all__ = ["GiB", "parse_bandwidth", "parse_bytes", "parse_count"]

GiB = 1024**3

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12, "p": 10**15}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: str | float, name: str = "memory") -> float:
    """``"80GiB"`` -> 85899345920, ``"80GB"`` -> 8e10, ``"141G"`` (binary) or a plain number of bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = _NUMBER.match(str(value))
        if not match or match.group(2).lower() not in _BYTE_UNITS:
            raise ConfigError(
                f"{name}={value!r} is not a size: use a number with a unit, e.g. 80GiB, 80GB, 141G or 512MiB"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    result = number * _BYTE_UNITS[unit]
    if result <= 0:
        raise ConfigError(f"{name}={value!r} must be positive")
    return result


def parse_bandwidth(value: str | float, name: str = "bandwidth") -> float:
    """Bytes per second: ``"450GB/s"``, ``"50GB"``, ``"400Gbit/s"`` (bits are divided by 8) or a number."""
    text = str(value).strip()
    bits = bool(re.search(r"(?i:bit)|bps$", text))  # "Gbps" / "Gbit/s" are bits; "GBps" / "GB/s" bytes
    text = re.sub(r"(?i)(/s|ps|it)$", "", text)
    text = re.sub(r"(?i)(bit|b)$", "b", text) if bits else text
    return parse_bytes(text, name) / (8 if bits else 1)


def parse_count(value: str | float, name: str) -> float:
    """``"989T"`` -> 9.89e14, ``"8b"`` -> 8e9 (decimal prefixes) or a plain number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    else:
        match = _NUMBER.match(str(value).replace("FLOP/s", "").replace("flops", ""))
        if not match or match.group(2).lower() not in _COUNT_UNITS:
            raise ConfigError(f"{name}={value!r} is not a number: use e.g. 989e12 or 989T")
        result = float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()]
    if result <= 0:
        raise ConfigError(f"{name}={value!r} must be positive")
    return result
