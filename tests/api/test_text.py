"""text_metrics on a tiny random Llama with a tokenizer trained here: every
value against a float64 computation from the model's own logits (one
forward per text; for windows, lm-evaluation-harness's rolling windows
built by its own functions, each read by the model), the per-text
perplexities and their mean against Hugging Face evaluate's "perplexity"
arithmetic, and the BOS choice."""
import math

import numpy as np
import pytest

import lmmetrics

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

F = torch.nn.functional
LN2 = math.log(2)
CORPUS = "naïve café 日本語 🙂 the cat sat on the mat. a dog ran in the park! " * 10
TEXTS = ["the cat sat on the mat. naïve café 🙂", "a dog ran in the park! 日本語 " * 3, "on the mat.",
         "the " * 40]

from helpers import get_rolling_token_windows, make_disjoint_window  # noqa: E402


def _raw_tokenizer():
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tk.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tk


@pytest.fixture(scope="module")
def raw():
    return _raw_tokenizer()


@pytest.fixture(scope="module")
def tokenizer(raw):
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only loses time to threads
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper distributions than the tiny init's nearly uniform ones
        m.lm_head.weight.mul_(10)
    yield m
    torch.set_num_threads(threads)


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def rows(model, seq, first):
    """float64 per-token values of seq[first:] from one forward over seq:
    nll, entropy, whether the argmax is the target."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].double()
    logp = F.log_softmax(logits[first - 1:-1], -1)
    tgt = torch.tensor(seq[first:])
    return (-logp.gather(1, tgt[:, None])[:, 0], -(logp.exp() * logp).sum(-1),
            (logits[first - 1:-1].argmax(-1) == tgt).double())


def windowed_rows(model, seq, window, stride):
    """The same values under lm-eval's rolling windows (prefix seq[0], the
    windows made disjoint), each window read by the model: the last
    len(continuation) rows of (context + continuation)[-(window + 1):][:-1]."""
    nll, ent, ok = [], [], []
    for context, cont in map(make_disjoint_window, get_rolling_token_windows(
            token_list=list(seq[1:]), prefix_token=seq[0], max_seq_len=window, context_len=window - stride + 1)):
        inp = (context + cont)[-(window + 1):][:-1]
        with torch.no_grad():
            logits = model(torch.tensor([inp])).logits[0].double()[len(inp) - len(cont):]
        logp = F.log_softmax(logits, -1)
        tgt = torch.tensor(cont)
        nll.append(-logp.gather(1, tgt[:, None])[:, 0])
        ent.append(-(logp.exp() * logp).sum(-1))
        ok.append((logits.argmax(-1) == tgt).double())
    return torch.cat(nll), torch.cat(ent), torch.cat(ok)


def check_metrics(m, nll, ent, ok, n_bytes, nll_bytes=None):
    n = nll.numel()
    total = float(nll.sum())
    assert m.tokens == n
    assert m.nll_sum == pytest.approx(total, rel=1e-6)
    assert m.loss == pytest.approx(total / n, rel=1e-6)
    assert m.perplexity == pytest.approx(math.exp(total / n), rel=1e-5)
    assert m.bits_per_token == pytest.approx(total / n / LN2, rel=1e-6)
    assert m.bytes == n_bytes
    want_bpb = (total if nll_bytes is None else nll_bytes) / LN2 / n_bytes
    assert m.bits_per_byte == pytest.approx(want_bpb, rel=1e-6)
    assert m.entropy == pytest.approx(float(ent.mean()), rel=1e-6)
    assert m.accuracy == pytest.approx(float(ok.mean()), abs=1e-12)
    assert m.stderr["loss"] == pytest.approx(float(nll.std()) / math.sqrt(n), rel=1e-5)


def test_one_text_every_value_from_the_models_logits(model, tokenizer):
    text = TEXTS[0]
    seq = [tokenizer.bos_token_id] + ids_of(tokenizer, text)
    nll, ent, ok = rows(model, seq, 1)
    m = lmmetrics.text_metrics(model, tokenizer, text)
    # bos=True: every token scored, every UTF-8 byte of the text counted
    check_metrics(m, nll, ent, ok, len(text.encode("utf-8")))
    assert m.ignored == 0 and m.documents is None


def test_several_texts_are_documents_in_their_order(model, tokenizer):
    per = [rows(model, [tokenizer.bos_token_id] + ids_of(tokenizer, t), 1) for t in TEXTS]
    m = lmmetrics.text_metrics(model, tokenizer, TEXTS, batch_size=3)
    check_metrics(m, *(torch.cat(x) for x in zip(*per)), sum(len(t.encode()) for t in TEXTS))
    assert m.documents == len(TEXTS)
    assert m.per_document.ids.tolist() == list(range(len(TEXTS)))
    losses = np.array([float(nll.mean()) for nll, _, _ in per])
    np.testing.assert_allclose(m.per_document.loss, losses, rtol=1e-6)
    np.testing.assert_array_equal(m.per_document.bytes, [len(t.encode()) for t in TEXTS])
    assert m.macro_loss == pytest.approx(losses.mean(), rel=1e-6)
    assert m.mean_perplexity == pytest.approx(np.exp(losses).mean(), rel=1e-5)
    # a list of one text is one document too
    assert lmmetrics.text_metrics(model, tokenizer, TEXTS[:1]).documents == 1


def hf_evaluate_perplexity(model, tokenizer, predictions, batch_size=16, add_start_token=True):
    """Hugging Face evaluate's metrics/perplexity/perplexity.py `_compute`
    (model_id / predictions form) step for step, on a model and tokenizer
    given instead of loaded by name, in float64 (the logits cast before the
    loss); max_length=None."""
    encodings = tokenizer(predictions, add_special_tokens=False, padding=True, truncation=False,
                          return_tensors="pt", return_attention_mask=True)
    encoded_texts = encodings["input_ids"]
    attn_masks = encodings["attention_mask"]
    if add_start_token:
        assert torch.all(torch.ge(attn_masks.sum(1), 1)), "Each input text must be at least one token long."
    else:
        assert torch.all(torch.ge(attn_masks.sum(1), 2))
    ppls = []
    loss_fct = torch.nn.CrossEntropyLoss(reduction="none")
    for start_index in range(0, len(encoded_texts), batch_size):
        end_index = min(start_index + batch_size, len(encoded_texts))
        encoded_batch = encoded_texts[start_index:end_index]
        attn_mask = attn_masks[start_index:end_index]
        if add_start_token:
            bos_tokens_tensor = torch.tensor([[tokenizer.bos_token_id]] * encoded_batch.size(dim=0))
            encoded_batch = torch.cat([bos_tokens_tensor, encoded_batch], dim=1)
            attn_mask = torch.cat([torch.ones(bos_tokens_tensor.size(), dtype=torch.int64), attn_mask], dim=1)
        labels = encoded_batch
        with torch.no_grad():
            out_logits = model(encoded_batch, attention_mask=attn_mask).logits.double()
        shift_logits = out_logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        shift_attention_mask_batch = attn_mask[..., 1:].contiguous()
        perplexity_batch = torch.exp(
            (loss_fct(shift_logits.transpose(1, 2), shift_labels) * shift_attention_mask_batch).sum(1)
            / shift_attention_mask_batch.sum(1))
        ppls += perplexity_batch.tolist()
    return {"perplexities": ppls, "mean_perplexity": np.mean(ppls)}


@pytest.mark.parametrize("bos", [True, False])
def test_mean_perplexity_is_hugging_face_evaluates(model, tokenizer, bos):
    want = hf_evaluate_perplexity(model, tokenizer, TEXTS, batch_size=2, add_start_token=bos)
    m = lmmetrics.text_metrics(model, tokenizer, TEXTS, bos=bos)
    np.testing.assert_allclose(np.exp(m.per_document.loss), want["perplexities"], rtol=1e-5)
    assert m.mean_perplexity == pytest.approx(want["mean_perplexity"], rel=1e-5)
    # the geometric mean over texts, never above the arithmetic one
    assert m.macro_perplexity == pytest.approx(math.exp(np.log(want["perplexities"]).mean()), rel=1e-5)
    assert m.macro_perplexity < m.mean_perplexity


def test_bos_false_leaves_each_first_token_and_its_bytes_out(model, tokenizer):
    per = [rows(model, ids_of(tokenizer, t), 1) for t in TEXTS]
    m = lmmetrics.text_metrics(model, tokenizer, TEXTS, bos=False)
    # each text starts with an ASCII word: decoding all but its first token is exact
    n_bytes = sum(len(tokenizer.decode(ids_of(tokenizer, t)[1:]).encode()) for t in TEXTS)
    check_metrics(m, *(torch.cat(x) for x in zip(*per)), n_bytes)
    assert m.ignored == len(TEXTS)
    assert m.tokens == sum(len(ids_of(tokenizer, t)) for t in TEXTS) - len(TEXTS)


def test_bos_as_a_token_id(model, tokenizer):
    eos = tokenizer.eos_token_id
    nll, ent, ok = rows(model, [eos] + ids_of(tokenizer, TEXTS[1]), 1)
    check_metrics(lmmetrics.text_metrics(model, tokenizer, TEXTS[1], bos=eos), nll, ent, ok,
                  len(TEXTS[1].encode()))


def test_bos_true_without_a_bos_token_says_what_to_do(model, tokenizer, raw):
    no_bos = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>")
    assert no_bos.bos_token_id is None
    for tk in (no_bos, raw):  # a transformers tokenizer, a tokenizers.Tokenizer
        with pytest.raises(ValueError, match=r"no BOS token.*bos=False.*bos=tokenizer.eos_token_id"):
            lmmetrics.text_metrics(model, tk, TEXTS[0])
        want = lmmetrics.text_metrics(model, tokenizer, TEXTS[0], bos=False)
        got = lmmetrics.text_metrics(model, tk, TEXTS[0], bos=False)
        assert (got.tokens, got.bytes) == (want.tokens, want.bytes)
        assert got.loss == pytest.approx(want.loss, rel=1e-12)


@pytest.mark.parametrize("window,stride", [(16, 16), (16, 5), (8, 3), (64, 64)])
@pytest.mark.parametrize("bos", [True, False])
def test_windows_against_a_float64_rolling_window_reference(model, tokenizer, window, stride, bos):
    texts = TEXTS[:2] + [TEXTS[3]]  # 15 to 40 tokens: several windows each
    seqs = [([tokenizer.bos_token_id] if bos else []) + ids_of(tokenizer, t) for t in texts]
    per = [windowed_rows(model, s, window, stride) for s in seqs]
    m = lmmetrics.text_metrics(model, tokenizer, texts, window=window, stride=stride, bos=bos, batch_size=4)
    nll, ent, ok = (torch.cat(x) for x in zip(*per))
    table = lmmetrics.token_bytes(tokenizer, size=320)
    scored = torch.tensor([t for s in seqs for t in s[1:]])
    b = torch.from_numpy(table)[scored]
    check_metrics(m, nll, ent, ok, int(b.sum()), float(nll[b > 0].sum()))
    if bos:
        assert m.bytes == sum(len(t.encode()) for t in texts)
    np.testing.assert_allclose(m.per_document.loss, [float(x[0].mean()) for x in per], rtol=1e-6)
    # sliding_window_nll reads the same windows
    for s, (want, _, _) in zip(seqs, per):
        got = lmmetrics.sliding_window_nll(model, s[1:], max_length=window, stride=stride, prefix_token=s[0])
        np.testing.assert_allclose(got.double().numpy(), want.numpy(), atol=2e-6)


def test_batch_size_and_window_do_not_change_the_numbers(model, tokenizer):
    a = lmmetrics.text_metrics(model, tokenizer, TEXTS, batch_size=1)
    b = lmmetrics.text_metrics(model, tokenizer, TEXTS, batch_size=4)
    c = lmmetrics.text_metrics(model, tokenizer, TEXTS, window=63)  # every text fits one window
    for x in (b, c):
        assert (x.tokens, x.bytes, x.documents) == (a.tokens, a.bytes, a.documents)
        for name in ("loss", "bits_per_byte", "entropy", "accuracy", "mean_perplexity", "macro_loss"):
            assert getattr(x, name) == pytest.approx(getattr(a, name), rel=1e-5, abs=1e-9), name


def test_the_full_logits_never_exist(model, tokenizer):
    """The head runs only on model_logits' check (its first positions);
    the rest are projected lazily, a bounded chunk at a time."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(tuple(out.shape)))
    try:
        m = lmmetrics.text_metrics(model, tokenizer, TEXTS, batch_size=4)
    finally:
        hook.remove()
    assert m.tokens > 90
    assert seen and all(math.prod(s[:-1]) <= 8 for s in seen), seen


def test_errors(model, tokenizer):
    with pytest.raises(ValueError, match="no token to score"):
        lmmetrics.text_metrics(model, tokenizer, ["the cat", ""])
    with pytest.raises(ValueError, match="no token to score.*bos=False"):
        lmmetrics.text_metrics(model, tokenizer, "a", bos=False)
    with pytest.raises(ValueError, match=r"context \(64.*window="):
        lmmetrics.text_metrics(model, tokenizer, "the cat sat. " * 40)
    with pytest.raises(ValueError, match=r"window \(80\) is longer than the model's context"):
        lmmetrics.text_metrics(model, tokenizer, "the cat sat. " * 40, window=80)
    with pytest.raises(ValueError, match="stride needs window"):
        lmmetrics.text_metrics(model, tokenizer, "the cat", stride=4)
    with pytest.raises(ValueError, match="must not exceed window"):
        lmmetrics.text_metrics(model, tokenizer, "the cat", window=4, stride=5)
    with pytest.raises(ValueError, match="window must be a positive integer"):
        lmmetrics.text_metrics(model, tokenizer, "the cat", window=0)
    with pytest.raises(TypeError, match="sequence of str"):
        lmmetrics.text_metrics(model, tokenizer, ["the cat", 3])
    with pytest.raises(TypeError, match="bytes"):
        lmmetrics.text_metrics(model, tokenizer, b"the cat")
    with pytest.raises(ValueError, match="empty sequence"):
        lmmetrics.text_metrics(model, tokenizer, [])
    with pytest.raises(TypeError, match="bos must be"):
        lmmetrics.text_metrics(model, tokenizer, "the cat", bos="<s>")
    with pytest.raises(TypeError, match=r"bos must be True, False or a token id, got tensor\(True\), a boolean"):
        lmmetrics.text_metrics(model, tokenizer, "the cat", bos=torch.tensor(True))  # (was token 1, not the BOS)
    # a long text is read in windows
    assert lmmetrics.text_metrics(model, tokenizer, "the cat sat. " * 40, window=64).tokens > 64


def test_a_tokenizer_of_another_model_is_named():
    """Token ids past the model's input embedding (a tokenizer of a larger
    vocabulary, or a BOS id past it) are a ValueError naming the id and the
    embedding's size, before any forward pass (torch's embedding said only
    'index out of range in self')."""
    import transformers

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=_raw_tokenizer(), bos_token="<s>")
    torch.manual_seed(0)
    small = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=200, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=64)).eval()
    text = "the cat sat on the mat."
    top = max([tokenizer.bos_token_id] + ids_of(tokenizer, text))
    assert top >= 200  # (the tokenizer has 300 tokens)
    with pytest.raises(ValueError, match=f"token id {top}, but the model's input embedding holds 200 tokens"):
        lmmetrics.text_metrics(small, tokenizer, text, progress=False)
    with pytest.raises(ValueError, match="token id 250, but the model's input embedding holds 200"):
        lmmetrics.text_metrics(small, tokenizer, "x", bos=250, token_bytes=np.ones(200, np.int64), progress=False)


def test_a_model_whose_input_embedding_transformers_cannot_find_is_scored(model, tokenizer, monkeypatch):
    """A model of the user's own (a PreTrainedModel subclass with its own
    get_output_embeddings) whose get_input_embeddings is transformers'
    default, which raises NotImplementedError where it finds no embedding:
    scored as before, the token ids left unchecked."""
    want = lmmetrics.text_metrics(model, tokenizer, "the cat sat.", progress=False)

    def unknown():
        raise NotImplementedError("`get_input_embeddings` not auto-handled for Toy; please override in the subclass.")

    monkeypatch.setattr(model, "get_input_embeddings", unknown)
    monkeypatch.setattr(model, "get_output_embeddings", lambda: model.lm_head)  # (transformers' asks the input's)
    assert lmmetrics.text_metrics(model, tokenizer, "the cat sat.", progress=False).loss == want.loss


@pytest.mark.parametrize("window,stride", [(16, 16), (8, 3)])
@pytest.mark.parametrize("bos", [True, False])
def test_sliding_window_nll_token_bytes_gives_evaluates_bits_per_byte(model, tokenizer, window, stride, bos):
    ids = ids_of(tokenizer, TEXTS[1])
    seq = ([tokenizer.bos_token_id] if bos else []) + ids
    table = lmmetrics.token_bytes(tokenizer, size=320)
    prefix = seq[0] if bos else None
    plain = lmmetrics.sliding_window_nll(model, torch.tensor(ids), max_length=window, stride=stride,
                                         prefix_token=prefix)
    nll, m = lmmetrics.sliding_window_nll(model, torch.tensor(ids), max_length=window, stride=stride,
                                          prefix_token=prefix, token_bytes=table)
    assert torch.equal(nll.isnan(), plain.isnan()) and torch.equal(nll.nan_to_num(), plain.nan_to_num())
    want_nll, ent, ok = windowed_rows(model, seq, window, stride)
    b = torch.from_numpy(table)[torch.tensor(seq[1:])]
    check_metrics(m, want_nll, ent, ok, int(b.sum()), float(want_nll[b > 0].sum()))
    assert m.ignored == (0 if bos else 1) == len(ids) - m.tokens
    if bos:  # every byte of the text
        assert m.bytes == len(TEXTS[1].encode())


def test_sliding_window_nll_token_bytes_in_one_window_is_evaluate(model, tokenizer):
    ids = torch.tensor([tokenizer.bos_token_id] + ids_of(tokenizer, TEXTS[0]))
    table = lmmetrics.token_bytes(tokenizer, size=320)
    _, m = lmmetrics.sliding_window_nll(model, ids, max_length=64, token_bytes=table)
    with torch.no_grad():
        want = lmmetrics.evaluate(model(ids[None]).logits, ids[None], token_bytes=table, shift=True)
    assert (m.tokens, m.bytes) == (want.tokens, want.bytes)
    for name in ("bits_per_byte", "loss", "entropy", "accuracy"):
        assert getattr(m, name) == pytest.approx(getattr(want, name), rel=1e-6), name
    assert m.stderr["bits_per_byte"] == pytest.approx(want.stderr["bits_per_byte"], rel=1e-5)
    # without a token to score: no byte, bits per byte inf as evaluate's
    nll, m = lmmetrics.sliding_window_nll(model, ids[:1], max_length=8, token_bytes=table)
    assert nll.isnan().all() and (m.tokens, m.bytes, m.ignored) == (0, 0, 1) and m.bits_per_byte == math.inf


@pytest.mark.peers
@pytest.mark.parametrize("window", [16, 64])
def test_bos_true_is_lm_evals_rolling_loglikelihood_and_bits_per_byte(model, tokenizer, window):
    """lm-eval's own HFLM.loglikelihood_rolling (its prefix token: BOS), with
    a tokenizer that adds no special token, so that lm-eval scores the text's
    own tokens after BOS: the summed NLL, and its bits_per_byte (the
    log-likelihood over the document's UTF-8 bytes)."""
    pytest.importorskip("accelerate")
    huggingface = pytest.importorskip("lm_eval.models.huggingface")
    from lm_eval.api.instance import Instance

    text = TEXTS[0] * 3
    lm = huggingface.HFLM(pretrained=model, tokenizer=tokenizer, max_length=window, batch_size=1, device="cpu")
    assert lm.prefix_token_id == tokenizer.bos_token_id
    assert tokenizer(text).input_ids == ids_of(tokenizer, text)  # lm-eval encodes what text_metrics does
    (want,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    m = lmmetrics.text_metrics(model, tokenizer, text, window=window)
    assert -m.nll_sum == pytest.approx(want, rel=1e-6)
    assert m.bits_per_byte == pytest.approx(-want / len(text.encode()) / LN2, rel=1e-6)
