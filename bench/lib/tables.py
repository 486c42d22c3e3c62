"""The benchmarks page's building blocks: tables, sections and how figures are written in them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Table:
    """One markdown table: a header, rows of cells (already formatted), and a line under it."""
    header: tuple[str, ...]
    rows: list[tuple[str, ...]]
    note: str = ""


@dataclass(frozen=True)
class Page:
    """A bench's section: its title, what it measures (1-3 lines), and its tables."""
    title: str
    intro: str
    tables: Callable[[dict], list[Table]]


def verdict(met: bool | None) -> str:
    """``met``, ``**not met**``, or nothing (no target, or not decided)."""
    return "" if met is None else "met" if met else "**not met**"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def mib(nbytes: int) -> str:
    x = nbytes / 2**20
    return f"{x:,.0f} MiB" if x >= 10 else f"{x:.1f} MiB"


def pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f} %"


# -- store ----------------------------------------------------------------------
