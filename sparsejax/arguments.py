"""Value types for argparse flags, shared by the command line and the jobs it runs: a bad
value is an argparse error naming the flag."""
from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number >= 0")
    return value


KV_DTYPE_CHOICES = ("auto", "bf16", "f32", "fp8")
KV_DTYPE_HELP = ("what the KV cache stores: auto (the compute dtype), bf16, f32, or fp8 "
                 "(float8_e4m3fn with a scale per token and KV head: half bf16's bytes)")


def ratio(text: str) -> float:
    value = nonnegative_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a share of the context in (0, 1]")
    return value


def ratio_list(text: str) -> list[float]:
    """'0.1,0.25' -> [0.1, 0.25]."""
    return [ratio(t) for t in _items(text)]


def token_list(text: str) -> list[int]:
    """'128,512' -> [128, 512]."""
    return [positive_int(t) for t in _items(text)]


def _items(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated values")
    return items
