"""Hugging Face outputs and labels as they come, and lm-eval's multiple-choice
``loglikelihood``, on a tiny LlamaForCausalLM with random weights: the loss
transformers computes from ``labels``, and a float64 torch re-implementation
of lm-evaluation-harness's ``_loglikelihood_tokens`` arithmetic."""
import numpy as np
import pytest

pytestmark = pytest.mark.peers  # against a heavy peer's own code: pytest -m peers

import lmmetrics
from lmmetrics import _engine
from lmmetrics._engine import inputs as _inputs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
F = torch.nn.functional
V = 300


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger logits than the tiny init gives: a sharper, more telling distribution
        m.lm_head.weight.mul_(40)
    return m


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, 12), generator=g)
    labels = ids.clone()
    labels[0, 9:] = -100   # right padding
    labels[1, :3] = -100   # an unscored prefix
    return ids, labels


def test_shift_true_gives_the_transformers_loss(model, batch):
    ids, labels = batch
    out = model(ids, labels=labels)
    want = out.loss.item()
    assert lmmetrics.cross_entropy(out, labels, shift=True) == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert lmmetrics.cross_entropy(out.logits, labels, shift=True) == pytest.approx(want, rel=1e-6, abs=1e-6)
    # unshifted labels without shift=True score every position against its own token: another number
    assert abs(lmmetrics.cross_entropy(out.logits, labels) - want) > 1e-3
    ev = lmmetrics.Evaluator(shift=True)
    ev.update(out, labels)
    assert ev.compute().loss == pytest.approx(want, rel=1e-6)
    assert lmmetrics.evaluate(out, labels, shift=True).loss == pytest.approx(want, rel=1e-6)


def test_shift_reads_the_logits_in_place(monkeypatch):
    seen = []
    as_logits = _inputs.as_logits
    monkeypatch.setattr(_inputs, "as_logits", lambda *a: seen.append(as_logits(*a)) or seen[-1])
    z = np.random.default_rng(0).standard_normal((2, 6, 40)).astype(np.float32)
    t = np.random.default_rng(1).integers(0, 40, (2, 6))
    x = torch.from_numpy(z.copy())
    for logits, ptr in ((z, z.ctypes.data), (x, x.data_ptr())):
        seen.clear()
        got = lmmetrics.token_nll(logits, t, shift=True)
        assert seen[0].ptr == ptr and seen[0].n_rows == 10  # the original buffer, last position dropped
        np.testing.assert_array_equal(np.asarray(got), lmmetrics.token_nll(z[:, :-1], t[:, 1:]))
    view = _engine.shifted(z, t)[0]
    assert np.shares_memory(view, z) and view.shape == (2, 5, 40)
    assert _engine.shifted(x, t)[0].data_ptr() == x.data_ptr()


def test_shift_errors():
    z = np.zeros((5, 10), np.float32)
    with pytest.raises(ValueError, match="time axis"):
        lmmetrics.cross_entropy(z[0], np.int64(1), shift=True)
    with pytest.raises(ValueError, match="unshifted"):
        lmmetrics.cross_entropy(z, np.zeros(4, np.int64), shift=True)
    with pytest.raises(ValueError, match="reference_logits shape"):
        lmmetrics.compare(z, np.zeros(5, np.int64), reference_logits=z[0], shift=True)
    with pytest.raises(TypeError, match="shift"):
        lmmetrics.cross_entropy(z, np.zeros(5, np.int64), shift=1)


def test_every_function_takes_a_model_output(model, batch):
    ids, labels = batch
    out = model(ids)
    z = out.logits.detach()
    t = ids.roll(-1, 1)
    tb = np.arange(V) % 4
    for f, kw in ((lmmetrics.token_nll, {}), (lmmetrics.cross_entropy, {}), (lmmetrics.perplexity, {}),
                  (lmmetrics.bits_per_token, {}), (lmmetrics.bits_per_character, {}),
                  (lmmetrics.loglikelihood, {})):
        a, b = f(out, t, shift=False, **kw), f(z, t, **kw)
        for x, y in zip(a if isinstance(a, tuple) else [a], b if isinstance(b, tuple) else [b]):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        with pytest.raises(ValueError, match=r"come from a model output \(CausalLMOutputWithPast\): say shift=True"):
            f(out, t, **kw)  # a model output: shift must be said
    assert lmmetrics.bits_per_byte(out, t, tb, shift=False) == lmmetrics.bits_per_byte(z, t, tb)
    np.testing.assert_array_equal(lmmetrics.token_entropy(out).numpy(), lmmetrics.token_entropy(z).numpy())
    r = z + 0.1
    assert lmmetrics.kl_divergence(out, reference_logits=r) == lmmetrics.kl_divergence(z, reference_logits=r)
    assert (lmmetrics.compare(out, t, reference_logits=out, shift=False).as_dict()
            == lmmetrics.compare(z, t, reference_logits=z).as_dict())
    for call in (lambda: lmmetrics.compare(out, t, reference_logits=out), lambda: lmmetrics.evaluate(out, t),
                 lambda: lmmetrics.Evaluator().update(out, t), lambda: lmmetrics.bits_per_byte(out, t, tb)):
        with pytest.raises(ValueError, match="say shift=True .* or shift=False"):
            call()
    # update() takes the batch only: the error says where shift goes
    with pytest.raises(ValueError, match="Evaluator and the torchmetrics classes take shift= in their "
                                         "constructor"):
        lmmetrics.Evaluator().update(out, t)


def test_an_encoder_decoder_output_says_its_labels_take_shift_false():
    # T5's decoder reads its labels shifted right: its logits at t predict labels[t]. The generic
    # message ("shift=True for Hugging Face labels") led to 4.9503 for the model's own loss 5.5103
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0)).eval()
    x, y = torch.randint(1, 97, (2, 7)), torch.randint(1, 97, (2, 5))
    y[0, 3:] = -100
    with torch.no_grad():
        out = t5(input_ids=x, labels=y)
    for call in (lambda: lmmetrics.cross_entropy(out, y), lambda: lmmetrics.Evaluator().update(out, y)):
        with pytest.raises(ValueError, match=r"encoder-decoder model's output \(Seq2SeqLMOutput\).*say "
                                             r"shift=False when the targets are its labels"):
            call()
    assert lmmetrics.cross_entropy(out, y, shift=False) == pytest.approx(out.loss.item(), rel=1e-6)


def test_the_off_by_one_shape_error_says_how_to_align(model, batch):
    ids, labels = batch
    z = model(ids).logits.detach()
    with pytest.raises(ValueError, match=r"one position shorter. .*logits\[..., :-1, :\].*shift=True"):
        lmmetrics.perplexity(z, ids[:, 1:])
    with pytest.raises(ValueError, match=r"one position longer. Pass targets\[..., 1:\]"):
        lmmetrics.perplexity(z[:, :-1], ids)
    # the commonest mistake, unshifted labels with the model's output, is an error, not 525.56 for 526.08
    with pytest.raises(ValueError, match="say shift=True"):
        lmmetrics.perplexity(model(ids), ids)
    assert lmmetrics.perplexity(model(ids), ids, shift=True) == lmmetrics.perplexity(z[:, :-1], ids[:, 1:])


def test_no_gradient_flows(model, batch):
    ids, labels = batch
    out = model(ids)
    assert out.logits.requires_grad
    nll = lmmetrics.token_nll(out, labels, shift=True)
    assert isinstance(nll, torch.Tensor) and not nll.requires_grad and nll.grad_fn is None
    assert isinstance(lmmetrics.cross_entropy(out, labels, shift=True), float)


def test_ignore_index_none_ignores_negative_targets_only():
    rng = np.random.default_rng(3)
    z = rng.standard_normal((20, 50)).astype(np.float32)
    t = rng.integers(0, 50, 20)
    t[:4] = -1
    t[4:6] = 0
    got = lmmetrics.token_nll(z, t, ignore_index=None)
    want = F.cross_entropy(torch.from_numpy(z).double(), torch.from_numpy(t).clamp(min=0),
                           reduction="none").numpy()
    assert (got[:4] == 0).all()
    np.testing.assert_allclose(got[4:], want[4:], rtol=1e-6)  # target 0 is counted
    assert lmmetrics.evaluate(z, t, ignore_index=None).tokens == 16
    with pytest.raises(TypeError, match="ignore_index"):
        lmmetrics.token_nll(z, t, ignore_index=1.5)


# -- lm-eval's loglikelihood ------------------------------------------------------------------------

def lm_eval_loglikelihood(model, requests):
    """lm-evaluation-harness's HFLM._loglikelihood_tokens arithmetic in float64
    for a causal model: inputs (context + continuation)[:-1], right-padded to
    one batch; per request the last len(continuation) positions of its own
    length, log_softmax, greedy = (argmax == continuation).all(), logprob =
    sum of the gathered log-probabilities."""
    inps = [torch.tensor((ctx + cont)[:-1]) for ctx, cont in requests]
    width = max(len(x) for x in inps)
    padded = torch.stack([F.pad(x, (0, width - len(x))) for x in inps])
    with torch.no_grad():
        logits = F.log_softmax(model(padded).logits.double(), dim=-1)
    answers = []
    for (ctx, cont), inp, lg in zip(requests, inps, logits):
        inplen, contlen = len(inp), len(cont)
        lg = lg[inplen - contlen:inplen].unsqueeze(0)
        cont_toks = torch.tensor(cont).unsqueeze(0)
        max_equal = bool((lg.argmax(dim=-1) == cont_toks).all())
        lp = torch.gather(lg, 2, cont_toks.unsqueeze(-1)).squeeze(-1)
        answers.append((float(lp.sum()), max_equal))
    return answers


def greedy_continuation(model, ctx, n):
    ids = list(ctx)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(ctx):]


def test_loglikelihood_matches_lm_eval(model):
    g = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
    ctx0 = rand(6)
    requests = [(ctx0, rand(3)), (rand(4), rand(1)), (ctx0, greedy_continuation(model, ctx0, 3)),
                (rand(9), rand(5)), ([7, 8], greedy_continuation(model, [7, 8], 1))]
    want = lm_eval_loglikelihood(model, requests)
    # the same batch as lmmetrics takes it: (context + continuation) right-padded, labels -100
    # on the context and the padding, shift=True
    width = max(len(c) + len(k) for c, k in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.int64)
    labels = torch.full_like(ids, -100)
    for i, (ctx, cont) in enumerate(requests):
        ids[i, :len(ctx) + len(cont)] = torch.tensor(ctx + cont)
        labels[i, len(ctx):len(ctx) + len(cont)] = torch.tensor(cont)
    with torch.no_grad():
        out = model(ids)
    logprob, greedy = lmmetrics.loglikelihood(out, labels, shift=True)
    assert logprob.dtype == torch.float64 and greedy.dtype == torch.bool and logprob.shape == (5,)
    assert [bool(x) for x in greedy] == [w[1] for w in want]
    assert [w[1] for w in want] == [False, False, True, False, True]  # both outcomes are exercised
    np.testing.assert_allclose(logprob.numpy(), [w[0] for w in want], rtol=1e-6, atol=1e-6)
    # numpy in, numpy out; one sequence as (T, V) gives scalars
    lp_np, gr_np = lmmetrics.loglikelihood(out.logits.numpy(), labels.numpy(), shift=True)
    assert lp_np.dtype == np.float64 and gr_np.dtype == np.bool_
    np.testing.assert_array_equal(lp_np, logprob.numpy())
    lp0, gr0 = lmmetrics.loglikelihood(out.logits[2].numpy(), labels[2].numpy(), shift=True)
    assert np.ndim(lp0) == 0 and lp0 == pytest.approx(want[2][0], rel=1e-6) and bool(gr0)


def test_loglikelihood_of_a_sequence_with_nothing_counted():
    z = np.random.default_rng(0).standard_normal((2, 4, 10)).astype(np.float32)
    t = np.full((2, 4), -100)
    t[1, 2] = 3
    lp, gr = lmmetrics.loglikelihood(z, t)
    assert lp[0] == 0.0 and not np.signbit(lp[0]) and gr[0]
    row = z[1, 2].astype(np.float64)
    assert lp[1] == pytest.approx(row[3] - np.log(np.exp(row).sum()), rel=1e-6)
    with pytest.raises(ValueError, match="time axis"):
        lmmetrics.loglikelihood(z[0, 0], np.int64(2))
