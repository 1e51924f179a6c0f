"""lmmetrics score --per-token / --plot / --reference: the per-position file
against float64 numpy (NLL, entropy, KL) and a numpy count (rank), streamed
across chunks and shards; the PNG's size; and the bad input: no partial
file is ever left behind."""
import importlib.util
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import lmmetrics
from helpers import main_error, ref_entropy, ref_kl, ref_nll, ref_rank


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    rng = np.random.default_rng(0)
    z = (rng.standard_normal((4, 30, 500)) * 2).astype(np.float32)
    r = (z + rng.standard_normal(z.shape) * 0.3).astype(np.float32)
    t = rng.integers(0, 500, (4, 30))
    t[1, 3:9] = -100
    for i in range(2):  # two shards of two sequences each
        np.save(d / f"z{i}.npy", z[2 * i:2 * i + 2])
        np.save(d / f"r{i}.npy", r[2 * i:2 * i + 2])
        np.save(d / f"t{i}.npy", t[2 * i:2 * i + 2])
    np.save(d / "z.npy", z)
    np.save(d / "r.npy", r)
    np.save(d / "t.npy", t)
    return d, z, r, t


def _expected(z, r, t, shift):
    """Every column, from numpy in float64, in the order of the counted
    positions (sequence-major)."""
    if shift:
        z, r, t = z[:, :-1], r[:, :-1], t[:, 1:]
    seq, pos = np.nonzero(t >= 0)
    zz, rr, tt = z[seq, pos].astype(np.float64), r[seq, pos].astype(np.float64), t[seq, pos]
    rank = ref_rank(z[seq, pos], tt)  # the logits' own float32 values, compared in float64
    return {"sequence": seq, "position": pos + (1 if shift else 0), "target": tt, "nll": ref_nll(zz, tt),
            "rank": rank, "entropy": ref_entropy(zz), "kl": ref_kl(rr, zz)}


def _check(got, want):
    assert list(got) == ["sequence", "position", "target", "nll", "rank", "entropy", "kl"]
    for k in ("sequence", "position", "target", "rank"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    for k in ("nll", "entropy", "kl"):
        np.testing.assert_allclose(got[k], want[k], atol=2e-6, rtol=2e-6, err_msg=k)


@pytest.mark.parametrize("shift", [False, True], ids=["aligned", "shift"])
def test_per_token_npz_streams_chunks_and_shards(data, tmp_path, capsys, shift):
    from lmmetrics.cli import main

    d, z, r, t = data
    out = tmp_path / "tokens.npz"
    extra = ["--shift"] if shift else []
    # a 1 KiB chunk: a few rows (or part of a sequence) at a time, over two shards
    args = ["score", str(d / "z?.npy"), str(d / "t?.npy"), "--reference", str(d / "r?.npy"), "--per-token", str(out),
            "--chunk-mb", str(1 / 1024), "--json"] + extra
    assert main(args) == 0
    capsys.readouterr()
    with np.load(out) as f:
        got = {k: f[k] for k in f.files}
    _check(got, _expected(z, r, t, shift))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".lmmetrics")]  # the temporary folder is gone


def test_per_token_parquet(data, tmp_path, capsys):
    pq = pytest.importorskip("pyarrow.parquet")
    from lmmetrics.cli import main

    d, z, r, t = data
    out = tmp_path / "tokens.parquet"
    assert main(["score", str(d / "z.npy"), str(d / "t.npy"), "--reference", str(d / "r.npy"), "--per-token",
                 str(out), "--chunk-mb", "0.01", "--shift"]) == 0
    capsys.readouterr()
    table = pq.read_table(out)
    assert table.num_rows == int((t[:, 1:] >= 0).sum())
    _check({k: table.column(k).to_numpy() for k in table.column_names}, _expected(z, r, t, True))


def test_score_reference_adds_the_paired_numbers(data, capsys):
    from lmmetrics.cli import main
    import json

    d, z, r, t = data
    assert main(["score", str(d / "z.npy"), str(d / "t.npy"), "--reference", str(d / "r.npy"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    m = lmmetrics.evaluate(z, t, reference_logits=r)
    for k in ("kl", "same_top", "loss_ref", "loss_diff", "loss_diff_stderr"):
        assert got[k] == pytest.approx(m.as_dict()[k], rel=1e-12), k


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_plot_is_a_png_of_the_documented_size(data, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from lmmetrics.cli.plot import SIZE
    from lmmetrics.cli import main

    d, z, r, t = data
    out = tmp_path / "plot.png"
    assert main(["score", str(d / "z.npy"), str(d / "t.npy"), "--plot", str(out), "--shift", "--bins", "10"]) == 0
    capsys.readouterr()
    assert _png_size(out) == SIZE == (1200, 450)


def test_bad_outputs_are_one_line_errors_and_leave_no_file(data, tmp_path, capsys):
    d, z, r, t = data
    base = ["score", str(d / "z.npy"), str(d / "t.npy")]
    assert "end in .npz or .parquet" in main_error(capsys, *base, "--per-token", tmp_path / "x.csv")
    assert "cannot write into" in main_error(capsys, *base, "--per-token", tmp_path / "no" / "x.npz")
    assert "end in .png" in main_error(capsys, *base, "--plot", tmp_path / "x.jpg")
    # a name too long for the folder: said before the run (os.replace said it at the end, naming its temporary)
    has_plot = importlib.util.find_spec("matplotlib") is not None   # (--plot needs it, and says so first)
    for option, suffix in (("--per-token", ".npz"),) + ((("--plot", ".png"),) if has_plot else ()):
        err = main_error(capsys, *base, option, tmp_path / ("L" * 300 + suffix))
        assert "the file name is longer than" in err and ".lmmetrics-" not in err, err
    assert "--bins" in main_error(capsys, *base, "--plot", tmp_path / "x.png", "--bins", "0")
    # an error in the middle of the run (NaN in the last shard's logits): nothing at the destination
    bad = z.copy()
    bad[3, 20, 7] = np.nan
    np.save(tmp_path / "bad.npy", bad)
    out = tmp_path / "tokens.npz"
    err = main_error(capsys, "score", tmp_path / "bad.npy", d / "t.npy", "--per-token", out, "--chunk-mb", "0.01")
    assert "NaN" in err
    assert os.listdir(tmp_path) == ["bad.npy"]  # no partial file, no temporary folder


def test_an_output_that_is_an_input_is_refused(data, tmp_path, capsys):
    """--per-token naming an input file (the dump itself, by another path
    too, or the token_bytes table) is refused before any work, the input
    untouched (it was replaced by the per-token table)."""
    d, z, r, t = data
    dump = tmp_path / "dump.npz"
    np.savez(dump, logits=z, targets=t)
    np.savez(tmp_path / "tb.npz", token_bytes=np.ones(z.shape[-1], np.int64))
    before = dump.read_bytes()
    for out in (dump, tmp_path / "." / "dump.npz", tmp_path / "tb.npz"):
        err = main_error(capsys, "score", dump, dump, "--token-bytes", tmp_path / "tb.npz", "--per-token", out)
        assert "is one of the input files" in err, err
    os.symlink(dump, tmp_path / "link.npz")
    assert "is one of the input files" in main_error(capsys, "score", dump, dump, "--per-token", tmp_path / "link.npz")
    assert dump.read_bytes() == before


@pytest.mark.parametrize("module,option,name", [("pyarrow", "--per-token", "x.parquet"),
                                                ("matplotlib", "--plot", "x.png")])
def test_missing_optional_package_is_named(data, tmp_path, module, option, name):
    """The optional package not importable (a stand-in raising ImportError
    first on the path): one line naming it, exit 2."""
    d, z, r, t = data
    fake = tmp_path / "fake"
    (fake / module).mkdir(parents=True)
    (fake / module / "__init__.py").write_text(f"raise ImportError('no {module} here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake)] + sys.path))
    res = subprocess.run([sys.executable, "-m", "lmmetrics", "score", str(d / "z.npy"), str(d / "t.npy"), option,
                          str(tmp_path / name)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and f"needs {module} (pip install {module})" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / name).exists()


COLUMNS = {"sequence": np.int64, "position": np.int64, "target": np.int64, "nll": np.float64, "rank": np.int64,
           "entropy": np.float64, "kl": np.float64}


@pytest.mark.parametrize("shape,shift", [((0, 50), False), ((3, 0, 50), False), ((3, 0, 50), True),
                                         ((3, 1, 50), True), ((3, 4, 50), False)],
                         ids=["no-row", "no-position", "no-position-shift", "one-position-shift", "all-ignored"])
def test_no_counted_position_gives_empty_outputs(tmp_path, capsys, shape, shift):
    """Logits with no position (or none counted) score as they do without
    the options (exit 0, 0 tokens): an empty file with the columns and
    dtypes of a full one in each format, and both panels of the plot drawn
    empty."""
    pytest.importorskip("matplotlib")
    from lmmetrics.cli.plot import SIZE
    from lmmetrics.cli import main

    z = np.zeros(shape, np.float32)
    np.save(tmp_path / "z.npy", z)
    np.save(tmp_path / "t.npy", np.full(shape[:-1], -100 if z.size else 0, np.int64))
    base = ["score", str(tmp_path / "z.npy"), str(tmp_path / "t.npy"), "--json"] + (["--shift"] if shift else [])
    assert main(base) == 0
    plain = capsys.readouterr().out
    for ref in ((), ("--reference", str(tmp_path / "z.npy"))):
        out = tmp_path / f"tokens{len(ref)}.npz"
        assert main(base + [*ref, "--per-token", str(out), "--plot", str(tmp_path / "plot.png")]) == 0
        got = capsys.readouterr().out
        assert json.loads(got)["tokens"] == 0
        if not ref:
            assert got == plain
        want = {k: v for k, v in COLUMNS.items() if ref or k != "kl"}
        with np.load(out) as f:
            assert f.files == list(want)
            assert {k: (f[k].dtype, f[k].shape) for k in f.files} == {k: (np.dtype(v), (0,)) for k, v in want.items()}
        assert _png_size(tmp_path / "plot.png") == SIZE
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "tokens.parquet"
    assert main(base + ["--reference", str(tmp_path / "z.npy"), "--per-token", str(out)]) == 0
    table = pq.read_table(out)
    assert table.num_rows == 0 and table.column_names == list(COLUMNS)
    assert [np.dtype(c.type.to_pandas_dtype()) for c in table.schema] == [np.dtype(v) for v in COLUMNS.values()]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".lmmetrics")]


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=["022", "002", "077"])
def test_outputs_follow_the_umask(data, tmp_path, capsys, umask):
    """--per-token and --plot files get the mode any new file gets (0666
    less the umask), as a shell redirection's would."""
    pytest.importorskip("matplotlib")
    import stat
    from lmmetrics.cli import main

    d, z, r, t = data
    outs = [tmp_path / "tokens.npz", tmp_path / "plot.png"]
    old = os.umask(umask)
    try:
        assert main(["score", str(d / "z.npy"), str(d / "t.npy"), "--per-token", str(outs[0]),
                     "--plot", str(outs[1])]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    for out in outs:
        assert stat.S_IMODE(os.stat(out).st_mode) == 0o666 & ~umask, out.name
