"""sliding_window_nll: every token after the first scored once, by the
first window that can score it (the longest context)."""

import pytest

import lmmetrics

torch = pytest.importorskip("torch")
F = torch.nn.functional


class CountingLM(torch.nn.Module):
    """A causal toy model: logits at position j depend on tokens 0..j of the
    window (a decaying sum of embeddings), so context length matters."""

    def __init__(self, V=50, d=8):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, d)
        self.out = torch.nn.Linear(d, V)
        self.windows = []

    def forward(self, x):
        self.windows.append(x.shape[1])
        h = self.emb(x)
        w = 0.7 ** torch.arange(x.shape[1], dtype=h.dtype)
        acc = torch.stack([(h[:, :j + 1] * w[:j + 1].flip(0)[None, :, None]).sum(1)
                           for j in range(x.shape[1])], 1)
        return self.out(acc) * 2


def brute_force_nll(model, ids, max_length, stride):
    """Token by token: the first window ids[b:b+L] (b = 0, stride, ...) with
    b < k <= b + L scores token k from its logits at position k - b - 1."""
    n = ids.shape[0]
    out = torch.empty(n - 1, dtype=torch.float64)
    with torch.no_grad():
        for k in range(1, n):
            b = next(b for b in range(0, n, stride) if b < k <= b + max_length)
            window = ids[b:min(b + max_length, n)]
            logits = model(window[None])[0].double()
            out[k - 1] = F.cross_entropy(logits[k - b - 1:k - b], ids[k:k + 1])
    return out


@pytest.mark.parametrize("n,max_length,stride", [(37, 8, 3), (37, 8, 8), (40, 10, 5), (5, 16, 4), (9, 2, 1)])
def test_each_token_once_with_the_longest_context(n, max_length, stride):
    model = CountingLM()
    ids = torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(n))
    got = lmmetrics.sliding_window_nll(model, ids, max_length=max_length, stride=stride)
    calls = len(model.windows)
    want = brute_force_nll(model, ids, max_length, stride)
    assert got.shape == (n - 1,)
    assert torch.allclose(got.double(), want, atol=2e-6)
    assert calls == len(range(0, max(n - 1 - max_length, 0) + stride, stride))


def test_stride_equal_to_max_length_is_disjoint_chunks():
    model = CountingLM()
    ids = torch.randint(0, 50, (30,), generator=torch.Generator().manual_seed(1))
    got = lmmetrics.sliding_window_nll(model, ids[None], max_length=10, stride=10)
    parts = []
    for a in range(0, 30, 10):
        chunk = ids[a:a + 10]
        parts.append(lmmetrics.token_nll(model(chunk[None])[0, :-1], chunk[1:]))
        if a:  # the first token of a disjoint chunk gets the previous chunk's last logits
            last = model(ids[a - 10:a][None])[0, -1:]
            parts[-1] = torch.cat([lmmetrics.token_nll(last, ids[a:a + 1]), parts[-1]])
    assert torch.allclose(got, torch.cat(parts), atol=1e-6)
    assert model.windows[:3] == [10, 10, 10]


def test_argument_errors():
    model, ids = CountingLM(), torch.arange(10)
    with pytest.raises(ValueError, match="stride"):
        lmmetrics.sliding_window_nll(model, ids, max_length=4, stride=5)
    with pytest.raises(ValueError, match="max_length"):
        lmmetrics.sliding_window_nll(model, ids, max_length=1, stride=1)
    with pytest.raises(ValueError, match="1-D"):
        lmmetrics.sliding_window_nll(model, torch.zeros(2, 5, dtype=torch.long), max_length=4, stride=2)
