"""Which array of a file the command reads, and what it refuses before
scoring: a choice the names do not settle is an error naming the option
that settles it, never a guess; logits of a dtype the kernels do not take are
named with their file; chunks count the bytes of both logits read."""
import argparse

import numpy as np
import pytest

from helpers import main_error


def _nll64(z, t):
    """Mean NLL in float64 over the targets that are not -100."""
    z = np.asarray(z, np.float64).reshape(-1, z.shape[-1])
    t = np.asarray(t).reshape(-1)
    keep = t != -100
    z, t = z[keep], t[keep]
    m = z.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(-1))
    return float(np.mean(lse - z[np.arange(t.size), t]))


@pytest.fixture()
def arrays():
    rng = np.random.default_rng(11)
    z = (rng.standard_normal((2, 9, 13)) * 2).astype(np.float32)
    r = (z + rng.standard_normal(z.shape) * 0.5).astype(np.float32)
    t = rng.integers(0, 13, (2, 9))
    t[0, :2] = -100
    return z, r, t


def _json(capsys, *args):
    import json

    from lmmetrics.cli import main

    assert main([str(a) for a in args]) == 0
    return json.loads(capsys.readouterr().out)


def test_targets_and_labels_in_one_file_is_ambiguous(arrays, tmp_path, capsys):
    """A file holding both "targets" and "labels" (aligned ids and Hugging
    Face's unshifted ones are both usual) names no target array: it was read
    as "targets" unasked (here a loss of 4.0340 where the "labels" array,
    if meant, gives 4.4045); now an error naming --targets-key."""
    z, r, t = arrays
    shifted = np.full_like(t, -100)
    shifted[:, :-1] = t[:, 1:]
    np.save(tmp_path / "z.npy", z)
    np.savez(tmp_path / "ids.npz", targets=t, labels=shifted)
    err = main_error(capsys, "score", tmp_path / "z.npy", tmp_path / "ids.npz")
    assert "'targets' and 'labels'" in err and "--targets-key" in err
    err = main_error(capsys, "compare", tmp_path / "z.npy", tmp_path / "ids.npz", "--reference", tmp_path / "z.npy")
    assert "--targets-key" in err
    for key, want in (("targets", t), ("labels", shifted)):
        got = _json(capsys, "score", tmp_path / "z.npy", tmp_path / "ids.npz", "--targets-key", key, "--no-shift",
                    "--json")
        assert got["loss"] == pytest.approx(_nll64(z, want), abs=2e-6)


@pytest.mark.parametrize("cmd", ["compare", "score"])
def test_a_reference_in_the_logits_file_needs_its_key(arrays, tmp_path, capsys, cmd):
    """--reference naming the logits' own file of several arrays, without
    --reference-key: the reference's default rules are the logits', so the
    logits were compared with themselves (KL 0, same top 100%, whatever the
    reference array beside them); now an error naming --reference-key."""
    z, r, t = arrays
    np.savez(tmp_path / "pair.npz", logits=z, base=r, targets=t)
    p = tmp_path / "pair.npz"
    for extra in ((), ("--key", "logits")):
        err = main_error(capsys, cmd, p, p, "--reference", p, *extra)
        assert "--reference-key" in err and "'logits'" in err
    got = _json(capsys, cmd, p, p, "--reference", p, "--reference-key", "base", "--json")
    ref_loss = _nll64(r, t)
    if cmd == "compare":
        assert np.log(got["ppl_ref"]["value"]) == pytest.approx(ref_loss, abs=2e-6)
        assert got["kld"]["mean"]["value"] > 0.01
    else:
        assert got["loss_ref"] == pytest.approx(ref_loss, abs=2e-6)
        assert got["kl"] > 0.01
    # a file of one array given as both: the model against itself, as asked
    np.save(tmp_path / "z.npy", z)
    np.save(tmp_path / "t.npy", t)
    got = _json(capsys, cmd, tmp_path / "z.npy", tmp_path / "t.npy", "--reference", tmp_path / "z.npy", "--json")
    assert (got["kld"]["mean"]["value"] if cmd == "compare" else got["kl"]) == 0


def test_an_unsupported_logits_dtype_is_named_with_its_file(arrays, tmp_path, capsys):
    """float8 or complex logits, or a bfloat16 .npy that numpy saved as raw
    2-byte data, are refused with the file named (with shards: before any
    is scored), not by the kernel with no file named."""
    torch = pytest.importorskip("torch")
    z, r, t = arrays
    (tmp_path / "l").mkdir()
    (tmp_path / "t").mkdir()
    np.save(tmp_path / "l" / "part-0.npy", z)
    torch.save(torch.from_numpy(z).to(torch.float8_e4m3fn), tmp_path / "l" / "part-1.pt")
    for i in range(2):
        np.save(tmp_path / "t" / f"part-{i}.npy", t)
    err = main_error(capsys, "score", tmp_path / "l", tmp_path / "t")
    assert "shard 2 of 2" in err and "part-1.pt must hold float logits" in err and "float8_e4m3fn" in err
    np.save(tmp_path / "v2.npy", z.astype(np.float16).view(np.void(2).dtype))
    np.save(tmp_path / "t.npy", t)
    err = main_error(capsys, "compare", tmp_path / "l" / "part-0.npy", tmp_path / "t.npy", "--reference",
                     tmp_path / "v2.npy")
    assert "v2.npy must hold float logits" in err and "2-byte raw data" in err


def test_chunks_count_the_reference_bytes_at_its_dtype(arrays):
    """--chunk-mb bounds the logits and the reference read together, each at
    its own size: float16 logits with a float64 reference take 10 bytes a
    logit, not twice the logits' 2 (which read 2.5 times --chunk-mb)."""
    from lmmetrics.cli.common import _pieces

    rng = np.random.default_rng(2)
    z = rng.standard_normal((64, 100)).astype(np.float16)
    ref = rng.standard_normal((64, 100))
    t = rng.integers(0, 100, 64)
    for shift, shape in ((False, (64, 100)), (True, (4, 16, 100))):
        args = argparse.Namespace(chunk_mb=8000 / 2 ** 20, shift=shift, quiet=True, command="compare")
        pieces = list(_pieces(z.reshape(shape), ref.reshape(shape), t.reshape(shape[:-1]), args))
        assert len(pieces) > 1
        assert all(zc.nbytes + rc.nbytes <= 8000 for zc, rc, _, _ in pieces)
