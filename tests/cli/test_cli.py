"""The real ``lmmetrics`` console script, in a subprocess, on files written
here (npy, npz, safetensors, pt), checked against the Python API."""
import json
import math
import importlib.util
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import lmmetrics
from lmmetrics import _core
from helpers import main_error, ref_nll

SCRIPT = shutil.which("lmmetrics", path=os.path.dirname(sys.executable)) or shutil.which("lmmetrics")


def run(*args, ok=True):
    cmd = [SCRIPT] if SCRIPT else [sys.executable, "-m", "lmmetrics"]
    res = subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=300)
    if ok:
        assert res.returncode == 0, res.stderr
    return res


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("logits")
    rng = np.random.default_rng(0)
    z = (rng.standard_normal((3, 40, 700)) * 2).astype(np.float32)
    r = (z + rng.standard_normal(z.shape) * 0.3).astype(np.float32)
    t = rng.integers(0, 700, (3, 40))
    t[0, :5] = -100
    tb = rng.integers(0, 5, 700)
    np.save(d / "z.npy", z)
    np.save(d / "r.npy", r)
    np.save(d / "t.npy", t)
    np.save(d / "tb.npy", tb)
    np.savez(d / "both.npz", logits=z, targets=t)
    write_safetensors(d / "z.safetensors", {"logits": z, "other": t})
    write_safetensors(d / "two.safetensors", {"a": z, "b": z})
    return d, z, r, t, tb


def write_safetensors(path, arrays):
    """The safetensors layout, written by hand: u64 header size, JSON, data."""
    names = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(np.float16): "F16"}
    header, blobs, off = {}, [], 0
    for k, a in arrays.items():
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def check(out, want):
    for k, v in want.items():
        if v is None or isinstance(v, int):
            assert out[k] == v, k
        else:
            assert out[k] == pytest.approx(v, rel=1e-9), k


def test_score_npy_in_several_chunks(files):
    d, z, r, t, tb = files
    res = run("score", d / "z.npy", d / "t.npy", "--token-bytes", d / "tb.npy", "--json", "--chunk-mb", 0.01)
    check(json.loads(res.stdout), lmmetrics.evaluate(z, t, token_bytes=tb).as_dict())
    table = run("score", d / "z.npy", d / "t.npy", "--quiet").stdout
    assert "perplexity" in table and "bits_per_token" in table


def test_score_npz_safetensors_pt(files):
    d, z, r, t, tb = files
    want = lmmetrics.evaluate(z, t, softcap=20.0).as_dict()
    check(json.loads(run("score", d / "both.npz", d / "both.npz", "--json", "--softcap", 20).stdout), want)
    check(json.loads(run("score", d / "z.safetensors", d / "t.npy", "--key", "logits", "--json",
                         "--softcap", 20).stdout), want)
    torch = pytest.importorskip("torch")
    torch.save(torch.from_numpy(z).to(torch.bfloat16), d / "z16.pt")
    torch.save({"targets": torch.from_numpy(t)}, d / "t.pt")
    z16 = torch.from_numpy(z).to(torch.bfloat16)
    check(json.loads(run("score", d / "z16.pt", d / "t.pt", "--json").stdout),
          lmmetrics.evaluate(z16, torch.from_numpy(t)).as_dict())


def test_compare(files):
    d, z, r, t, tb = files
    got = json.loads(run("compare", d / "z.npy", d / "t.npy", "--reference", d / "r.npy", "--json", "--chunk-mb", 0.02).stdout)
    want = lmmetrics.compare(z, t, reference_logits=r).as_dict()
    assert got["tokens"] == want["tokens"]
    for k in ("ppl", "ppl_ref", "ratio", "delta_ppl", "same_top", "rms_delta_p"):
        assert got[k]["value"] == pytest.approx(want[k]["value"], rel=1e-9), k
    assert got["kld"]["percentiles"]["99%"] == pytest.approx(want["kld"]["percentiles"]["99%"], rel=1e-9)
    assert "Mean    KLD" in run("compare", d / "z.npy", d / "t.npy", "--reference", d / "r.npy").stdout


def _hf_labels(t):
    """Unshifted labels as Hugging Face takes them: -100 on a prefix and on
    some later positions."""
    lab = t.copy()
    lab[:, :3] = -100
    lab[1, 10:14] = -100
    return lab


def _same_comparison(got, want):
    assert got["tokens"] == want["tokens"]
    for k in ("ppl", "ppl_ref", "ratio", "delta_ppl", "same_top", "rms_delta_p"):
        assert got[k]["value"] == pytest.approx(want[k]["value"], rel=1e-9), k
    assert got["kld"]["mean"]["value"] == pytest.approx(want["kld"]["mean"]["value"], rel=1e-9)
    assert got["kld"]["percentiles"]["99%"] == pytest.approx(want["kld"]["percentiles"]["99%"], rel=1e-9)


@pytest.mark.parametrize("chunk_mb", [0.004, 0.05, 0.25, 256])   # within a sequence, whole sequences, one chunk
def test_score_shift_hf_labels(files, tmp_path, chunk_mb):
    d, z, r, t, tb = files
    lab = _hf_labels(t)
    np.save(tmp_path / "lab.npy", lab)
    got = json.loads(run("score", d / "z.npy", tmp_path / "lab.npy", "--shift", "--token-bytes", d / "tb.npy",
                         "--json", "--chunk-mb", chunk_mb).stdout)
    want = lmmetrics.evaluate(z, lab, token_bytes=tb, shift=True).as_dict()
    check(got, want)
    assert got["tokens"] == int(np.count_nonzero(lab[:, 1:] >= 0))
    # the same as scoring the shifted view without --shift
    check(got, lmmetrics.evaluate(z[:, :-1], lab[:, 1:], token_bytes=tb).as_dict())


@pytest.mark.parametrize("chunk_mb", [0.004, 0.05, 0.25, 256])
def test_compare_shift_softcap_token_bytes(files, tmp_path, chunk_mb):
    d, z, r, t, tb = files
    lab = _hf_labels(t)
    np.save(tmp_path / "lab.npy", lab)
    args = ("compare", d / "z.npy", tmp_path / "lab.npy", "--reference", d / "r.npy", "--shift", "--softcap", 5,
            "--token-bytes", d / "tb.npy", "--chunk-mb", chunk_mb)
    got = json.loads(run(*args, "--json").stdout)
    _same_comparison(got, lmmetrics.compare(z, lab, reference_logits=r, shift=True, softcap=5.0).as_dict())
    assert got["bits_per_byte"] == pytest.approx(
        lmmetrics.bits_per_byte(z, lab, tb, shift=True, softcap=5.0), rel=1e-9)
    assert got["bits_per_byte_ref"] == pytest.approx(
        lmmetrics.bits_per_byte(r, lab, tb, shift=True, softcap=5.0), rel=1e-9)
    table = run(*args).stdout
    line = [x for x in table.splitlines() if x.startswith("bits per byte (model / reference)")]
    assert len(line) == 1 and line[0].endswith(f"{got['bits_per_byte']:.6f} / {got['bits_per_byte_ref']:.6f} bits")


def test_compare_token_bytes_without_shift(files):
    d, z, r, t, tb = files
    got = json.loads(run("compare", d / "z.npy", d / "t.npy", "--reference", d / "r.npy", "--token-bytes", d / "tb.npy",
                         "--json", "--chunk-mb", 0.02).stdout)
    _same_comparison(got, lmmetrics.compare(z, t, reference_logits=r).as_dict())
    assert got["bits_per_byte"] == pytest.approx(lmmetrics.bits_per_byte(z, t, tb), rel=1e-9)
    assert got["bits_per_byte_ref"] == pytest.approx(lmmetrics.bits_per_byte(r, t, tb), rel=1e-9)
    assert "bits per byte" not in run("compare", d / "z.npy", d / "t.npy", "--reference", d / "r.npy").stdout


def test_shift_needs_a_sequence_axis(tmp_path):
    np.save(tmp_path / "z.npy", np.zeros(5, np.float32))
    np.save(tmp_path / "t.npy", np.zeros((), np.int64))
    res = run("score", tmp_path / "z.npy", tmp_path / "t.npy", "--shift", ok=False)
    assert res.returncode == 2 and "--shift needs logits shaped" in res.stderr


def test_shift_needs_a_sequence_axis_in_every_shard(tmp_path, capsys):
    """A shard of 1-D logits under --shift is named, and refused before any
    shard is scored (it was found only when its turn came, unnamed)."""
    for name in ("l", "t"):
        (tmp_path / name).mkdir()
    np.save(tmp_path / "l" / "p0.npy", np.zeros((2, 3, 4), np.float32))
    np.save(tmp_path / "t" / "p0.npy", np.zeros((2, 3), np.int64))
    np.save(tmp_path / "l" / "p1.npy", np.zeros(4, np.float32))
    np.save(tmp_path / "t" / "p1.npy", np.zeros((), np.int64))
    for cmd in (("score",), ("compare", "--reference", tmp_path / "l")):
        err = main_error(capsys, cmd[0], tmp_path / "l", tmp_path / "t", "--shift", *cmd[1:])
        assert "shard 2 of 2" in err and "p1.npy" in err and "--shift needs logits shaped (..., T, V), got (4,)" in err


@pytest.mark.parametrize("case,needle", [
    ("missing", "no such file"),
    ("format", "unsupported format"),
    ("rows", "does not match the logits rows"),
    ("dtype", "must hold float logits"),
    ("target_dtype", "must hold integers"),
    ("token_bytes", "token_bytes must be a 1-D table of length 700"),
    ("ref_rows", "must have the logits' shape"),
    ("ref_layout", "must have the logits' shape"),   # the same rows in another layout: refused, not paired
    ("key", "several arrays"),
])
def test_errors_are_one_line_and_exit_2(files, case, needle):
    d, z, r, t, tb = files
    (d / "x.csv").write_text("1,2\n")
    np.save(d / "short_ref.npy", r[:2])
    np.save(d / "swapped_ref.npy", np.swapaxes(r, 0, 1))  # (3, 40, V) as (40, 3, V)
    np.save(d / "zf.npy", z.astype(np.float64)[..., 0])
    args = {
        "missing": ("score", d / "nope.npy", d / "t.npy"),
        "format": ("score", d / "x.csv", d / "t.npy"),
        "rows": ("score", d / "z.npy", d / "tb.npy"),
        "dtype": ("score", d / "t.npy", d / "t.npy"),
        "target_dtype": ("score", d / "z.npy", d / "zf.npy"),
        "token_bytes": ("score", d / "z.npy", d / "t.npy", "--token-bytes", d / "t.npy"),
        "ref_rows": ("compare", d / "z.npy", d / "t.npy", "--reference", d / "short_ref.npy"),
        "ref_layout": ("score", d / "z.npy", d / "t.npy", "--reference", d / "swapped_ref.npy"),
        "key": ("score", d / "two.safetensors", d / "t.npy"),
    }[case]
    res = run(*args, ok=False)
    assert res.returncode == 2
    assert needle in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_demo_info_and_bench():
    assert "cross-entropy" in run().stdout
    assert "isa" in run("info").stdout.lower()
    out = run("bench", "--tokens", 16, "--vocab", 1000, "--repeat", 1).stdout
    assert "relative error" in out and "read-only pass" in out
    # one section per dtype: its accuracy line and a read-only pass row for 1 and for all threads
    sections = {b.splitlines()[0].split()[0].rstrip(":"): b for b in out.strip().split("\n\n")}
    for dt in ("float32", "bfloat16", "float16"):
        assert dt in sections, out
        if dt == "bfloat16" and importlib.util.find_spec("ml_dtypes") is None:
            assert sections[dt].startswith("bfloat16: skipped (") and "ml_dtypes" in sections[dt], out
            continue
        head, *rows = sections[dt].splitlines()
        assert "relative error" in head, out
        reads = [r for r in rows if r.startswith("read-only pass, ")]
        assert 1 <= len(reads) <= 2 and reads[0].startswith("read-only pass, 1 thread(s)"), out
        for r in reads:  # the fastest path is named: "(avx2)", "(scalar + prefetch)", ...
            path = r[r.rindex("(") + 1:-1].split(" + ")
            assert path[0] in _core.ISAS and path[1:] in ([], ["prefetch"]), r
        ranks = [r for r in rows if r.startswith("nll + rank, ")]
        assert len(ranks) == 1 and "x cross_entropy, median " in ranks[0], out
    last = out.strip().splitlines()[-1]
    assert last.startswith("small call (1 x ") and " us" in last, out


def test_bench_lazy_times_and_measures_memory():
    """bench --lazy: a row per variant (ms, x matmul, peak extra MiB), the
    memory saved, and the lazy loss checked against the materialized one
    (status 0 only when they agree); what it cannot time is a one-line
    error."""
    pytest.importorskip("torch")
    out = run("bench", "--lazy", "--tokens", 64, "--vocab", 3000, "--hidden", 64, "--repeat", 1).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    for name in ("matmul", "materialized", "lazy", "lazy-nll"):
        assert name in rows and rows[name][-1] == "MiB", out
        assert float(rows[name][1]) > 0 and float(rows[name][3]) > 0 and float(rows[name][4]) >= 0, out
    assert "memory saved by lazy logits" in out and "64 x 64 hidden states, a 3000 x 64 head" in out
    for extra, says in ((["--dtype", "float16"], "--lazy times the CPU"), (["--compile"], "--lazy takes no")):
        _assert_one_line_exit_2(run("bench", "--lazy", *extra, ok=False), says)


def test_bench_lazy_says_when_a_run_fails_or_dies(monkeypatch):
    """A variant's process that raises (4 TB of logits) or dies without a
    result (killed for memory) is a one-line error, exit 2: the parent
    waited for its result forever."""
    pytest.importorskip("torch")
    res = subprocess.run([sys.executable, "-m", "lmmetrics", "bench", "--lazy", "--tokens", "1000000", "--vocab",
                          "1000000", "--hidden", "1", "--repeat", "1"], capture_output=True, text=True, timeout=120)
    _assert_one_line_exit_2(res, "the matmul run failed at 1000000 x 1000000")
    import multiprocessing as mp
    import os

    from lmmetrics.cli.bench import lazy
    from lmmetrics.cli.errors import InputError

    fork = mp.get_context("fork")
    monkeypatch.setattr(lazy.mp, "get_context", lambda _: fork)
    monkeypatch.setattr(lazy, "_variant", lambda *a: os._exit(9))   # (in the forked child)
    with pytest.raises(InputError, match=r"the lazy run ended without a result \(exit code 9; killed for memory"):
        lazy.run_variant("lazy", 64, 8, 100, "float32", 1)


def test_bench_lazy_on_a_device(monkeypatch):
    """bench --lazy --device cuda's steps (in one process, warmed up, timed
    to the device's end), here on CPU tensors routed through the CUDA path:
    every variant's row, the losses checked (status 1 when a lazy loss is
    wrong); without a GPU the command is a one-line error."""
    torch = pytest.importorskip("torch")
    from lmmetrics.cli.bench import lazy as _bench_lazy
    from lmmetrics._engine import cuda as _cuda, inputs as _inputs
    from lmmetrics import _engine

    if not torch.cuda.is_available():
        _assert_one_line_exit_2(run("bench", "--lazy", "--device", "cuda", ok=False), "sees no CUDA device")
    routed = lambda x: isinstance(x, torch.Tensor)  # noqa: E731
    launch, calls = _cuda.launch, []
    monkeypatch.setattr(_cuda, "launch", lambda *a: calls.append(1) or launch(*a))
    monkeypatch.setattr(_inputs, "is_cuda", routed)
    lines = []
    assert _bench_lazy.bench_lazy_device("cpu", 48, 32, 700, "float32", 1, lines.append) == 0
    out = "\n".join(lines)
    rows = {line.split()[0]: line.split() for line in lines if line.split()}
    for name in ("matmul", "materialized", "lazy", "lazy-nll", "lazy-rows"):
        assert rows[name][-2:] == ["-", "MiB"] and float(rows[name][1]) > 0, out
    assert "48 x 32 hidden states, a 700 x 32 head, float32, cpu" in out
    assert len(calls) >= 3 * 2, calls  # the lazy variants, warmed up and timed, took the CUDA path
    # a wrong lazy loss fails the check
    real = _bench_lazy._step
    monkeypatch.setattr(_bench_lazy, "_step", lambda name, *a: (lambda: 1.0) if name == "lazy-nll"
                        else real(name, *a))
    lines.clear()
    assert _bench_lazy.bench_lazy_device("cpu", 48, 32, 700, "float32", 1, lines.append) == 1
    assert lines[-1].startswith("FAILED"), lines


def _bench_error(env_extra):
    """lmmetrics bench --device cuda (tiny) with env_extra set: its result."""
    cmd = [SCRIPT] if SCRIPT else [sys.executable, "-m", "lmmetrics"]
    env = dict(os.environ, **env_extra)
    return subprocess.run(cmd + ["bench", "--device", "cuda", "--tokens", "4", "--vocab", "64", "--repeat", "1"],
                          capture_output=True, text=True, timeout=300, env=env)


def _assert_one_line_exit_2(res, needle):
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert res.stderr.startswith("lmmetrics bench: error: ") and needle in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_bench_cuda_without_cuda_is_one_line_exit_2():
    """No CUDA device visible (CUDA_VISIBLE_DEVICES empty, so on a GPU
    machine too): the CUDA bench refuses with one line and status 2."""
    pytest.importorskip("torch")
    _assert_one_line_exit_2(_bench_error({"CUDA_VISIBLE_DEVICES": ""}), "no CUDA device")


def test_bench_cuda_without_torch_is_one_line_exit_2(tmp_path):
    """torch not importable (a stand-in that raises ImportError first on the
    path): one line, status 2."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    path = os.pathsep.join([str(fake)] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                          if p])
    _assert_one_line_exit_2(_bench_error({"PYTHONPATH": path}), "needs torch")


def test_bench_cuda_without_triton_raises_input_error(monkeypatch):
    """triton not importable: InputError (main's one line and status 2), not
    SystemExit or a traceback. (On a CPU device, which only the interpreted
    tests use, since the CLI checks for a CUDA device first.)"""
    pytest.importorskip("torch")
    from lmmetrics.cli.bench.cuda import bench_cuda
    from lmmetrics.cli.errors import InputError

    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(InputError, match="needs triton"):
        bench_cuda(4, 64, ("float32",), 1, device="cpu", print_fn=lambda s: None)


def test_score_shift_pt_dump(files, tmp_path):
    """A Hugging Face style dump (logits and unshifted labels in one .pt),
    read memory-mapped as torch tensors."""
    torch = pytest.importorskip("torch")
    d, z, r, t, tb = files
    lab = _hf_labels(t)
    torch.save({"logits": torch.from_numpy(z), "labels": torch.from_numpy(lab)}, tmp_path / "dump.pt")
    got = json.loads(run("score", tmp_path / "dump.pt", tmp_path / "dump.pt", "--key", "logits", "--shift",
                         "--json", "--chunk-mb", 0.05).stdout)
    check(got, lmmetrics.evaluate(z, lab, shift=True).as_dict())


def main_json(capsys, *args):
    """Run the CLI in this process; its stdout parsed as strict JSON (NaN,
    Infinity and -Infinity, which Python's json accepts, are refused)."""
    from lmmetrics.cli import main

    assert main([str(a) for a in args]) == 0
    out = capsys.readouterr().out

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(out, parse_constant=refuse)


def test_json_is_strict_null_for_nan_and_inf(files, tmp_path, capsys):
    d, z, r, t, tb = files
    np.save(tmp_path / "ignored.npy", np.full(t.shape, -100))
    got = main_json(capsys, "score", d / "z.npy", tmp_path / "ignored.npy", "--json", "--token-bytes", d / "tb.npy")
    assert got["tokens"] == 0 and got["bytes"] == 0
    assert got["loss"] is got["perplexity"] is got["bits_per_byte"] is got["entropy"] is None
    np.save(tmp_path / "zero_bytes.npy", np.zeros(700, np.int64))
    got = main_json(capsys, "score", d / "z.npy", d / "t.npy", "--json", "--token-bytes", tmp_path / "zero_bytes.npy")
    assert got["bits_per_byte"] is None  # inf: no byte counted
    assert got["loss"] == pytest.approx(float(ref_nll(z, t)[t >= 0].mean()), abs=2e-6)
    # compare on 3 tokens: no correlation (NaN)
    few = np.full(t.shape, -100)
    few[1, :3] = t[1, :3]
    np.save(tmp_path / "few.npy", few)
    got = main_json(capsys, "compare", d / "z.npy", tmp_path / "few.npy", "--reference", d / "r.npy", "--json")
    assert got["tokens"] == 3 and got["correlation"] is None


def test_compare_on_zero_rows(tmp_path, capsys):
    np.save(tmp_path / "z.npy", np.zeros((0, 5), np.float32))
    np.save(tmp_path / "t.npy", np.zeros(0, np.int64))
    err = main_error(capsys, "compare", tmp_path / "z.npy", tmp_path / "t.npy", "--reference", tmp_path / "z.npy")
    assert "no counted token to compare" in err and "holds no positions" in err


@pytest.mark.parametrize("args,needle", [
    (("score", "z.npy", "t.npy", "--chunk-mb", "1e308"), "--chunk-mb: must be above 0 and at most"),
    (("score", "z.npy", "t.npy", "--chunk-mb", "inf"), "--chunk-mb"),
    (("score", "z.npy", "t.npy", "--chunk-mb", "0"), "--chunk-mb"),
    (("bench", "--vocab", "1"), "--vocab: must be at least 2"),
])
def test_out_of_range_numbers_are_one_line_errors(files, capsys, args, needle):
    d = files[0]
    err = main_error(capsys, *[d / a if a.endswith(".npy") else a for a in args])
    assert needle in err


def _ref_compare_nll(z, r, t):
    """float64 (scipy) mean NLL of the model and of the reference."""
    keep = t >= 0
    return float(ref_nll(z, t)[keep].mean()), float(ref_nll(r, t)[keep].mean())


def test_compare_takes_the_reference_by_name(files, tmp_path, capsys):
    d, z, r, t, tb = files
    got = main_json(capsys, "compare", d / "z.npy", d / "t.npy", "--reference", d / "r.npy", "--json")
    nll_m, nll_r = _ref_compare_nll(z, r, t)
    assert math.log(got["ppl"]["value"]) == pytest.approx(nll_m, abs=2e-6)
    assert math.log(got["ppl_ref"]["value"]) == pytest.approx(nll_r, abs=2e-6)
    # the old positional form, in either order, is refused with the new form spelled out
    for old in ((d / "r.npy", d / "z.npy", d / "t.npy"), (d / "z.npy", d / "r.npy", d / "t.npy")):
        err = main_error(capsys, "compare", *old)
        assert "compare takes LOGITS TARGETS --reference REFERENCE_LOGITS" in err
        err = main_error(capsys, "compare", *old, "--reference", d / "r.npy")
        assert "the old form REFERENCE LOGITS TARGETS is refused" in err
    assert "--reference" in main_error(capsys, "compare", d / "z.npy", d / "t.npy")


def test_compare_keys_of_each_file(files, tmp_path, capsys):
    """A reference dump {logits, labels} against a model dump {output,
    labels}: each file's logits found as score finds them (the array named
    logits, else the only float array), or named by --key / --reference-key."""
    d, z, r, t, tb = files
    np.savez(tmp_path / "base.npz", logits=r, labels=t)
    np.savez(tmp_path / "quant.npz", output=z, labels=t)
    np.savez(tmp_path / "two.npz", a=r, b=z, labels=t)
    nll_m, nll_r = _ref_compare_nll(z, r, t)
    for extra in ((), ("--key", "output", "--reference-key", "logits")):
        got = main_json(capsys, "compare", tmp_path / "quant.npz", tmp_path / "quant.npz",
                        "--reference", tmp_path / "base.npz", "--json", "--no-shift", *extra)
        assert math.log(got["ppl"]["value"]) == pytest.approx(nll_m, abs=2e-6)
        assert math.log(got["ppl_ref"]["value"]) == pytest.approx(nll_r, abs=2e-6)
    got = main_json(capsys, "compare", tmp_path / "two.npz", tmp_path / "two.npz", "--reference",
                    tmp_path / "two.npz", "--key", "b", "--reference-key", "a", "--json", "--no-shift")
    assert math.log(got["ppl"]["value"]) == pytest.approx(nll_m, abs=2e-6)
    err = main_error(capsys, "compare", tmp_path / "quant.npz", tmp_path / "quant.npz",
                     "--reference", tmp_path / "two.npz")
    assert "name the reference logits one with --reference-key" in err


def test_reference_key_defaults_to_key(files, tmp_path, capsys):
    """--key names the model's array; without --reference-key the reference
    file's array of that name is read where it holds one (a reference dump
    laid out as the model's), not its "logits" beside it, which would be
    compared unseen (KL of "final" against the reference's "logits")."""
    d, z, r, t, tb = files
    rng = np.random.default_rng(5)
    other = rng.standard_normal(z.shape).astype(np.float32)
    np.savez(tmp_path / "model.npz", logits=other, final=z, targets=t)
    np.savez(tmp_path / "base.npz", logits=other, final=r)
    nll_m, nll_r = _ref_compare_nll(z, r, t)
    for cmd in ("compare", "score"):
        got = main_json(capsys, cmd, tmp_path / "model.npz", tmp_path / "model.npz", "--reference",
                        tmp_path / "base.npz", "--key", "final", "--json", "--no-shift")
        if cmd == "compare":
            assert math.log(got["ppl"]["value"]) == pytest.approx(nll_m, abs=2e-6)
            assert math.log(got["ppl_ref"]["value"]) == pytest.approx(nll_r, abs=2e-6)
        else:
            assert got["loss"] == pytest.approx(nll_m, abs=2e-6)
            assert got["loss_ref"] == pytest.approx(nll_r, abs=2e-6)
    # a reference file without the array --key names: its logits, as before
    np.savez(tmp_path / "base2.npz", logits=r, labels=t)
    got = main_json(capsys, "score", tmp_path / "model.npz", tmp_path / "model.npz", "--reference",
                    tmp_path / "base2.npz", "--key", "final", "--json", "--no-shift")
    assert got["loss_ref"] == pytest.approx(nll_r, abs=2e-6)


def test_version_and_help(capsys):
    from lmmetrics import __version__
    from lmmetrics.cli import main

    for argv in (["--version"], ["--help"], ["score", "--help"], ["compare", "--help"], ["bench", "--help"],
                 ["info", "--help"], ["demo", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        if argv == ["--version"]:
            assert out == f"lmmetrics {__version__}\n"
            continue
        description = out.split("\n\n")[1]
        assert description and not description.startswith(("positional", "options")), argv
        if argv[0] in ("--help", "score", "compare", "bench"):
            assert "examples:\n  lmmetrics" in out, argv


def test_compare_format_llama_cpp(files, capsys):
    from lmmetrics.cli import main
    from helpers import llama_text

    d, z, r, t, tb = files
    args = ["compare", str(d / "z.npy"), str(d / "t.npy"), "--reference", str(d / "r.npy")]
    assert main(args + ["--format", "llama.cpp"]) == 0
    out = capsys.readouterr().out
    assert out == llama_text(lmmetrics.compare(z, t, reference_logits=r))
    for bad in (["--json"], ["--token-bytes", str(d / "tb.npy")]):
        assert "needs --format table" in main_error(capsys, *args, "--format", "llama.cpp", *bad)


def test_compare_format_llama_cpp_identical_models(files, capsys):
    """A model against itself: llama.cpp's RMS Δp uncertainty is 0.5 / 0
    times 0, which it prints as -nan (x86-64's default NaN; nan elsewhere)."""
    from lmmetrics.cli import main
    from helpers import X86_64

    d, z, r, t, tb = files
    assert main(["compare", str(d / "z.npy"), str(d / "t.npy"), "--reference", str(d / "z.npy"),
                 "--format", "llama.cpp"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"RMS Δp    :  0.000 ± {' -nan' if X86_64 else '  nan'} %" in lines
    assert "Same top p: 100.000 ± 0.000 %" in lines


def test_score_table_units(files, capsys):
    from lmmetrics.cli import main

    d, z, r, t, tb = files
    assert main(["score", str(d / "z.npy"), str(d / "t.npy"), "--token-bytes", str(d / "tb.npy")]) == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    loss = float(ref_nll(z, t)[t >= 0].mean())
    assert rows["loss"].endswith(" nats per token") and float(rows["loss"].split()[0]) == pytest.approx(loss, rel=1e-5)
    assert rows["bits_per_token"].endswith(" bits") and rows["bits_per_byte"].endswith(" bits")
    assert rows["entropy"].endswith(" nats per token") and rows["accuracy"].endswith(" %")
    assert rows["nll_sum"].endswith(" nats") and rows["tokens"].isdigit()


# ---------------------------------------------------------------------------
# Shards: a directory or a glob for each input, paired in sorted order, one
# Evaluator across them, against the concatenated arrays in one call.

@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(5)
    lengths = (2, 1, 3, 2)  # sequences per shard, of 12 positions over 50 tokens
    zs = [(rng.standard_normal((n, 12, 50)) * 2).astype(np.float32) for n in lengths]
    rs = [(z + rng.standard_normal(z.shape) * 0.4).astype(np.float32) for z in zs]
    ts = [rng.integers(0, 50, (n, 12)) for n in lengths]
    ts[0][0, :4] = -100
    for name in ("logits", "targets", "ref", "dumps"):
        (d / name).mkdir()
    for i, (z, r, t) in enumerate(zip(zs, rs, ts)):
        np.save(d / "logits" / f"part-{i:03d}.npy", z)
        np.save(d / "ref" / f"part-{i:03d}.npy", r)
        np.save(d / "targets" / f"part-{i:03d}.npy", t)
        np.savez(d / "dumps" / f"part-{i:03d}.npz", logits=z, labels=t)
    (d / "logits" / "notes.txt").write_text("not a shard")  # other files in a directory are not shards
    return d, np.concatenate(zs), np.concatenate(rs), np.concatenate(ts)


def _reference_scores(z, t, shift=False):
    """float64 NLL mean and count of the concatenated arrays."""
    if shift:
        z, t = z[:, :-1], t[:, 1:]
    nll = ref_nll(z.astype(np.float64), t)
    c = t >= 0
    return float(nll[c].mean()), int(c.sum())


@pytest.mark.parametrize("shift", [False, True])
def test_score_shards_directory_and_glob(shards, shift):
    d, z, r, t = shards
    flag = ["--shift"] if shift else ["--no-shift"]  # the dumps' labels must be said to be either
    want = lmmetrics.evaluate(z, t, shift=shift).as_dict()
    loss, tokens = _reference_scores(z, t, shift)
    for logits, targets in ((d / "logits", d / "targets"), (f"{d}/logits/part-*.npy", f"{d}/targets/*.npy"),
                            (d / "dumps", d / "dumps")):
        got = json.loads(run("score", logits, targets, "--json", "--chunk-mb", 0.01, *flag).stdout)
        check(got, want)
        assert got["tokens"] == tokens and got["loss"] == pytest.approx(loss, rel=1e-6)


@pytest.mark.parametrize("shift", [False, True])
def test_compare_shards(shards, shift):
    d, z, r, t = shards
    flag = ["--shift"] if shift else []
    got = json.loads(run("compare", d / "logits", f"{d}/targets/*.npy", "--reference", d / "ref", "--json",
                         *flag).stdout)
    _same_comparison(got, lmmetrics.compare(z, t, reference_logits=r, shift=shift).as_dict())
    loss, tokens = _reference_scores(z, t, shift)
    assert got["tokens"] == tokens and math.log(got["ppl"]["value"]) == pytest.approx(loss, rel=1e-6)


def test_single_files_still_take_no_shard_prefix(shards, tmp_path, capsys):
    d = shards[0]
    one = d / "logits" / "part-000.npy"
    err = main_error(capsys, "score", one, d / "targets" / "part-001.npy")
    assert "error: targets shape (1, 12) does not match the logits rows (2, 12)" in err and "shard" not in err


def test_shard_errors_are_one_line(shards, tmp_path, capsys):
    d = shards[0]
    (tmp_path / "empty").mkdir()
    err = main_error(capsys, "score", d / "logits", tmp_path / "empty")
    assert "empty: the directory holds no .npy, .npz, .safetensors, .pt, .pth file (targets)" in err
    err = main_error(capsys, "score", d / "logits", f"{tmp_path}/nothing-*.npy")
    assert "the pattern matches no file (targets)" in err
    err = main_error(capsys, "score", d / "logits", f"{d}/targets/part-00[0-2].npy")
    assert "the shards do not pair by name" in err and f"have no partner: LOGITS: {d}/logits/part-003.npy (" in err
    assert f"(files: LOGITS {d}/logits 4, TARGETS {d}/targets/part-00[0-2].npy 3)" in err
    err = main_error(capsys, "compare", d / "logits", d / "targets", "--reference", f"{d}/ref/part-000.npy")
    assert "--reference" in err and "no partner" in err
    # shapes that do not pair: the shard is named, before any is scored
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for i, name in enumerate(sorted(os.listdir(d / "targets"))):
        shutil.copy(d / "targets" / name, mixed / name)
    np.save(mixed / "part-002.npy", np.zeros((3, 11), np.int64))
    err = main_error(capsys, "score", d / "logits", mixed)
    assert "shard 3 of 4" in err and "part-002.npy" in err and "does not match the logits rows (3, 12)" in err
    # another vocabulary in a later shard
    vocab = tmp_path / "vocab"
    vocab.mkdir()
    for i, name in enumerate(sorted(n for n in os.listdir(d / "logits") if n.endswith(".npy"))):
        z = np.load(d / "logits" / name)
        np.save(vocab / name, z[..., :40] if i == 3 else z)
    err = main_error(capsys, "score", vocab, d / "targets")
    assert "shard 4 of 4" in err and "vocabulary of 40, the logits 50" in err


def test_shards_pair_by_name_numbers_as_numbers(shards, tmp_path, capsys):
    """part-5 beside part-10 pairs with part-005 beside part-010 (in sorted
    order they would pair part-10 with part-005), shards are taken in the
    order of their numbers, and the role word of a glob's names (logits-,
    targets-) is no part of the pairing."""
    d, z, r, t = shards
    names = sorted(n for n in os.listdir(d / "logits") if n.endswith(".npy"))  # part-000 ... part-003
    ordered = [5, 10, 40, 200]  # the shards' numbers, in order
    (tmp_path / "z").mkdir()
    (tmp_path / "t").mkdir()
    for i, name in zip(ordered, names):
        shutil.copy(d / "logits" / name, tmp_path / "z" / f"part-{i}.npy")
        shutil.copy(d / "targets" / name, tmp_path / "t" / f"part-{i:04d}.npy")
        shutil.copy(d / "targets" / name, tmp_path / f"targets-{i}.npy")
    want = lmmetrics.evaluate(z, t).as_dict()
    check(main_json(capsys, "score", tmp_path / "z", tmp_path / "t", "--json"), want)
    check(main_json(capsys, "score", tmp_path / "z", f"{tmp_path}/targets-*.npy", "--json"), want)
    # --per-token numbers the sequences across shards in that order
    out = tmp_path / "tokens.npz"
    assert main_json(capsys, "score", tmp_path / "z", tmp_path / "t", "--json", "--per-token", out)["tokens"] > 0
    with np.load(out) as f:
        seq, pos, tgt = f["sequence"], f["position"], f["target"]
    want_seq, want_pos = np.nonzero(t >= 0)
    np.testing.assert_array_equal(seq, want_seq)
    np.testing.assert_array_equal(pos, want_pos)
    np.testing.assert_array_equal(tgt, t[want_seq, want_pos])
    # names that do not pair: every one without a partner is listed
    os.rename(tmp_path / "t" / "part-0200.npy", tmp_path / "t" / "part-0201.npy")
    err = main_error(capsys, "score", tmp_path / "z", tmp_path / "t")
    assert "do not pair by name" in err
    assert f"LOGITS: {tmp_path}/z/part-200.npy; TARGETS: {tmp_path}/t/part-0201.npy" in err
    # two names of one shard in a list
    shutil.copy(tmp_path / "z" / "part-5.npy", tmp_path / "z" / "part-05.npy")
    err = main_error(capsys, "score", tmp_path / "z", tmp_path / "t")
    assert "name the same shard" in err and "part-5 is part-005" in err


# ---------------------------------------------------------------------------
# --shift and targets that certainly cannot be unshifted labels (or that
# certainly are, without --shift)

def test_shift_refuses_targets_one_position_short(files, tmp_path, capsys):
    d, z, r, t, tb = files
    np.save(tmp_path / "aligned.npy", t[:, 1:])
    err = main_error(capsys, "score", d / "z.npy", tmp_path / "aligned.npy", "--shift")
    assert "these targets are already aligned" in err and "drop --shift" in err
    err = main_error(capsys, "score", d / "z.npy", tmp_path / "aligned.npy")
    assert "logits[..., :-1, :]" in err and "with --shift" in err


def test_shift_refuses_a_dump_of_aligned_labels(files, tmp_path, capsys):
    d, z, r, t, tb = files
    ids = t.copy()
    ids[ids < 0] = 7
    aligned = np.full_like(ids, -100)
    aligned[:, :-1] = ids[:, 1:]  # labels already shifted, the last position padded
    aligned[0, :5] = -100         # and a masked prompt
    np.savez(tmp_path / "aligned.npz", logits=z, input_ids=ids, labels=aligned)
    err = main_error(capsys, "score", tmp_path / "aligned.npz", tmp_path / "aligned.npz", "--shift")
    assert "already aligned" in err and "input_ids[..., t + 1]" in err and "drop --shift" in err
    # with --no-shift they are what they look like: aligned with the logits
    want = lmmetrics.evaluate(z, aligned).as_dict()
    check(main_json(capsys, "score", tmp_path / "aligned.npz", tmp_path / "aligned.npz", "--json", "--no-shift"),
          want)
    # input_ids in the logits file, the labels in their own
    np.savez(tmp_path / "z_ids.npz", logits=z, input_ids=ids)
    np.save(tmp_path / "labels.npy", aligned)
    err = main_error(capsys, "compare", tmp_path / "z_ids.npz", tmp_path / "labels.npy", "--reference", d / "r.npy",
                     "--shift")
    assert "already aligned" in err
    # unshifted labels (equal to input_ids where counted) pass with --shift
    unshifted = ids.copy()
    unshifted[0, :5] = -100
    np.savez(tmp_path / "hf.npz", logits=z, input_ids=ids, labels=unshifted)
    check(main_json(capsys, "score", tmp_path / "hf.npz", tmp_path / "hf.npz", "--shift", "--json"),
          lmmetrics.evaluate(z, unshifted, shift=True).as_dict())
    # a sequence of one repeated token is both: nothing is certain, nothing is refused
    same = np.full_like(ids, 3)
    same_aligned = same.copy()
    same_aligned[:, -1] = -100
    np.savez(tmp_path / "same.npz", logits=z, input_ids=same, labels=same_aligned)
    check(main_json(capsys, "score", tmp_path / "same.npz", tmp_path / "same.npz", "--shift", "--json"),
          lmmetrics.evaluate(z, same_aligned, shift=True).as_dict())


def test_no_shift_refuses_targets_equal_to_input_ids(files, tmp_path, capsys):
    d, z, r, t, tb = files
    ids = np.abs(t)
    np.savez(tmp_path / "hf.npz", logits=z, input_ids=ids, labels=ids)
    err = main_error(capsys, "score", tmp_path / "hf.npz", tmp_path / "hf.npz")
    assert "equal input_ids" in err and "every token would predict itself" in err and "add --shift" in err
    err = main_error(capsys, "score", tmp_path / "hf.npz", tmp_path / "hf.npz", "--targets-key", "input_ids")
    assert "add --shift" in err
    check(main_json(capsys, "score", tmp_path / "hf.npz", tmp_path / "hf.npz", "--shift", "--json"),
          lmmetrics.evaluate(z, ids, shift=True).as_dict())
    # Hugging Face labels as they come, -100 on a masked prompt and on the padding, equal input_ids at every
    # counted position: unshifted, also under --no-shift (which scored each token against itself, a plausible
    # number)
    lab = ids.copy()
    lab[:, :2] = -100
    lab[0, -3:] = -100
    np.savez(tmp_path / "masked.npz", logits=z, input_ids=ids, labels=lab)
    for cmd in (("score",), ("score", "--no-shift"), ("compare", "--reference", str(d / "r.npy"), "--no-shift")):
        err = main_error(capsys, cmd[0], tmp_path / "masked.npz", tmp_path / "masked.npz", *cmd[1:])
        assert "at every counted position" in err and "add --shift" in err, err
    check(main_json(capsys, "score", tmp_path / "masked.npz", tmp_path / "masked.npz", "--json", "--shift"),
          lmmetrics.evaluate(z, lab, shift=True).as_dict())
    # labels that differ from input_ids at a counted position are not certainly either: taken as said
    other = lab.copy()
    other[1, 4] = (ids[1, 4] + 1) % z.shape[-1]
    np.savez(tmp_path / "other.npz", logits=z, input_ids=ids, labels=other)
    check(main_json(capsys, "score", tmp_path / "other.npz", tmp_path / "other.npz", "--json", "--no-shift"),
          lmmetrics.evaluate(z, other).as_dict())
    # a run of one repeated token, aligned and padded, is both: nothing is certain, nothing is refused
    same = np.full_like(ids, 3)
    same_aligned = same.copy()
    same_aligned[:, -1] = -100
    np.savez(tmp_path / "same.npz", logits=z, input_ids=same, labels=same_aligned)
    check(main_json(capsys, "score", tmp_path / "same.npz", tmp_path / "same.npz", "--no-shift", "--json"),
          lmmetrics.evaluate(z, same_aligned).as_dict())
    # aligned targets counted at each sequence's last position only (a one-token continuation), whose next
    # token, beyond the dump, repeats the last input id: equal to input_ids there, and no position says more
    last = np.full_like(ids, -100)
    last[:, -1] = ids[:, -1]
    np.savez(tmp_path / "last.npz", logits=z, input_ids=ids, targets=last)
    check(main_json(capsys, "score", tmp_path / "last.npz", tmp_path / "last.npz", "--no-shift", "--json"),
          lmmetrics.evaluate(z, last).as_dict())


def test_a_hugging_face_dump_needs_shift_said(files, tmp_path, capsys):
    """A dump of what a Hugging Face causal LM saw ({logits, input_ids,
    labels}, labels unshifted with a masked prompt): scored as aligned it
    gives a plausible, wrong loss, so without --shift or --no-shift it is
    refused, with both spelled out; the same for targets named labels or
    input_ids alone, or with input_ids beside them in the logits' file.
    With --shift, the float64 loss of logits[:, :-1] on labels[:, 1:]."""
    torch = pytest.importorskip("torch")
    d, z, r, t, tb = files
    ids = np.abs(t)
    lab = ids.copy()
    lab[:, :4] = -100
    torch.save({"logits": torch.from_numpy(z), "input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(lab)},
               tmp_path / "dump.pt")
    np.savez(tmp_path / "labels_only.npz", logits=z, labels=lab)
    np.savez(tmp_path / "z_ids.npz", logits=z, input_ids=ids)
    np.save(tmp_path / "lab.npy", lab)
    # beside input_ids, labels equal to them at every counted position are certainly unshifted: add --shift
    for args in ((tmp_path / "dump.pt", tmp_path / "dump.pt"), (tmp_path / "z_ids.npz", tmp_path / "lab.npy")):
        for cmd in (("score",), ("compare", "--reference", str(d / "r.npy"))):
            err = main_error(capsys, cmd[0], *args, *cmd[1:])
            assert "at every counted position" in err and "add --shift" in err, err
    # else asked which they are
    lab_other = lab.copy()
    lab_other[0, 5] = (ids[0, 5] + 1) % z.shape[-1]
    np.save(tmp_path / "lab_other.npy", lab_other)
    for args in ((tmp_path / "labels_only.npz",) * 2, (tmp_path / "z_ids.npz", tmp_path / "lab_other.npy")):
        err = main_error(capsys, "score", *args)
        assert "Hugging Face's labels and input_ids are unshifted" in err, err
        assert "--shift if they are unshifted" in err and "--no-shift if they are already aligned" in err
        err = main_error(capsys, "compare", *args, "--reference", d / "r.npy")
        assert "--no-shift if they are already aligned" in err
    err = main_error(capsys, "score", tmp_path / "z_ids.npz", tmp_path / "lab_other.npy")
    assert "with input_ids beside them in " + str(tmp_path / "z_ids.npz") in err
    got = main_json(capsys, "score", tmp_path / "dump.pt", tmp_path / "dump.pt", "--shift", "--json")
    keep = lab[:, 1:] >= 0
    assert got["tokens"] == int(keep.sum())
    assert got["loss"] == pytest.approx(float(ref_nll(z[:, :-1], lab[:, 1:])[keep].mean()), abs=2e-6)
    # --shift and --no-shift together are refused by the parser
    assert "not allowed with argument" in main_error(capsys, "score", tmp_path / "dump.pt", tmp_path / "dump.pt",
                                                     "--shift", "--no-shift")
