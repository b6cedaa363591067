"""Figures through matplotlib's object-oriented API only (no pyplot, no global backend), and
the one colour scheme of the method plots: a colour per base method, RESA hatched in it."""
from __future__ import annotations

from pathlib import Path

from sparsejax.files import write_atomic

RESA_SUFFIX = "+resa"


def figure(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float], **subplots):
    """-> (Figure, axes [nrows, ncols]) drawn by Agg, whatever backend pyplot uses;
    `subplots` go to `Figure.subplots` (e.g. gridspec_kw)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False, **subplots)


def save(fig, path: str | Path, dpi: int = 120) -> Path:
    """Write the figure as PNG, atomically."""
    fig.tight_layout()
    return write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))


def method_style(name: str, bases: list[str]) -> dict:
    """Colour of the base method (its index in `bases`); RESA variants hatched / dashed."""
    from matplotlib import colormaps

    base = name.removesuffix(RESA_SUFFIX)
    colour = colormaps["tab20" if len(bases) > 10 else "tab10"](bases.index(base))
    return {"color": colour, "resa": name.endswith(RESA_SUFFIX)}
