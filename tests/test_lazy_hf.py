"""lmmetrics.model_logits on tiny random Hugging Face models of the
architectures whose heads differ (Llama; GPT-2's tied embeddings; Gemma 2's
final soft-cap; Cohere's logit scale; Qwen2): every metric from the lazy
logits equals the same metric on the model's own ``model(x).logits``; an
architecture whose logits the head does not explain is refused."""
import math

import numpy as np
import pytest

import lmmetrics

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

V = 300
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)


def _models():
    yield "llama", lambda: T.LlamaForCausalLM(T.LlamaConfig(**COMMON))
    yield "gpt2", lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4,
                                                         bos_token_id=0, eos_token_id=0))
    yield "gemma2", lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**COMMON, head_dim=8, final_logit_softcapping=3.0))
    yield "cohere", lambda: T.CohereForCausalLM(T.CohereConfig(**COMMON, logit_scale=0.25, eos_token_id=1))
    yield "qwen2", lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**COMMON))


@pytest.fixture(params=[name for name, _ in _models()])
def model(request):
    torch.manual_seed(0)
    m = dict(_models())[request.param]().eval()
    with torch.no_grad():  # a head far from zero: the transforms matter
        m.get_output_embeddings().weight.mul_(8.0)
    return m


def _close(a, b):
    for k, v in b.items():
        w = a[k]
        assert (w is None) if v is None else w == pytest.approx(v, rel=2e-5, abs=2e-5), (k, w, v)


def test_every_metric_equals_the_models_own_logits(model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, 17), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        lazy = lmmetrics.model_logits(model, ids, attention_mask=mask, chunk_bytes=5 * V * 4)
    table = torch.randint(0, 4, (V,), generator=g)
    _close(lmmetrics.evaluate(lazy, labels, shift=True, token_bytes=table).as_dict(),
           lmmetrics.evaluate(full, labels, shift=True, token_bytes=table).as_dict())
    np.testing.assert_allclose(lmmetrics.token_nll(lazy, labels, shift=True).numpy(),
                               lmmetrics.token_nll(full, labels, shift=True).numpy(), rtol=1e-5, atol=1e-5)
    lp_lazy, greedy_lazy = lmmetrics.loglikelihood(lazy, labels, shift=True)
    lp_full, greedy_full = lmmetrics.loglikelihood(full, labels, shift=True)
    np.testing.assert_allclose(lp_lazy.numpy(), lp_full.numpy(), rtol=1e-5)
    assert (greedy_lazy == greedy_full).all()
    # a quantized-like copy against its base, both lazy: compare's numbers
    q = type(model)(model.config).eval()
    q.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in q.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
        q_full = q(ids, attention_mask=mask).logits
        q_lazy = lmmetrics.model_logits(q, ids, attention_mask=mask)
    a = lmmetrics.compare(q_lazy, labels, reference_logits=lazy, shift=True).as_dict()
    b = lmmetrics.compare(q_full, labels, reference_logits=full, shift=True).as_dict()
    assert a["ppl"]["value"] == pytest.approx(b["ppl"]["value"], rel=2e-5)
    assert a["kld"]["mean"] == pytest.approx(b["kld"]["mean"], rel=2e-4, abs=2e-6)
    assert a["same_top"] == b["same_top"]


def test_sliding_windows_without_the_logits(model):
    ids = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(2))
    full = lmmetrics.sliding_window_nll(model, ids, max_length=16, stride=8, batch_size=2)
    lazy = lmmetrics.sliding_window_nll(model, ids, max_length=16, stride=8, batch_size=2, materialize=False)
    np.testing.assert_allclose(lazy.numpy(), full.numpy(), rtol=1e-5, atol=1e-5)
    assert torch.isnan(lazy).sum() == torch.isnan(full).sum() == 1


def test_evaluate_bpb_through_lazy_logits(model):
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, V, (2, 9), generator=g), torch.randint(-1, V, (2, 9), generator=g))
               for _ in range(3)]
    table = torch.randint(0, 4, (V,), generator=g)
    full = lmmetrics.evaluate_bpb(model, iter(batches), 3, table)
    lazy = lmmetrics.evaluate_bpb(lambda x: lmmetrics.model_logits(model, x), iter(batches), 3, table)
    assert lazy == pytest.approx(full, rel=1e-5)


class _Doubled(T.LlamaForCausalLM):
    """An architecture with an output transform model_logits cannot see."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_an_architecture_the_head_does_not_explain_is_refused():
    torch.manual_seed(0)
    m = _Doubled(T.LlamaConfig(**COMMON)).eval()
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(8.0)
    ids = torch.randint(0, V, (2, 12))
    with pytest.raises(ValueError, match="_Doubled's body and head differ from the model's own"):
        lmmetrics.model_logits(m, ids)
    lazy = lmmetrics.model_logits(m, ids, check=False)  # the caller's word
    assert lazy.shape == (2, 12, V)
    with pytest.raises(TypeError, match="LlamaModel has no output head"):
        lmmetrics.model_logits(T.LlamaModel(T.LlamaConfig(**COMMON)), ids)
    assert math.isfinite(lmmetrics.perplexity(lazy, ids, shift=True))
