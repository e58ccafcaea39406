"""How the cost benchmark writes a number into a Markdown cell: MiB, GFLOP, ms ranges, ratio ranges, op counts.

One place for the formats, so the tables (``tables``), the published sentences (``headlines``) and the loss
benchmark (``loss_shapes``) print a figure the same way; ``"–"`` stands for a figure not measured.
"""

from __future__ import annotations

from typing import Any, Optional

MIB = 2**20


def mib(nbytes: Optional[float]) -> str:
    """Bytes as MiB with one decimal."""
    return "–" if nbytes is None else f"{nbytes / MIB:,.1f}"


def gflop(flops: Optional[float]) -> str:
    """FLOPs as GFLOP with two decimals."""
    return "–" if flops is None else f"{flops / 1e9:,.2f}"


def number(value: Optional[float], digits: int = 3) -> str:
    """A plain ratio with ``digits`` decimals."""
    return "–" if value is None else f"{value:.{digits}f}"


def ms_range(t: Optional[dict[str, float]]) -> str:
    """Seconds as ``median (min–max)`` milliseconds."""
    if t is None:
        return "–"
    return f"{t['median'] * 1e3:,.0f} ({t['min'] * 1e3:,.0f}–{t['max'] * 1e3:,.0f})"


def ratio_range(r: Optional[dict[str, float]]) -> str:
    """A ratio over rounds as ``median (min–max)``."""
    if r is None:
        return "–"
    return f"{r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f})"


def load_range(load: Optional[dict[str, float]]) -> str:
    """The 1-minute load average over a shape's rounds as ``median (min–max)``."""
    return "–" if not load else f"{load['median']:.1f} ({load['min']:.1f}–{load['max']:.1f})"


def counted(counts: dict[str, Any], kind: str) -> str:
    """A micro-batch's count of ``kind`` (``"syncs"`` or ``"h2d"``) with the ops behind it."""
    if kind not in counts:
        return "–"
    ops = ", ".join(f"`{op.replace('aten::', '')}` × {n}" for op, n in sorted(counts[f"{kind}_by_op"].items()))
    return str(counts[kind]) + (f" ({ops})" if ops else "")


def x_stock(flops: float, goals: dict[str, Any]) -> str:
    """FLOPs as a multiple of stock's at the same shape (``goals["flops_stock"]``)."""
    return f"{flops / goals['flops_stock']:.4f} × stock"
