"""Per-token export (``lmmetrics score --per-token FILE``): columns written
chunk by chunk, so that files larger than RAM stream through, to a
temporary file renamed into place only when complete (no partial file is
ever left at the destination).

``.npz``: each column is written into a memory-mapped ``.npy`` of its final
length in a temporary folder, then the columns are stored (uncompressed)
into one zip, which ``numpy.load`` reads. ``.parquet`` (needs ``pyarrow``):
one row group a chunk."""
from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import numpy.typing as npt

from ._errors import InputError

FORMATS = (".npz", ".parquet")


def check_path(path: str) -> str:
    """The format of ``path`` by its suffix; InputError for another suffix,
    a missing pyarrow, or a folder that cannot be written."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise InputError(f"--per-token {path}: the file must end in .npz or .parquet")
    if suffix == ".parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise InputError("--per-token .parquet needs pyarrow (pip install pyarrow)") from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise InputError(f"--per-token {path}: cannot write into {folder}")
    if os.path.isdir(path):
        raise InputError(f"--per-token {path}: is a directory")
    return suffix


class TokenWriter:
    """Writes ``n_rows`` rows of the named columns (name, dtype) chunk by
    chunk; :meth:`close` renames the finished file into place, :meth:`abort`
    removes what was written."""

    def __init__(self, path: str, n_rows: int, columns: Sequence[tuple[str, Any]]) -> None:
        self.path = path
        self.suffix = check_path(path)
        self.n_rows = n_rows
        self.columns = [(name, np.dtype(dt)) for name, dt in columns]
        self.done = 0
        folder = os.path.dirname(os.path.abspath(path))
        self.tmp = tempfile.mkdtemp(prefix=".lmmetrics-", dir=folder)
        self._maps: Dict[str, Any] = {}
        self._pq: Optional[Any] = None
        if self.suffix == ".npz":
            for name, dt in self.columns:
                self._maps[name] = np.lib.format.open_memmap(os.path.join(self.tmp, name + ".npy"), mode="w+",
                                                             dtype=dt, shape=(n_rows,))

    def write(self, chunk: Dict[str, npt.NDArray[Any]]) -> None:
        n = len(next(iter(chunk.values()))) if chunk else 0
        if self.done + n > self.n_rows:
            raise RuntimeError("lmmetrics: internal error: more per-token rows than announced")
        if self.suffix == ".npz":
            for name, _ in self.columns:
                self._maps[name][self.done:self.done + n] = chunk[name]
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.table({name: np.asarray(chunk[name], dtype=dt) for name, dt in self.columns})
            if self._pq is None:
                self._pq = pq.ParquetWriter(os.path.join(self.tmp, "out.parquet"), table.schema)
            self._pq.write_table(table)
        self.done += n

    def close(self) -> None:
        if self.done != self.n_rows:
            raise RuntimeError("lmmetrics: internal error: fewer per-token rows than announced")
        part = os.path.join(self.tmp, "out" + self.suffix)
        if self.suffix == ".npz":
            names: List[str] = []
            for name, _ in self.columns:
                self._maps[name].flush()
                names.append(name)
            self._maps.clear()
            with zipfile.ZipFile(part, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                for name in names:
                    zf.write(os.path.join(self.tmp, name + ".npy"), name + ".npy")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            if self._pq is None:  # no row at all: an empty table with the columns
                schema = pa.schema([(name, pa.from_numpy_dtype(dt)) for name, dt in self.columns])
                self._pq = pq.ParquetWriter(part, schema)
            self._pq.close()
            self._pq = None
        os.replace(part, self.path)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def abort(self) -> None:
        self._maps.clear()
        if self._pq is not None:
            try:
                self._pq.close()
            except Exception:
                pass
            self._pq = None
        shutil.rmtree(self.tmp, ignore_errors=True)
