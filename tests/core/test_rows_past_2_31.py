"""Rows and buffers with more than 2^31 elements (bfloat16, 4.3 GB).

One buffer of 2^31 + 18 bfloat16 values is read as a single row of
2^31 + 17 elements (element offsets past 2^31 inside a row) and as two rows
of 2^30 + 9 (the second row starts past 2^31 bytes). The maximum sits near
the end, beyond 2^31, with a tie further on (argmax is the lowest index).
The reference is a chunked float64 pass (online log-sum-exp) over the
stored values. Needs about 7 GiB of free memory and a minute of CPU;
skipped with the reason when /proc/meminfo says less is available.
"""
import math

import numpy as np
import pytest

import lmmetrics

ml_dtypes = pytest.importorskip("ml_dtypes")

N = 2**31 + 18           # buffer length
V1 = 2**31 + 17          # the single row
V2 = N // 2              # two rows of 2^30 + 9
TOP = 40.0               # the maximum (others are |z| < 32)
NEED_GIB = 7.0
CHUNK = 1 << 24


def _available_gib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


_avail = _available_gib()
pytestmark = pytest.mark.skipif(
    _avail is None or _avail < NEED_GIB,
    reason=f"needs {NEED_GIB} GiB of available memory for a 4.3 GB bfloat16 buffer and its "
           f"float64 reference (MemAvailable: {_avail if _avail is None else round(_avail, 1)} GiB)")


def _to_f64(chunk_bf16):
    """bfloat16 -> float64 exactly (the upper half of a float32)."""
    bits = chunk_bf16.view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32).astype(np.float64)


# every bfloat16 value, by bit pattern, in float64
with np.errstate(invalid="ignore"):
    VALUES = _to_f64(np.arange(65536, dtype=np.uint32).astype(np.uint16))


def histogram(flat, a, b):
    """How often each bfloat16 bit pattern occurs in flat[a:b] (chunked, two threads)."""
    from concurrent.futures import ThreadPoolExecutor

    bits = flat.view(np.uint16)
    spans = [(c, min(c + CHUNK, b)) for c in range(a, b, CHUNK)]
    with ThreadPoolExecutor(2) as ex:
        parts = ex.map(lambda sp: np.bincount(bits[sp[0]:sp[1]], minlength=65536), spans)
        return sum(parts)


def ref_row(flat, a, b, hist):
    """(logsumexp, entropy, argmax - a) of flat[a:b] in float64 from its
    histogram: sum over distinct values v of count(v) e^(v - m)."""
    h = hist.astype(np.float64)
    keep = (h > 0) & ~np.isnan(VALUES)
    v, h = VALUES[keep], h[keep]
    m = float(v.max())
    d = v - m
    e = h * np.exp(d)
    s = math.fsum(e.tolist())
    u = math.fsum((e * d).tolist())
    pattern = np.nonzero(VALUES == m)[0].astype(np.uint16)
    bits = flat.view(np.uint16)
    am = -1
    for c in range(a, b, CHUNK):
        chunk = bits[c:min(c + CHUNK, b)]
        hit = chunk == pattern[0]
        for p in pattern[1:]:
            hit |= chunk == p
        if hit.any():
            am = c + int(np.argmax(hit)) - a
            break
    return m + math.log(s), math.log(s) - u / s, am


@pytest.fixture(scope="module")
def big():
    rng = np.random.default_rng(2031)
    block = (rng.standard_normal(CHUNK - 3, dtype=np.float32) * 3).clip(-30, 30).astype(ml_dtypes.bfloat16)
    buf = np.empty(N, ml_dtypes.bfloat16)
    raw, braw = buf.view(np.uint16), block.view(np.uint16)  # plain copies of the bits
    k = N // block.size
    raw[:k * block.size].reshape(k, block.size)[:] = braw
    raw[k * block.size:] = braw[:N - k * block.size]
    # the single row: max at V1 - 5 (beyond 2^31), a tie at V1 - 2, a runner-up early
    buf[V1 - 5] = TOP
    buf[V1 - 2] = TOP
    buf[11] = TOP - 1
    # the second of the two rows: its max the buffer's last element, outside the single row
    buf[N - 1] = TOP + 2
    return buf


def test_more_than_2_31_elements(big):
    row = big[:V1].reshape(1, V1)
    h0, h1, h2 = histogram(big, 0, V2), histogram(big, V2, V1), histogram(big, V1, N)
    lse, ent, am = ref_row(big, 0, V1, h0 + h1)
    assert am == V1 - 5 and am > 2**31
    for t in (V1 - 5, 2**31 + 1, V1 - 1, 7):
        want = lse - float(_to_f64(big[t:t + 1])[0])
        got = float(lmmetrics.token_nll(row, np.array([t]), num_threads=2)[0])
        assert abs(got - want) <= 2e-6 + 1e-6 * abs(want), (t, got, want)
    m = lmmetrics.evaluate(row, np.array([V1 - 5]), num_threads=2)
    assert m.tokens == 1 and m.accuracy == 1.0
    assert abs(m.loss - (lse - TOP)) <= 2e-6
    assert abs(m.entropy - ent) <= 2e-6 + 1e-6 * ent, (m.entropy, ent)
    assert lmmetrics.evaluate(row, np.array([V1 - 2]), num_threads=2).accuracy == 0.0  # the later tie
    assert lmmetrics.evaluate(row, np.array([11]), num_threads=2).accuracy == 0.0
    with pytest.raises(ValueError):
        lmmetrics.token_nll(row, np.array([V1]))
    # two rows, the second starting past 2^31 bytes and ending past 2^31 elements
    two = big.reshape(2, V2)
    refs = [ref_row(big, 0, V2, h0), ref_row(big, V2, N, h1 + h2)]
    assert refs[0][2] == 11 and refs[1][2] == V2 - 1
    t = np.array([3, V2 - 1])
    got = lmmetrics.token_nll(two, t, num_threads=2).astype(np.float64)
    for r in range(2):
        want = refs[r][0] - float(_to_f64(big[r * V2 + t[r]:r * V2 + t[r] + 1])[0])
        assert abs(got[r] - want) <= 2e-6 + 1e-6 * abs(want), (r, got[r], want)
    ent2 = lmmetrics.token_entropy(two, num_threads=2).astype(np.float64)
    for r in range(2):
        assert abs(ent2[r] - refs[r][1]) <= 2e-6 + 1e-6 * refs[r][1], (r, ent2[r], refs[r][1])
    m = lmmetrics.evaluate(two, np.array([11, V2 - 1]), num_threads=2)
    assert m.accuracy == 1.0
    assert lmmetrics.evaluate(two, np.array([11, V1 - 5 - V2]), num_threads=2).accuracy == 0.5
