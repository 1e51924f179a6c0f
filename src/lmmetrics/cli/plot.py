"""``lmmetrics score --plot FILE.png``: the mean NLL at each position of the
sequence and the calibration (reliability) curve, side by side, drawn with
matplotlib (optional; Agg, no screen) into a temporary file renamed into
place, its mode set by the umask."""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Optional, Sequence

import numpy as np
import numpy.typing as npt

from .export import check_output

#: the figure's size in pixels (width, height): 2 panels
SIZE = (1200, 450)
_DPI = 100


def check_path(path: str, inputs: Sequence[str] = ()) -> None:
    """InputError unless ``path`` ends in .png, matplotlib imports, its
    folder can be written and it is none of the ``inputs``."""
    check_output("--plot", path, (".png",), "matplotlib", inputs)


def plot(path: str, position_nll: npt.NDArray[np.float64], position_count: npt.NDArray[np.float64],
         calibration: Optional[Any] = None, title: str = "") -> None:
    """Draw the per-position mean NLL (nats; positions with no counted token
    left out) and, given a `lmmetrics.ranking.Calibration` (``edges``,
    ``confidence``, ``accuracy``, ``counts``, ``ece``), the reliability
    diagram. With no counted token at all both panels are drawn empty,
    titled so."""
    check_path(path)
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(SIZE[0] / _DPI, SIZE[1] / _DPI), dpi=_DPI)
    ax, cal = fig.subplots(1, 2)
    pos = np.flatnonzero(position_count > 0)
    ax.plot(pos, position_nll[pos] / position_count[pos], lw=1)
    ax.set_xlabel("position in the sequence")
    ax.set_ylabel("mean NLL (nats)")
    ax.set_title("NLL by position" if pos.size else "NLL by position: no counted token")
    ax.grid(alpha=0.3)
    cal.plot([0, 1], [0, 1], color="gray", lw=1, ls="--", label="calibrated")
    if calibration is not None and np.asarray(calibration.counts).sum() > 0:
        filled = np.asarray(calibration.counts) > 0
        edges = np.asarray(calibration.edges)
        mids = 0.5 * (edges[:-1] + edges[1:])
        width = float(np.diff(edges).max())
        cal.bar(mids[filled], np.asarray(calibration.accuracy)[filled], width=width * 0.9, alpha=0.6,
                label="top-1 accuracy")
        cal.plot(np.asarray(calibration.confidence)[filled], np.asarray(calibration.accuracy)[filled], "o-",
                 ms=3, lw=1, label="accuracy at mean confidence")
        cal.set_title(f"calibration (ECE {calibration.ece:.4f})")
    else:
        cal.set_title("calibration: no counted token")
    cal.set_xlim(0, 1)
    cal.set_ylim(0, 1)
    cal.set_xlabel("confidence (top token's probability)")
    cal.set_ylabel("accuracy")
    cal.legend(loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    # a file created by open() in a private temporary folder, so that its mode follows the umask as every
    # other output's does (mkstemp's file would stay 0600), renamed into place when complete
    tmp = tempfile.mkdtemp(prefix=".lmmetrics-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        part = os.path.join(tmp, "plot.png")
        with open(part, "wb") as f:
            fig.savefig(f, format="png", dpi=_DPI)
        os.replace(part, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
