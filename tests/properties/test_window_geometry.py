"""sliding_window_nll over every window geometry (hypothesis): text
lengths from 0, windows from 1, strides up to past the window (refused),
last windows shorter, texts shorter than a window, with and without a
prefix token, any batch size: token for token the peers' loops done by
hand in float64 (lm-eval's rolling windows, the transformers guide's
strided loop, the longest context), on a causal toy model whose logits
depend on every token of context and its position; the metrics with
token_bytes are those of the scored tokens."""
import math

import pytest

pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import lmmetrics  # noqa: E402
from helpers import get_rolling_token_windows, make_disjoint_window  # noqa: E402

V = 7


def model(x):
    """Causal: position j's logits hash every token up to j (float64)."""
    h = torch.zeros(x.shape[0], dtype=torch.float64)
    out = torch.empty(*x.shape, V, dtype=torch.float64)
    v = torch.arange(1, V + 1, dtype=torch.float64)
    for j in range(x.shape[1]):
        h = torch.fmod(h * 31 + x[:, j].double() + 1, 1000003.0)
        out[:, j] = torch.sin(h[:, None] * v * 0.0137) * 3
    return out


def _logprobs(window):
    return torch.log_softmax(model(torch.tensor(window)[None])[0], -1)


def hf_guide(seq, L, stride):
    """The guide's loop: labels before the previous window's end -100 (target_ids[:, :-trg_len]),
    the model's shift dropping each window's first label."""
    out, prev_end = [math.nan] * len(seq), 0
    for begin in range(0, len(seq), stride):
        end = min(begin + L, len(seq))
        trg_len = end - prev_end
        labels = list(seq[begin:end])
        for i in range(len(labels[:-trg_len])):
            labels[i] = -100
        lp = _logprobs(seq[begin:end])
        for j in range(1, len(labels)):
            if labels[j] != -100:
                out[begin + j] = -lp[j - 1, labels[j]].item()
        prev_end = end
        if end == len(seq):
            break
    return out


def lm_eval(seq, L, stride):
    """lm-eval's loglikelihood_rolling: seq[0] the prefix, context_len = L - stride + 1."""
    out = [math.nan]
    for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
            token_list=seq[1:], prefix_token=seq[0], max_seq_len=L, context_len=L - stride + 1)):
        inp = (ctx + cont)[-(L + 1):][:-1]
        lp = _logprobs(inp)[len(inp) - len(cont):]
        out += [-lp[i, c].item() for i, c in enumerate(cont)]
    return out[:len(seq)]


def max_context(seq, L, stride):
    out = [math.nan] * len(seq)
    for k in range(1, len(seq)):
        b = next(b for b in range(0, len(seq), stride) if b < k <= b + L)
        out[k] = -_logprobs(seq[b:b + L])[k - b - 1, seq[k]].item()
    return out


PEERS = {"lm-eval": lm_eval, "hf-guide": hf_guide, "max-context": max_context}


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 30), st.integers(1, 9), st.integers(1, 11), st.sampled_from(sorted(PEERS)), st.booleans(),
       st.integers(1, 4), st.integers(0, 2**31))
def test_every_geometry_token_for_token(n, L, stride, convention, prefix, batch_size, seed):
    ids = torch.randint(1, V, (n,), generator=torch.Generator().manual_seed(seed))
    kw = dict(max_length=L, stride=stride, convention=convention, batch_size=batch_size, progress=False,
              prefix_token=0 if prefix else None)
    if stride > L or (L < 2 and convention != "lm-eval"):
        with pytest.raises(ValueError, match="stride|max_length"):
            lmmetrics.sliding_window_nll(model, ids, **kw)
        return
    seq = [0] * prefix + ids.tolist()
    want = torch.tensor(PEERS[convention](seq, L, stride) if seq else [], dtype=torch.float64)[int(prefix):]
    table = torch.tensor([0, 1, 2, 3, 1, 2, 4])
    for got in (lmmetrics.sliding_window_nll(model, ids, **kw),
                lmmetrics.sliding_window_nll(model, ids, token_bytes=table, **kw)[0]):
        assert got.shape == want.shape and torch.equal(got.isnan(), want.isnan())
        assert torch.allclose(got.double().nan_to_num(), want.nan_to_num(), rtol=0, atol=1e-9)
    m = lmmetrics.sliding_window_nll(model, ids, token_bytes=table, **kw)[1]
    scored = ~want.isnan()
    b = table[ids[scored]].double()
    assert (m.tokens, m.ignored, m.bytes) == (int(scored.sum()), n - int(scored.sum()), int(b.sum()))
    if m.tokens:
        assert m.nll_sum == pytest.approx(want[scored].sum().item(), rel=1e-12)
        bpb = (want[scored] * (b > 0)).sum().item() / (math.log(2) * b.sum().item()) if b.sum() else math.inf
        assert m.bits_per_byte == pytest.approx(bpb, rel=1e-12)
