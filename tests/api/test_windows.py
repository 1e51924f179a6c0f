"""sliding_window_nll against the peers' own loops, token for token, on a
tiny random Llama: lm-evaluation-harness's rolling windows (its own window
functions when lm_eval is installed), the transformers guide's strided loop
(the model's own labels=-100 loss), and the longest-context schedule."""
import math
import types

import numpy as np
import pytest

import lmmetrics

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
F = torch.nn.functional

from helpers import get_rolling_token_windows, make_disjoint_window  # noqa: E402

V = 300


@pytest.fixture(scope="module")
def llama():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only loses time to threads
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    yield transformers.LlamaForCausalLM(cfg).float().eval()
    torch.set_num_threads(threads)


def text(n, seed=0):
    return torch.randint(1, V, (n,), generator=torch.Generator().manual_seed(seed))


def lm_eval_rolling(model, ids, max_length, prefix_token, context_len=1):
    """lm-eval's HFLM.loglikelihood_rolling for one document: disjoint
    rolling windows; each is scored as _loglikelihood_tokens scores a
    (context, continuation) pair: the model reads
    (context + continuation)[-(max_length + 1):][:-1] and the last
    len(continuation) log-softmax rows give the continuation's log-probs.
    Returns -log p of each token of ids (float64) and the windows' inputs."""
    token_list = ids.tolist()
    out, inputs = [], []
    for context, cont in map(make_disjoint_window, get_rolling_token_windows(
            token_list=token_list, prefix_token=prefix_token, max_seq_len=max_length, context_len=context_len)):
        inp = torch.tensor((context + cont)[-(max_length + 1):][:-1])
        inputs.append(inp.tolist())
        with torch.no_grad():
            logits = model(inp[None]).logits[0]
        logprobs = F.log_softmax(logits.double(), -1)[len(inp) - len(cont):]
        out.append(-logprobs.gather(1, torch.tensor(cont)[:, None])[:, 0])
    nll = torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)
    assert nll.shape[0] == len(token_list)  # every token predicted once
    return nll, inputs


def guide_loop(model, encodings, max_length, stride):
    """The transformers guide's loop, literally (perplexity.md), plus the
    per-token NLL from the same call's logits (label shift by one, -100
    ignored). Returns per-token NLL (NaN where never scored), the windows'
    (begin, loss, scored positions), the guide's ppl and n_tokens."""
    seq_len = encodings.size(1)
    per_token = torch.full((seq_len,), float("nan"), dtype=torch.float64)
    nll_sum, n_tokens, prev_end_loc, windows = 0.0, 0, 0, []
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = encodings[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            outputs = model(input_ids, labels=target_ids)
            neg_log_likelihood = outputs.loss
        num_valid_tokens = (target_ids != -100).sum().item()
        batch_size = target_ids.size(0)
        num_loss_tokens = num_valid_tokens - batch_size
        nll_sum += neg_log_likelihood * num_loss_tokens
        n_tokens += num_loss_tokens
        labels = target_ids[0, 1:]
        logprobs = F.log_softmax(outputs.logits[0, :-1].double(), -1)
        scored = (labels != -100).nonzero()[:, 0]
        per_token[begin_loc + 1 + scored] = -logprobs[scored, labels[scored]]
        windows.append((begin_loc, float(neg_log_likelihood), (begin_loc + 1 + scored).tolist()))
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return per_token, windows, math.exp(float(nll_sum) / n_tokens), n_tokens


class Recorder(torch.nn.Module):
    """Wraps a model and records the windows it reads."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, []

    def forward(self, x):
        self.calls.append(x.clone())
        return self.model(x)


def same(got, want, atol=1e-6):
    assert got.shape == want.shape
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    diff = (got.double()[ok] - want[ok]).abs().max().item() if ok.any() else 0.0
    assert diff <= atol, diff
    return diff


CASES = [(50, 16, 16), (50, 16, 5), (29, 8, 3), (10, 16, 16), (10, 16, 4), (16, 16, 16),
         (17, 16, 16), (33, 16, 16), (9, 2, 1)]


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("n,max_length,stride", CASES)
def test_lm_eval_rolling_token_for_token(llama, n, max_length, stride, batch_size):
    ids = text(n, seed=n + max_length)
    eot = 0
    want, inputs = lm_eval_rolling(llama, ids, max_length, eot, context_len=max_length - stride + 1)
    model = Recorder(llama)
    got = lmmetrics.sliding_window_nll(model, ids, max_length=max_length, stride=stride, convention="lm-eval",
                                       prefix_token=eot, batch_size=batch_size)
    same(got, want)
    # the same windows, batch_size at a time
    assert sum(c.shape[0] for c in model.calls) == len(inputs)
    assert all(c.shape[0] <= batch_size for c in model.calls)
    flat = [row for c in model.calls for row in c]
    for row, inp in zip(flat, inputs):
        assert row[:len(inp)].tolist() == inp


def test_lm_eval_default_is_disjoint_windows_and_bos_as_prefix(llama):
    """stride defaults to max_length (lm-eval's context_len=1); without
    prefix_token the first token is the prefix: the same numbers as lm-eval
    on ids[1:] with prefix ids[0], and NaN for ids[0]."""
    ids = text(45, seed=3)
    want, _ = lm_eval_rolling(llama, ids[1:], 16, int(ids[0]))
    got = lmmetrics.sliding_window_nll(llama, ids, max_length=16)
    assert math.isnan(got[0])
    same(got[1:], want)
    assert int((~got.isnan()).sum()) == 44


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("n,max_length,stride", CASES)
def test_hf_guide_token_for_token(llama, n, max_length, stride, batch_size):
    ids = text(n, seed=n * 7 + stride)
    want, windows, guide_ppl, guide_n = guide_loop(llama, ids[None], max_length, stride)
    got = lmmetrics.sliding_window_nll(llama, ids[None], max_length=max_length, stride=stride,
                                       convention="hf-guide", batch_size=batch_size)
    same(got, want)
    # the model's own loss over each window's scored tokens
    for _, loss, pos in windows:
        if pos:
            assert abs(got[pos].double().mean().item() - loss) < 1e-6
        else:  # a last window of one token: the guide's loss is NaN, and so is its ppl (NaN * 0)
            assert math.isnan(loss) and math.isnan(guide_ppl)
    # the tokens the guide never scores: token 0 and, when stride == max_length,
    # each later window's first token
    never = {0} | ({b for b, _, _ in windows[1:]} if stride == max_length else set())
    assert set(torch.isnan(got).nonzero()[:, 0].tolist()) == never
    # the guide's count is one short per later window when stride < max_length
    scored = int((~got.isnan()).sum())
    assert guide_n == scored - (len(windows) - 1 if stride < max_length else 0)
    if stride == max_length and not math.isnan(guide_ppl):
        assert abs(guide_ppl - got.double().nanmean().exp().item()) < 1e-5 * guide_ppl


def max_context_brute_force(model, ids, max_length, stride):
    """Token by token: the first window ids[b:b+L] (b = 0, stride, ...) with
    b < k <= b + L scores token k from its logits at position k - b - 1."""
    n = ids.shape[0]
    out = torch.full((n,), float("nan"), dtype=torch.float64)
    with torch.no_grad():
        for k in range(1, n):
            b = next(b for b in range(0, n, stride) if b < k <= b + max_length)
            logits = model(ids[b:min(b + max_length, n)][None]).logits[0].double()
            out[k] = F.cross_entropy(logits[k - b - 1:k - b], ids[k:k + 1])
    return out


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("n,max_length,stride", [(37, 8, 3), (37, 8, 8), (10, 16, 4), (9, 2, 1)])
def test_max_context_each_token_once_with_the_longest_context(llama, n, max_length, stride, batch_size):
    ids = text(n, seed=n)
    got = lmmetrics.sliding_window_nll(llama, ids, max_length=max_length, stride=stride,
                                       convention="max-context", batch_size=batch_size)
    same(got, max_context_brute_force(llama, ids, max_length, stride))


def test_conventions_differ_where_documented(llama):
    """stride == max_length: max-context and lm-eval (prefix = ids[0]) agree
    on every full window and differ on the last, partial one (lm-eval gives it
    a full window of context); hf-guide leaves each later window's first
    token unscored."""
    ids = text(40, seed=11)
    lm = lmmetrics.sliding_window_nll(llama, ids, max_length=16, convention="lm-eval")
    mc = lmmetrics.sliding_window_nll(llama, ids, max_length=16, convention="max-context")
    hf = lmmetrics.sliding_window_nll(llama, ids, max_length=16, convention="hf-guide")
    assert torch.allclose(lm[1:33], mc[1:33], atol=1e-6)
    assert (lm[33:] - mc[33:]).abs().max() > 1e-3
    assert torch.isnan(hf[[0, 16, 32]]).all() and int(hf.isnan().sum()) == 3


def test_prefix_token_scores_the_first_token(llama):
    ids = text(20, seed=5)
    for conv in ("lm-eval", "hf-guide", "max-context"):
        got = lmmetrics.sliding_window_nll(llama, ids, max_length=8, stride=4, convention=conv, prefix_token=0)
        assert got.shape == (20,) and not math.isnan(got[0])
        with torch.no_grad():
            first = -F.log_softmax(llama(torch.tensor([[0]])).logits[0, 0].double(), -1)[ids[0]]
        assert abs(got[0].item() - first.item()) < 1e-6


def test_short_inputs_and_errors(llama):
    assert lmmetrics.sliding_window_nll(llama, torch.tensor([5]), max_length=4).isnan().all()
    assert lmmetrics.sliding_window_nll(llama, torch.zeros(0, dtype=torch.long), max_length=4).shape == (0,)
    ids = torch.arange(10)
    with pytest.raises(ValueError, match="stride"):
        lmmetrics.sliding_window_nll(llama, ids, max_length=4, stride=5)
    with pytest.raises(ValueError, match="max_length"):
        lmmetrics.sliding_window_nll(llama, ids, max_length=1, stride=1, convention="hf-guide")
    with pytest.raises(ValueError, match="1-D"):
        lmmetrics.sliding_window_nll(llama, torch.zeros(2, 5, dtype=torch.long), max_length=4, stride=2)
    with pytest.raises(ValueError, match="convention"):
        lmmetrics.sliding_window_nll(llama, ids, max_length=4, convention="guide")
    with pytest.raises(ValueError, match="batch_size"):
        lmmetrics.sliding_window_nll(llama, ids, max_length=4, batch_size=0)


@pytest.mark.parametrize("prefix, error, said", [
    (True, TypeError, "prefix_token must be a token id, got True: pass the id itself"),
    (np.True_, TypeError, "prefix_token must be a token id"),
    (torch.tensor(True), TypeError, "prefix_token must be an integer token id, got tensor\\(True\\), a boolean"),
    (1.7, TypeError, "prefix_token must be an integer token id, got 1.7"),
    ("3", TypeError, "prefix_token must be an integer token id"),
    (-1, ValueError, "prefix_token must be a token id \\(>= 0\\), got -1"),
])
def test_prefix_token_is_a_token_id_never_a_guess(prefix, error, said):
    """prefix_token=True (text_metrics' bos=True habit) was token 1, 1.7 token 1, "3" token 3, and
    torch.tensor(True) token 1: another prefix than meant, silently."""
    def model(x):
        return torch.zeros(*x.shape, 16)

    with pytest.raises(error, match=said):
        lmmetrics.sliding_window_nll(model, torch.arange(2, 8), max_length=4, prefix_token=prefix)
    for fine in (np.int64(3), torch.tensor(3), 0):
        nll = lmmetrics.sliding_window_nll(model, torch.arange(2, 8), max_length=4, prefix_token=fine)
        assert int((~nll.isnan()).sum()) == 6


def test_input_ids_must_be_integers():
    with pytest.raises(TypeError, match="input_ids must hold integer token ids, got torch.float32"):
        lmmetrics.sliding_window_nll(lambda x: torch.zeros(*x.shape, 16), torch.tensor([1.0, 2.7, 3.0]),
                                     max_length=2)


@pytest.mark.parametrize("dtype", [np.uint16, np.int16, np.uint8, np.int32])
def test_ids_of_any_integer_dtype_give_the_same_numbers(llama, dtype):
    """uint16 ids (nanoGPT's token files) and int16 ones reached the model's embedding as they were
    ("Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int"),
    and uint8 ids could not take a prefix_token past 255 ("value cannot be converted to type uint8")."""
    ids = text(40, seed=2) % 250  # (uint8's range)
    want = lmmetrics.sliding_window_nll(llama, ids, max_length=16, stride=5, prefix_token=299)
    for given in (ids.numpy().astype(dtype), torch.from_numpy(ids.numpy().astype(dtype))):
        got = lmmetrics.sliding_window_nll(llama, given, max_length=16, stride=5, prefix_token=299)
        assert torch.equal(got, want)


def test_no_ids_is_an_empty_result(llama):
    """tokenizer("").input_ids is [], which torch reads as float32: it was refused as
    "input_ids must hold integer token ids, got torch.float32"."""
    for empty in ([], np.array([]), torch.tensor([]), [[]]):
        assert lmmetrics.sliding_window_nll(llama, empty, max_length=4, prefix_token=0).shape == (0,)


@pytest.mark.parametrize("convention", ["lm-eval", "hf-guide", "max-context"])
def test_negative_ids_are_refused_naming_the_first(llama, convention):
    """Labels passed for ids: a last -100 is a target the model never reads, and the lm-eval
    windows gave it an NLL of 0.0 (in nll.nansum() and nll.nanmean(), and a token fewer in
    the metrics, silently)."""
    ids = torch.tensor([5, 6, 7, 8, 9, -100])
    with pytest.raises(ValueError, match=r"input_ids\[5\] is -100: token ids are >= 0"):
        lmmetrics.sliding_window_nll(llama, ids, max_length=4, prefix_token=0, convention=convention)
    with pytest.raises(ValueError, match=r"input_ids\[1\] is -1"):
        lmmetrics.sliding_window_nll(llama, [3, -1, 4, -1], max_length=4, convention=convention,
                                     token_bytes=torch.ones(V, dtype=torch.long))


def test_ids_past_the_models_embedding_are_named(llama):
    """An id past the input embedding was torch's "index out of range in self" (or, as the last
    token, which the model never reads, a target error at a position of a window)."""
    ids = text(20, seed=4)
    for k in (5, 19):
        bad = ids.clone()
        bad[k] = V
        with pytest.raises(ValueError, match=rf"input_ids\[{k}\] is {V}, but the model's input embedding "
                                             rf"holds {V} tokens"):
            lmmetrics.sliding_window_nll(llama, bad, max_length=8, prefix_token=0)
    with pytest.raises(ValueError, match=rf"prefix_token is {V + 7}, but the model's input embedding"):
        lmmetrics.sliding_window_nll(llama, ids, max_length=8, prefix_token=V + 7)


@pytest.mark.parametrize("returned, said", [
    (lambda x, lg: (lg,), "returned a tuple"),
    (lambda x, lg: lg.numpy(), "returned a numpy.ndarray"),
    (lambda x, lg: {"logits": lg}, "returned a dict"),
    (lambda x, lg: types.SimpleNamespace(logits=None), "whose .logits is None"),
])
def test_a_model_that_returns_no_logits_tensor_is_named(returned, said):
    def model(x):
        return returned(x, torch.zeros(*x.shape, 11))

    with pytest.raises(TypeError, match=said + ".*torch.Tensor of logits"):
        lmmetrics.sliding_window_nll(model, torch.arange(10), max_length=4)


def test_progress_bar_counts_the_windows_and_can_be_turned_off(monkeypatch):
    tqdm_auto = pytest.importorskip("tqdm.auto")
    bars = []

    class Recorder:
        def __init__(self, total, **kw):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, k):
            self.n += k

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.closed = True

    monkeypatch.setattr(tqdm_auto, "tqdm", Recorder)
    model = lambda x: torch.zeros(*x.shape, 11)  # noqa: E731
    lmmetrics.sliding_window_nll(model, torch.arange(10), max_length=4, batch_size=2)
    assert len(bars) == 1 and bars[0].n == bars[0].total >= 3 and bars[0].closed
    lmmetrics.sliding_window_nll(model, torch.arange(10), max_length=4, progress=False)
    assert len(bars) == 1
