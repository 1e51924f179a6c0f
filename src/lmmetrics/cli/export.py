"""Per-token export (``lmmetrics score --per-token FILE``): columns written
chunk by chunk, so that files larger than RAM stream through, to a
temporary file renamed into place only when complete (no partial file is
ever left at the destination).

``.npz``: each column is appended to a raw file in a temporary folder, then
each is stored (uncompressed) into one zip behind its ``.npy`` header, which
``numpy.load`` reads. ``.parquet`` (needs ``pyarrow``):
one row group a chunk."""
from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from typing import Any, BinaryIO, Dict, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from .errors import InputError

FORMATS = (".npz", ".parquet")


def check_output(option: str, path: str, suffixes: Sequence[str], package: Optional[str] = None,
                 inputs: Sequence[str] = ()) -> str:
    """The suffix of an output file ``path`` given to ``option``;
    InputError for another suffix, a ``package`` that does not import, a
    folder that cannot be written, a directory, or one of the ``inputs``
    (it would be replaced)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in suffixes:
        raise InputError(f"{option} {path}: the file must end in {' or '.join(suffixes)}")
    if package is not None:
        try:
            __import__(package)
        except ImportError:
            raise InputError(f"{option} {suffix} needs {package} (pip install {package})") from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise InputError(f"{option} {path}: cannot write into {folder}")
    try:  # (the file is made at the end of the run: a name too long would fail only then)
        longest = os.pathconf(folder, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):  # (no pathconf: Windows)
        longest = None
    if longest is not None and len(os.fsencode(os.path.basename(path))) > longest:
        raise InputError(f"{option} {path}: the file name is longer than {longest} bytes, the most {folder} takes")
    if os.path.isdir(path):
        raise InputError(f"{option} {path}: is a directory")
    if os.path.exists(path) and any(os.path.exists(p) and os.path.samefile(path, p) for p in inputs):
        raise InputError(f"{option} {path}: is one of the input files, which the output would replace")
    return suffix


def check_path(path: str, inputs: Sequence[str] = ()) -> str:
    """The format of a --per-token file by its suffix (see `check_output`)."""
    parquet = os.path.splitext(path)[1].lower() == ".parquet"
    return check_output("--per-token", path, FORMATS, "pyarrow" if parquet else None, inputs)


class TokenWriter:
    """Writes rows of the named columns (name, dtype) chunk by chunk;
    `close` renames the finished file into place, `abort`
    removes what was written."""

    def __init__(self, path: str, columns: Sequence[Tuple[str, Any]]) -> None:
        self.path = path
        self.suffix = check_path(path)
        self.columns = [(name, np.dtype(dt)) for name, dt in columns]
        self.rows = 0
        folder = os.path.dirname(os.path.abspath(path))
        self.tmp = tempfile.mkdtemp(prefix=".lmmetrics-", dir=folder)
        self._raw: Dict[str, BinaryIO] = {}
        self._pq: Optional[Any] = None
        if self.suffix == ".npz":
            for name, _ in self.columns:
                self._raw[name] = open(os.path.join(self.tmp, name + ".raw"), "wb")

    def write(self, chunk: Dict[str, npt.NDArray[Any]]) -> None:
        """Append rows: one array per column, all of one length."""
        if self.suffix == ".npz":
            for name, dt in self.columns:
                self._raw[name].write(np.ascontiguousarray(chunk[name], dtype=dt).tobytes())
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.table({name: np.asarray(chunk[name], dtype=dt) for name, dt in self.columns})
            if self._pq is None:
                self._pq = pq.ParquetWriter(os.path.join(self.tmp, "out.parquet"), table.schema)
            self._pq.write_table(table)
        self.rows += len(chunk[self.columns[0][0]])

    def close(self) -> None:
        """Finish the file and rename it into place."""
        part = os.path.join(self.tmp, "out" + self.suffix)
        if self.suffix == ".npz":
            with zipfile.ZipFile(part, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                for name, dt in self.columns:
                    self._raw.pop(name).close()
                    with zf.open(name + ".npy", "w", force_zip64=True) as member, \
                            open(os.path.join(self.tmp, name + ".raw"), "rb") as raw:
                        np.lib.format.write_array_header_1_0(
                            member, {"descr": np.lib.format.dtype_to_descr(dt), "fortran_order": False,
                                     "shape": (self.rows,)})
                        shutil.copyfileobj(raw, member, 1 << 24)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            if self._pq is None:  # no row at all: an empty table with the columns
                schema = pa.schema([(name, pa.from_numpy_dtype(dt)) for name, dt in self.columns])
                self._pq = pq.ParquetWriter(os.path.join(self.tmp, "out.parquet"), schema)
            self._pq.close()
            self._pq = None
        os.replace(part, self.path)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def abort(self) -> None:
        """Remove what was written (the destination is untouched)."""
        for f in self._raw.values():
            f.close()
        self._raw.clear()
        if self._pq is not None:
            try:
                self._pq.close()
            except Exception:
                pass
            self._pq = None
        shutil.rmtree(self.tmp, ignore_errors=True)
