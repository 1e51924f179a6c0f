"""Malformed inputs to the real ``lmmetrics`` console script: every one is a
single line on stderr and exit code 2, promptly; and the safetensors reader
accepts exactly the files the ``safetensors`` package accepts."""
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import lmmetrics
from lmmetrics.cli import files as _files

SCRIPT = shutil.which("lmmetrics", path=os.path.dirname(sys.executable)) or shutil.which("lmmetrics")
CMD = [SCRIPT] if SCRIPT else [sys.executable, "-m", "lmmetrics"]
TIMEOUT = 60


def run(*args, timeout=TIMEOUT, **kw):
    return subprocess.run(CMD + [str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)


def assert_one_line_error(res, command):
    err = res.stderr
    assert res.returncode == 2, (res.returncode, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith(f"lmmetrics {command}: error: "), err


# ---------------------------------------------------------------------------
# The safetensors zoo: (id, file bytes, valid by the format's specification).

def st(header, data=b"", n=None):
    """A safetensors file: u64 little-endian header length (``n`` to lie
    about it), the header (a dict as JSON, or the exact str / bytes), data."""
    if isinstance(header, bytes):
        hb = header
    elif isinstance(header, str):
        hb = header.encode("utf-8", "surrogatepass")
    else:
        hb = json.dumps(header).encode()
    return struct.pack("<Q", len(hb) if n is None else n) + hb + data


A = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5   # 24 bytes
B = np.array([7, -3], np.int64)                           # 16 bytes
AB = A.tobytes() + B.tobytes()
GOOD = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "I64", "shape": [2], "data_offsets": [24, 40]}}


def good(**changes):
    """GOOD with entries replaced (None deletes one)."""
    h = {k: dict(v) for k, v in GOOD.items()}
    for k, v in changes.items():
        if v is None:
            del h[k]
        else:
            h[k] = v
    return h


def info(dtype="F32", shape=(2, 3), offsets=(0, 24), **extra):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets), **extra}


T = '"dtype":"U8","shape":[2],"data_offsets":[0,2]'   # a 2-byte tensor, as JSON text
U8 = b"\x01\x02"
deep = lambda depth: '{"a":{%s,"x":%s}}' % (T, "[" * (depth - 2) + "]" * (depth - 2))  # noqa: E731
rng = np.random.default_rng(0)
BF = rng.integers(0, 2 ** 16, 6, dtype=np.uint16).tobytes()
HALF = np.array([1.5, -2.0, 65504.0], np.float16).tobytes()

ZOO = [
    # valid files
    ("valid", st(GOOD, AB), True),
    ("valid_offsets_out_of_name_order", st({"b": info("F32", (2, 3), (16, 40)), "a": info("I64", (2,), (0, 16))},
                                           B.tobytes() + A.tobytes()), True),
    ("valid_metadata", st({"__metadata__": {"format": "np", "k": ""}, **GOOD}, AB), True),
    ("valid_metadata_null", st({"__metadata__": None, **GOOD}, AB), True),
    ("valid_header_padded", st(json.dumps(GOOD) + " " * 7, AB), True),
    ("valid_empty_tensors", st({"e": info("F32", (0, 3), (0, 0)), "f": info("U8", (5, 0), (0, 0)),
                                "g": info("I8", (2,), (0, 2))}, b"\x05\xfb"), True),
    ("valid_no_tensors", st({}), True),
    ("valid_scalar", st({"s": info("F64", (), (0, 8))}, np.float64(3.25).tobytes()), True),
    ("valid_bf16_f16_bool_c64", st({"w": info("BF16", (2, 3), (0, 12)), "h": info("F16", (3,), (12, 18)),
                                    "m": info("BOOL", (2,), (18, 20)), "c": info("C64", (1,), (20, 28))},
                                   BF + HALF + b"\x01\x00" + np.complex64(1 - 2j).tobytes()), True),
    ("valid_f8_u16_u32_u64_i16_i32", st({"f": info("F8_E4M3", (2,), (0, 2)), "u": info("U16", (1,), (2, 4)),
                                         "v": info("U32", (1,), (4, 8)), "x": info("U64", (1,), (8, 16)),
                                         "i": info("I16", (1,), (16, 18)), "j": info("I32", (1,), (18, 22))},
                                        bytes(range(22))), True),
    ("valid_info_as_list", st('{"a":["U8",[2],[0,2]]}', U8), True),
    ("valid_dtype_as_map", st('{"a":{"dtype":{"U8":null},"shape":[2],"data_offsets":[0,2]}}', U8), True),
    ("valid_extra_fields", st('{"a":{%s,"x":[1,{"y":null}],"__metadata__":3}}' % T, U8), True),
    ("valid_duplicate_name_last_wins", st('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{%s}}' % T, U8),
     True),
    ("valid_duplicate_metadata_key", st('{"__metadata__":{"k":"1","k":"2"},"a":{%s}}' % T, U8), True),
    ("valid_escaped_names", st('{"__metad\\u0061ta__":{"k":"v"},"\\ud83d\\ude00\\n":{%s}}' % T, U8), True),
    ("valid_nested_127", st(deep(127), U8), True),
    ("valid_f4_even", st({"q": info("F4", (4,), (0, 2))}, U8), True),
    # the header length
    ("empty_file", b"", False),
    ("shorter_than_length", b"\x10\x00\x00", False),
    ("length_only", struct.pack("<Q", 0), False),
    ("length_2_40", st(GOOD, AB, n=2 ** 40), False),
    ("length_2_63", st(GOOD, AB, n=2 ** 63), False),
    ("length_2_64_minus_1", st(GOOD, AB, n=2 ** 64 - 1), False),
    ("length_above_bound", st(GOOD, AB, n=100_000_001), False),
    ("length_past_end", st(GOOD, b"", n=len(json.dumps(GOOD)) + 1), False),
    ("length_cuts_json", st(GOOD, AB, n=len(json.dumps(GOOD)) - 1), False),
    ("length_too_long_by_one", st(GOOD, AB, n=len(json.dumps(GOOD)) + 1), False),
    # the JSON
    ("header_list", st([], b""), False),
    ("header_null", st("null"), False),
    ("header_number", st("3"), False),
    ("header_nested_5000", st("[" * 5000 + "]" * 5000), False),
    ("header_objects_nested_5000", st('{"a":' * 5000 + "1" + "}" * 5000), False),
    ("nested_128", st(deep(128), U8), False),
    ("bad_utf8", st(b'{"a\xff":{' + T.encode() + b"}}", U8), False),
    ("utf8_bom", st("\ufeff" + json.dumps(GOOD), AB), False),
    ("utf16", st(json.dumps(GOOD).encode("utf-16-le"), AB), False),
    ("trailing_comma", st('{"a":{%s},}' % T, U8), False),
    ("trailing_garbage_in_header", st('{"a":{%s}}x' % T, U8), False),
    ("control_char_in_name", st('{"a\x01":{%s}}' % T, U8), False),
    ("nan_in_extra_field", st('{"a":{%s,"x":NaN}}' % T, U8), False),
    ("number_out_of_range", st('{"a":{%s,"x":1e400}}' % T, U8), False),
    ("long_integer_out_of_range", st('{"a":{%s,"x":%s}}' % (T, "9" * 400), U8), False),
    ("lone_surrogate_name", st('{"\\ud800":{%s}}' % T, U8), False),
    ("lone_surrogate_extra", st('{"a":{%s,"x":"\\udc00"}}' % T, U8), False),
    ("duplicate_metadata", st('{"__metadata__":{},"__metadata__":{},"a":{%s}}' % T, U8), False),
    ("duplicate_dtype_field", st('{"a":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}}', U8), False),
    ("duplicate_name_first_needed", st('{"a":{%s},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}' % T, U8),
     False),
    # the tensor entries
    ("info_string", st(good(b="I64")), False),
    ("info_number", st(good(b=3), AB), False),
    ("info_list_short", st('{"a":["U8",[2]]}', U8), False),
    ("info_list_long", st('{"a":["U8",[2],[0,2],0]}', U8), False),
    ("no_data_offsets", st(good(b={"dtype": "I64", "shape": [2]}), AB), False),
    ("no_dtype", st(good(b={"shape": [2], "data_offsets": [24, 40]}), AB), False),
    ("no_shape", st(good(b={"dtype": "I64", "data_offsets": [24, 40]}), AB), False),
    ("unknown_dtype", st(good(b=info("F128", (2,), (24, 40))), AB), False),
    ("lowercase_dtype", st(good(b=info("i64", (2,), (24, 40))), AB), False),
    ("dtype_null", st(good(b=info(None, (2,), (24, 40))), AB), False),
    ("dtype_map_with_value", st('{"a":{"dtype":{"U8":[]},"shape":[2],"data_offsets":[0,2]}}', U8), False),
    ("shape_negative", st(good(b=info("I64", (-2,), (24, 40))), AB), False),
    ("shape_minus_zero", st('{"a":{"dtype":"U8","shape":[-0,2],"data_offsets":[0,0]}}'), False),
    ("shape_bool", st(good(b=info("I64", (True, 2), (24, 40))), AB), False),
    ("shape_float", st(good(b=info("I64", (2.0,), (24, 40))), AB), False),
    ("shape_string", st(good(b=info("I64", ("2",), (24, 40))), AB), False),
    ("shape_null", st(good(b={"dtype": "I64", "shape": None, "data_offsets": [24, 40]}), AB), False),
    ("shape_2_64", st('{"a":{"dtype":"U8","shape":[18446744073709551616,0],"data_offsets":[0,0]}}'), False),
    ("shape_product_overflows", st('{"a":{"dtype":"U8","shape":[9223372036854775808,2,0],"data_offsets":[0,0]}}'),
     False),
    ("shape_bits_overflow", st(good(b=info("F32", (2 ** 62,), (24, 24))), A.tobytes()), False),
    ("offsets_negative", st(good(b=info("I64", (2,), (-16, 0))), AB), False),
    ("offsets_three", st(good(b=info("I64", (2,), (24, 40, 40))), AB), False),
    ("offsets_one", st(good(b=info("I64", (2,), (24,))), AB), False),
    ("offsets_float", st(good(b=info("I64", (2,), (24, 40.0))), AB), False),
    ("offsets_2_64", st('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,18446744073709551616]}}', U8), False),
    ("offsets_reversed", st(good(b=info("I64", (2,), (40, 24))), AB), False),
    ("zero_offsets_huge_shape", st(good(b=info("F32", (2 ** 40,), (24, 24))), A.tobytes()), False),
    ("declared_16_bytes_reads_neighbour", st(good(a=info("F32", (4,), (0, 24))), AB), False),
    ("size_mismatch_short", st(good(b=info("I64", (3,), (24, 40))), AB), False),
    ("overlap", st(good(b=info("I64", (2,), (8, 24))), AB[:24]), False),
    ("same_offsets_twice", st(good(b=info("F32", (2, 3), (0, 24))), A.tobytes()), False),
    ("gap_between_tensors", st(good(b=info("I64", (2,), (32, 48))), A.tobytes() + bytes(8) + B.tobytes()), False),
    ("data_not_from_zero", st({"a": info("F32", (2, 3), (8, 32))}, bytes(8) + A.tobytes()), False),
    ("offsets_past_end", st(good(b=info("I64", (2,), (24, 40))), AB[:30]), False),
    ("truncated_data", st(GOOD, AB[:-1]), False),
    ("trailing_bytes", st(GOOD, AB + b"\x00"), False),
    ("no_tensors_but_data", st({}, b"\x00"), False),
    ("metadata_only_but_data", st({"__metadata__": {}}, U8), False),
    ("top_level_number", st(good(c=1), AB), False),
    ("metadata_not_string", st({"__metadata__": {"k": 1}, **GOOD}, AB), False),
    ("metadata_list", st({"__metadata__": ["k"], **GOOD}, AB), False),
    ("metadata_string", st({"__metadata__": "k", **GOOD}, AB), False),
    ("f4_odd_elements", st({"q": info("F4", (3,), (0, 2))}, U8), False),
    ("f6_not_whole_bytes", st({"q": info("F6_E2M3", (3,), (0, 2))}, U8), False),
]
ZOO_IDS = [z[0] for z in ZOO]
assert len(set(ZOO_IDS)) == len(ZOO_IDS)
BAD_ST = [z for z in ZOO if not z[2]]


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("zoo")
    for name, data, _ in ZOO:
        (d / f"{name}.safetensors").write_bytes(data)
    np.save(d / "t.npy", np.zeros(2, np.int64))
    return d


def test_zoo_size():
    """The count reported for the malformed-file suite."""
    assert len(BAD_ST) >= 20 and len(ZOO) - len(BAD_ST) >= 10


_DTYPE_NAMES = {"F32": "float32", "F64": "float64", "F16": "float16", "BF16": "bfloat16", "BOOL": "bool",
                "C64": "complex64", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
                "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F8_E4M3": "float8_e4m3fn"}


def _bytes_of(arr):
    if hasattr(arr, "element_size"):  # a torch view (no ml_dtypes)
        import torch

        return arr.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), str(arr.dtype).replace("torch.", "")
    return np.ascontiguousarray(arr).tobytes(), str(arr.dtype)


@pytest.mark.parametrize("name,data,valid", ZOO, ids=ZOO_IDS)
def test_safetensors_reader_agrees_with_the_safetensors_package(zoo_dir, name, data, valid):
    safetensors = pytest.importorskip("safetensors")
    path = str(zoo_dir / f"{name}.safetensors")
    try:
        ref = {k: v for k, v in safetensors.deserialize(data)}
        ref_ok = True
    except Exception:  # SafetensorError
        ref, ref_ok = None, False
    try:
        with safetensors.safe_open(path, "np") as f:
            ref_keys = set(f.keys())
        opened = True
    except Exception:
        opened = False
    assert ref_ok == opened == valid, "the zoo's label disagrees with the safetensors package"
    if not valid:
        with pytest.raises(_files.FileError, match="not a valid safetensors file"):
            _files.load_array(path, "logits")
        return
    assert set(ref) == ref_keys
    getters = _files._safetensors(path)  # raises FileError where we would reject the file
    assert set(getters) == set(ref)
    for k, r in ref.items():
        if r["dtype"] in ("F4", "F6_E2M3", "F6_E3M2"):
            with pytest.raises(_files.FileError, match="cannot read"):
                _files.load_array(path, "logits", key=k)
            continue
        arr = _files.load_array(path, "logits", key=k)
        raw, dtype = _bytes_of(arr)
        assert tuple(arr.shape) == tuple(r["shape"]), k
        assert dtype == _DTYPE_NAMES[r["dtype"]], k
        assert raw == bytes(r["data"]), k
        if isinstance(arr, np.ndarray) and arr.size:
            assert isinstance(arr, np.memmap), "arrays stay memory-mapped"
        if r["dtype"] in ("F32", "F64", "F16", "I64", "I8", "U8", "BOOL", "C64", "U16", "U32", "U64", "I16", "I32"):
            with safetensors.safe_open(path, "np") as f:
                want = f.get_tensor(k)
            assert want.dtype == arr.dtype and np.array_equal(want, arr, equal_nan=want.dtype.kind in "fc"), k


def test_valid_values_from_numpy():
    """The valid zoo file holds A and B exactly (independent of safetensors)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "v.safetensors")
        with open(p, "wb") as f:
            f.write(st(GOOD, AB))
        a, b = _files.load_array(p, "x", "a"), _files.load_array(p, "x", "b")
        assert a.dtype == np.float32 and np.array_equal(a, A) and isinstance(a, np.memmap)
        assert b.dtype == np.int64 and np.array_equal(b, B)


# Many cases in one subprocess: it imports lmmetrics (and torch) once, then
# forks a child per case that runs the command's ``main`` with its own stderr
# and exit status, as the console script would (an uncaught exception prints
# its traceback and exits 1); an alarm ends a child that hangs.
DRIVER = r"""
import json, os, signal, sys, time, traceback
try:
    import torch
except ImportError:
    pass
from lmmetrics.cli import main
out = {}
for name, args in json.load(sys.stdin).items():
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        signal.alarm(%d)
        try:
            code = main(args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        err = f.read().decode("utf-8", "replace")
    _, status = os.waitpid(pid, 0)
    out[name] = [os.waitstatus_to_exitcode(status), err, time.monotonic() - t0]
json.dump(out, sys.stdout)
"""


def _run_all(calls):
    """{name: (result, seconds)} of the command line on each argument list."""
    if not hasattr(os, "fork"):
        return {k: (run(*a), 0.0) for k, a in calls.items()}
    res = subprocess.run([sys.executable, "-c", DRIVER % TIMEOUT], input=json.dumps(
        {k: [str(a) for a in v] for k, v in calls.items()}), capture_output=True, text=True,
        timeout=TIMEOUT + 2 * len(calls))
    assert res.returncode == 0, res.stderr
    return {k: (subprocess.CompletedProcess(calls[k], code, "", err), sec)
            for k, (code, err, sec) in json.loads(res.stdout).items()}


@pytest.fixture(scope="module")
def bad_st_results(zoo_dir):
    calls = {name: ("score", zoo_dir / f"{name}.safetensors", zoo_dir / "t.npy") for name, _, _ in BAD_ST}
    return _run_all(calls)


@pytest.mark.parametrize("name", [z[0] for z in BAD_ST])
def test_malformed_safetensors_exit_2(bad_st_results, name):
    res, seconds = bad_st_results[name]
    assert_one_line_error(res, "score")
    assert "not a valid safetensors file" in res.stderr
    assert seconds < TIMEOUT


# ---------------------------------------------------------------------------
# Other malformed files and options.

def _npy_bytes(a):
    import io

    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _npz_bytes(**arrays):
    import io

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    """name -> (command, args): each a malformed input."""
    d = tmp_path_factory.mktemp("bad")
    z = np.zeros((2, 5), np.float32)
    t = np.zeros(2, np.int64)
    np.save(d / "z.npy", z)
    np.save(d / "t.npy", t)
    npy = _npy_bytes(z)
    npz = _npz_bytes(logits=z, targets=t)
    members = [i for i in range(len(npz)) if npz.startswith(b"\x93NUMPY", i)]

    def flip(i):  # one byte of a stored member's data: its CRC-32 no longer matches
        return npz[:i] + bytes([npz[i] ^ 0xFF]) + npz[i + 1:]
    files = {
        "empty.npy": b"",
        "garbage.npy": b"not numpy at all\n" * 4,
        "header_only.npy": npy[:128],
        "truncated.npy": npy[:-4],
        "bad_header.npy": npy[:10] + b"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 5)".ljust(117) + b"\n"
                          + npy[128:],
        "huge_shape.npy": npy[:10] + b"{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 5), }".ljust(117)
                          + b"\n" + npy[128:],
        "zip_named.npy": npz,
        "object.npy": _npy_bytes(np.array([{"a": 1}, None], dtype=object)),
        "empty.npz": b"",
        "corrupt.npz": b"PK\x03\x04" + bytes(60),
        "random.npz": bytes(range(256)),
        "truncated.npz": npz[: len(npz) // 2],
        "npy_named.npz": npy,
        "crc.npz": flip(members[0] + 130),
        "crc_targets.npz": flip(members[1] + 130),
        "ok.npz": npz,
        "empty.safetensors": b"",
        "empty.pt": b"",
        "garbage.pt": b"\x80\x02garbage" * 10,
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    import zipfile

    with zipfile.ZipFile(d / "text_member.npz", "w") as zf:
        zf.writestr("logits.txt", "1 2 3")
    cases = {}
    for name in files:
        cases[name] = ("score", d / name, d / "t.npy")
    cases["text_member.npz"] = ("score", d / "text_member.npz", d / "t.npy")
    del cases["ok.npz"]
    cases["crc_targets.npz"] = ("score", d / "ok.npz", d / "crc_targets.npz")
    for ext in (".npy", ".npz", ".safetensors", ".pt"):
        (d / f"dir{ext}").mkdir()
        cases[f"dir{ext}"] = ("score", d / f"dir{ext}", d / "t.npy")
    cases["dir targets"] = ("score", d / "z.npy", d / "dir.npy")
    cases["dir token_bytes"] = ("score", d / "z.npy", d / "t.npy", "--token-bytes", d / "dir.npy")
    cases["dir reference"] = ("compare", d / "z.npy", d / "t.npy", "--reference", d / "dir.safetensors")
    if os.path.exists("/dev/null"):
        os.symlink("/dev/null", d / "devnull.npy")
        cases["device.npy"] = ("score", d / "devnull.npy", d / "t.npy")
    if hasattr(os, "getuid") and os.getuid() != 0:  # root reads anything
        (d / "secret.npy").write_bytes(npy)
        os.chmod(d / "secret.npy", 0)
        cases["unreadable.npy"] = ("score", d / "secret.npy", d / "t.npy")
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        sp = torch.zeros(2, 5).to_sparse()
        torch.save(sp, d / "sparse.pt")
        torch.save({"logits": torch.zeros(2, 5), "targets": torch.zeros(2, dtype=torch.long).to_sparse()},
                   d / "sparse_targets.pt")
        with warnings.catch_warnings():  # torch's notes on CSR and quantized tensors
            warnings.simplefilter("ignore")
            csr = torch.zeros(2, 5).to_sparse_csr()
            qt = torch.quantize_per_tensor(torch.zeros(2, 5), 0.1, 0, torch.qint8)
        torch.save(csr, d / "csr.pt")
        torch.save(torch.empty(2, 5, device="meta"), d / "meta.pt")
        torch.save({"logits": torch.empty(2, 5, device="meta")}, d / "meta_dict.pt")
        torch.save([torch.zeros(2, 5)], d / "list.pt")
        torch.save(qt, d / "quantized.pt")
        torch.save(torch.zeros(2, 5), d / "ok.pt")
        (d / "truncated.pt").write_bytes((d / "ok.pt").read_bytes()[:100])
        for name in ("sparse.pt", "csr.pt", "meta.pt", "meta_dict.pt", "list.pt", "quantized.pt", "truncated.pt"):
            cases[name] = ("score", d / name, d / "t.npy")
        cases["sparse_targets.pt"] = ("score", d / "sparse_targets.pt", d / "sparse_targets.pt")
        cases["meta reference"] = ("compare", d / "z.npy", d / "t.npy", "--reference", d / "meta.pt")
    # options
    zz, tt = d / "z.npy", d / "t.npy"
    for v in ("inf", "-inf", "nan", "0", "-1", "1e400", "x"):
        cases[f"--chunk-mb {v}"] = ("score", zz, tt, f"--chunk-mb={v}")
    cases["compare --chunk-mb inf"] = ("compare", zz, tt, "--reference", zz, "--chunk-mb", "inf")
    cases["--threads 0"] = ("score", zz, tt, "--threads", "0")
    cases["compare --threads -2"] = ("compare", zz, tt, "--reference", zz, "--threads=-2")
    for opt, v in (("--repeat", "0"), ("--repeat", "-1"), ("--tokens", "0"), ("--vocab", "-5"),
                   ("--threads", "0"), ("--tokens", "1.5")):
        cases[f"bench {opt} {v}"] = ("bench", f"{opt}={v}")
    if torch is None or not torch.cuda.is_available():
        cases["bench --device cuda, no CUDA"] = ("bench", "--device", "cuda", "--tokens", "4", "--vocab", "8")
    cases["--targets-key missing"] = ("score", zz, d / "ok.npz", "--targets-key", "nope")
    cases["--key missing"] = ("compare", d / "ok.npz", tt, "--reference", d / "ok.npz", "--key", "nope")
    return cases


def test_malformed_files_and_options_exit_2(bad_files):
    results = _run_all(bad_files)
    failures = []
    for name, (res, seconds) in results.items():
        try:
            assert_one_line_error(res, bad_files[name][0])
            assert seconds < TIMEOUT
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert not failures, "\n".join(failures)
    assert len(results) >= 40


# The issue's list, each through the real console script in its own process
# ("@name" is a file written by the fixture below, or one of the zoo's).
ISSUE_CASES = {
    "empty .npy": ("score", "@empty.npy", "@t.npy"),
    "corrupt .npz": ("score", "@corrupt.npz", "@t.npy"),
    "directory x.npy": ("score", "@dir.npy", "@t.npy"),
    "--chunk-mb inf": ("score", "@z.npy", "@t.npy", "--chunk-mb", "inf"),
    "bench --repeat 0": ("bench", "--repeat", "0"),
    "sparse .pt": ("score", "@sparse.pt", "@t.npy"),
    "meta .pt": ("score", "@meta.pt", "@t.npy"),
    "header length 2^40": ("score", "@length_2_40.safetensors", "@t.npy"),
    "header length 2^63": ("score", "@length_2_63.safetensors", "@t.npy"),
    "header a JSON list": ("score", "@header_list.safetensors", "@t.npy"),
    "header nested 5000 deep": ("score", "@header_nested_5000.safetensors", "@t.npy"),
    "tensor info not a dict": ("score", "@info_number.safetensors", "@t.npy"),
    "no data_offsets": ("score", "@no_data_offsets.safetensors", "@t.npy"),
    "negative shape": ("score", "@shape_negative.safetensors", "@t.npy"),
    "negative offsets": ("score", "@offsets_negative.safetensors", "@t.npy"),
    "[0, 0] with a huge shape": ("score", "@zero_offsets_huge_shape.safetensors", "@t.npy"),
    "tensor reads its neighbour": ("score", "@declared_16_bytes_reads_neighbour.safetensors", "@t.npy"),
    "offsets past the end": ("score", "@offsets_past_end.safetensors", "@t.npy"),
    "overlapping tensors": ("score", "@overlap.safetensors", "@t.npy"),
}


@pytest.fixture(scope="module")
def issue_results(zoo_dir):
    """{case: result}, the processes run a few at a time."""
    d = zoo_dir
    (d / "empty.npy").write_bytes(b"")
    (d / "corrupt.npz").write_bytes(b"PK\x03\x04" + bytes(60))
    (d / "dir.npy").mkdir()
    np.save(d / "z.npy", np.zeros((2, 5), np.float32))
    cases = dict(ISSUE_CASES)
    try:
        import torch

        torch.save(torch.zeros(2, 5).to_sparse(), d / "sparse.pt")
        torch.save(torch.empty(2, 5, device="meta"), d / "meta.pt")
    except ImportError:
        del cases["sparse .pt"], cases["meta .pt"]
    with ThreadPoolExecutor(4) as pool:
        futures = {k: pool.submit(run, *[d / a[1:] if a.startswith("@") else a for a in v])
                   for k, v in cases.items()}
        return {k: f.result() for k, f in futures.items()}


@pytest.mark.parametrize("case", ISSUE_CASES)
def test_issue_cases_through_the_console_script(issue_results, case):
    if case not in issue_results:
        pytest.skip("needs torch")
    assert_one_line_error(issue_results[case], ISSUE_CASES[case][0])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("ext", [".npy", ".npz", ".safetensors", ".pt"])
def test_fifo_is_refused_at_once(tmp_path, ext):
    fifo = tmp_path / f"x{ext}"
    os.mkfifo(fifo)
    np.save(tmp_path / "z.npy", np.zeros((2, 5), np.float32))
    t0 = time.monotonic()
    for args in (("score", fifo, tmp_path / "z.npy"), ("score", tmp_path / "z.npy", fifo)):
        res = run(*args, timeout=20)
        assert_one_line_error(res, "score")
        assert "not a regular file" in res.stderr
    assert time.monotonic() - t0 < 10


def test_no_torch_bench_and_quiet_broken_pipe():
    code = ("import sys; sys.modules['torch'] = None; from lmmetrics.cli import main; "
            "sys.exit(main(['bench', '--tokens', '8', '--vocab', '300', '--repeat', '1']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr
    header = [ln for ln in res.stdout.splitlines() if "time ms" in ln]
    assert header and not any("vs torch" in ln for ln in header)
    assert "torch is not installed" in res.stdout
    assert not any(ln.startswith("torch F.cross_entropy") for ln in res.stdout.splitlines())
    # the reader of stdout is gone before anything is written: no traceback
    for args in ((), ("info",), ("demo",)):
        r, w = os.pipe()
        os.close(r)
        try:
            res = subprocess.run(CMD + list(args), stdout=w, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT)
        finally:
            os.close(w)
        assert res.stderr == "", res.stderr
        assert res.returncode == 141


def test_broken_pipe_in_a_shell_pipeline():
    if not shutil.which("head") or not shutil.which("sh"):
        pytest.skip("no sh / head")
    import shlex

    cmd = " ".join(shlex.quote(c) for c in CMD)
    res = subprocess.run(["sh", "-c", f"{cmd} info | head -1; {cmd} | head -1"], capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert len(res.stdout.splitlines()) == 2


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory):
    """{"logits", "labels"} the way Hugging Face dumps name them, in the
    three formats with names."""
    d = tmp_path_factory.mktemp("hf")
    rng = np.random.default_rng(3)
    z = (rng.standard_normal((2, 6, 50)) * 2).astype(np.float32)
    r = (z + rng.standard_normal(z.shape) * 0.2).astype(np.float32)
    y = rng.integers(0, 50, (2, 6))
    y[0, 0] = -100
    np.savez(d / "hf.npz", logits=z, labels=y)
    np.savez(d / "ref.npz", logits=r, labels=y)
    with open(d / "hf.safetensors", "wb") as f:
        f.write(st({"labels": info("I64", y.shape, (0, y.nbytes)),
                    "logits": info("F32", z.shape, (y.nbytes, y.nbytes + z.nbytes))}, y.tobytes() + z.tobytes()))
    np.savez(d / "three.npz", logits=z, labels=y, mask=np.ones_like(y))
    np.savez(d / "y_named.npz", logits=z, y=y, other=y)
    return d, z, r, y


@pytest.mark.parametrize("ext", [".npz", ".safetensors", ".pt"])
def test_labels_are_targets(hf_files, ext):
    d, z, r, y = hf_files
    f = d / f"hf{ext}"
    if ext == ".pt":
        torch = pytest.importorskip("torch")
        torch.save({"logits": torch.from_numpy(z), "labels": torch.from_numpy(y)}, f)
    res = run("score", f, f)  # Hugging Face's labels are unshifted: --shift or --no-shift must say
    assert_one_line_error(res, "score")
    assert "--no-shift if they are already aligned" in res.stderr
    for shift in (False, True):
        want = lmmetrics.evaluate(z, y, shift=shift).as_dict()
        for extra in ((),) if ext == ".pt" else ((), ("--targets-key", "labels")):
            res = run("score", f, f, "--json", "--shift" if shift else "--no-shift", *extra)
            assert res.returncode == 0, res.stderr
            got = json.loads(res.stdout)
            assert got["tokens"] == want["tokens"] == (10 if shift else 11)
            assert got["nll_sum"] == pytest.approx(want["nll_sum"], rel=1e-9)


def test_targets_key(hf_files):
    d, z, r, y = hf_files
    want = lmmetrics.evaluate(z, y).as_dict()
    got = json.loads(run("score", d / "three.npz", d / "three.npz", "--json", "--no-shift").stdout)
    assert got["nll_sum"] == pytest.approx(want["nll_sum"], rel=1e-9)
    res = run("score", d / "y_named.npz", d / "y_named.npz")
    assert_one_line_error(res, "score")
    assert "--targets-key" in res.stderr
    got = json.loads(run("score", d / "y_named.npz", d / "y_named.npz", "--targets-key", "y", "--json").stdout)
    assert got["nll_sum"] == pytest.approx(want["nll_sum"], rel=1e-9)
    # compare: reference and model logits by --key, targets by --targets-key
    cmp = json.loads(run("compare", d / "y_named.npz", d / "y_named.npz", "--reference", d / "ref.npz", "--key", "logits",
                         "--targets-key", "y", "--json").stdout)
    want = lmmetrics.compare(z, y, reference_logits=r).as_dict()
    assert cmp["tokens"] == want["tokens"]
    assert cmp["kld"]["mean"]["value"] == pytest.approx(want["kld"]["mean"]["value"], rel=1e-9)


# ---------------------------------------------------------------------------
# Files the Python API reads that the command line must read too


def _nll_mean(z, t):
    """float64 mean NLL (scipy), the reference for the files below."""
    from helpers import ref_nll

    return float(ref_nll(z, t).mean())


@pytest.mark.parametrize("fmt", ["npy", "npz"])
def test_big_endian_logits_and_targets(tmp_path, fmt):
    rng = np.random.default_rng(3)
    z = (rng.standard_normal((2, 6, 50)) * 3).astype(">f4")
    t = rng.integers(0, 50, (2, 6)).astype(">i8")
    if fmt == "npy":
        np.save(tmp_path / "z.npy", z)
        np.save(tmp_path / "t.npy", t)
        files = (tmp_path / "z.npy", tmp_path / "t.npy")
    else:
        np.savez(tmp_path / "zt.npz", logits=z, targets=t)
        files = (tmp_path / "zt.npz", tmp_path / "zt.npz")
    res = run("score", *files, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["loss"] == pytest.approx(_nll_mean(z, t), abs=2e-6)


def test_legacy_pt_is_read(tmp_path):
    """torch.save's pre-1.6 (non-zip) format cannot be memory-mapped: read whole."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    z = (rng.standard_normal((7, 40)) * 3).astype(np.float32)
    t = rng.integers(0, 40, 7)
    torch.save({"logits": torch.from_numpy(z), "targets": torch.from_numpy(t)}, tmp_path / "old.pt",
               _use_new_zipfile_serialization=False)
    res = run("score", tmp_path / "old.pt", tmp_path / "old.pt", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["loss"] == pytest.approx(_nll_mean(z, t), abs=2e-6)


@pytest.mark.parametrize("chunk_mb", [None, 0.0002])   # (0.0002: 3 rows of 16 float32 a chunk)
@pytest.mark.parametrize("shift", [False, True])
def test_a_bad_row_or_target_is_named_in_its_shard(tmp_path, capsys, chunk_mb, shift):
    """score and compare name a NaN or an out-of-range target at its position
    in the shard and name the shard, whatever chunk of rows the library
    was handed (it named the row in the chunk: row 0 of a 3-row chunk)."""
    from helpers import main_error

    rng = np.random.default_rng(13)
    for sub in ("L", "T", "R"):
        (tmp_path / sub).mkdir()
    for i in range(3):
        z = rng.normal(size=(4, 8, 16)).astype(np.float32)
        np.save(tmp_path / "L" / f"l{i}.npy", z)
        np.save(tmp_path / "R" / f"r{i}.npy", z)
        np.save(tmp_path / "T" / f"t{i}.npy", rng.integers(0, 16, size=(4, 8)))
    opts = (["--shift"] if shift else ["--no-shift"]) + ([] if chunk_mb is None else ["--chunk-mb", chunk_mb])
    z = np.load(tmp_path / "L" / "l2.npy")
    z[3, 6, 2] = np.nan
    np.save(tmp_path / "L" / "l2.npy", z)
    shard = "shard 3 of 3 ("
    for cmd in (["score"], ["compare", "--reference", tmp_path / "R"]):
        err = main_error(capsys, cmd[0], tmp_path / "L", tmp_path / "T", *cmd[1:], *opts)
        assert shard in err and "NaN in logits at row 30 (position (3, 6))" in err, err
    z[3, 6, 2] = 0.5
    np.save(tmp_path / "L" / "l2.npy", z)
    t = np.load(tmp_path / "T" / "t1.npy")
    t[3, 6] = 99
    np.save(tmp_path / "T" / "t1.npy", t)
    for cmd in (["score"], ["compare", "--reference", tmp_path / "R"]):
        err = main_error(capsys, cmd[0], tmp_path / "L", tmp_path / "T", *cmd[1:], *opts)
        assert "shard 2 of 3 (" in err and "target 99 at position (3, 6) is out of range" in err, err


def test_several_arrays_each_role_says_how_to_pick_one(tmp_path, capsys):
    """A file of several arrays names the way to pick the one a role takes:
    --key, --targets-key, --reference-key; token_bytes has no option, so its
    message says to name the array token_bytes (which then is taken)."""
    from helpers import main_error

    rng = np.random.default_rng(0)
    z = rng.normal(size=(4, 8)).astype(np.float32)
    np.save(tmp_path / "z.npy", z)
    np.save(tmp_path / "t.npy", rng.integers(0, 8, 4))
    np.savez(tmp_path / "zz.npz", a=z, b=z)
    np.savez(tmp_path / "tt.npz", a=np.zeros(4, np.int64), b=np.zeros(4, np.int64))
    np.savez(tmp_path / "tb.npz", bytes=np.ones(8, np.int64), ids=np.arange(8))
    assert "with --key" in main_error(capsys, "score", tmp_path / "zz.npz", tmp_path / "t.npy")
    assert "with --targets-key" in main_error(capsys, "score", tmp_path / "z.npy", tmp_path / "tt.npz")
    assert "with --reference-key" in main_error(capsys, "score", tmp_path / "z.npy", tmp_path / "t.npy",
                                                "--reference", tmp_path / "zz.npz")
    err = main_error(capsys, "score", tmp_path / "z.npy", tmp_path / "t.npy", "--token-bytes", tmp_path / "tb.npz")
    assert "call the token_bytes one 'token_bytes' in the file" in err and "--key" not in err, err
    np.savez(tmp_path / "tb.npz", token_bytes=np.ones(8, np.int64), ids=np.arange(8))
    from lmmetrics.cli import main

    assert main(["score", str(tmp_path / "z.npy"), str(tmp_path / "t.npy"), "--token-bytes",
                 str(tmp_path / "tb.npz"), "--json"]) == 0
