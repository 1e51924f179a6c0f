"""lmmetrics.model_logits on tiny random Hugging Face models of the
architectures whose heads differ (Llama; GPT-2's tied embeddings; Gemma 2's
final soft-cap; Cohere's logit scale; Qwen2): every metric from the lazy
logits equals the same metric on the model's own ``model(x).logits``; an
architecture whose logits the head does not explain is refused."""
import math
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.peers  # against a heavy peer's own code: pytest -m peers

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


class _Scaled(T.LlamaForCausalLM):
    """An architecture with an output transform model_logits cannot see:
    its logits times ``factor``, which its config does not name."""

    factor = 2.0

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * self.factor
        return out


def test_an_architecture_the_head_does_not_explain_is_refused():
    torch.manual_seed(0)
    m = _Scaled(T.LlamaConfig(**COMMON)).eval()
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(8.0)
    ids = torch.randint(0, V, (2, 12))
    with pytest.raises(ValueError, match="_Scaled transforms its head's output in a way lmmetrics does not know"):
        lmmetrics.model_logits(m, ids)
    lazy = lmmetrics.model_logits(m, ids, check=False)  # the caller's word
    assert lazy.shape == (2, 12, V)
    with pytest.raises(TypeError, match="LlamaModel has no output head"):
        lmmetrics.model_logits(T.LlamaModel(T.LlamaConfig(**COMMON)), ids)
    assert math.isfinite(lmmetrics.perplexity(lazy, ids, shift=True))


def test_an_encoder_decoder_model_is_refused():
    """Found by an adversarial review: BART's forward on input_ids alone
    runs (its decoder reads them shifted right), so model_logits took it,
    and its logits at position t predict input_ids[t]: scored with
    shift=True, as the guide says for model_logits, the number was
    plausible and wrong (BART's own loss is the unshifted score). Encoder-decoder models are refused, T5 with that error too
    (its decoder's own error before)."""
    torch.manual_seed(0)
    bart = T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)).eval()
    t5 = T.T5ForConditionalGeneration(T.T5Config(vocab_size=V, d_model=32, d_ff=64, num_layers=1, num_heads=4,
                                                 d_kv=8, decoder_start_token_id=0)).eval()
    ids = torch.randint(3, V, (2, 12))
    with torch.no_grad():  # (why: the model's own loss is the unshifted score of its logits)
        bart.get_output_embeddings().weight.mul_(8.0)
        out = bart(ids, labels=ids)
    assert float(out.loss) == pytest.approx(lmmetrics.cross_entropy(out.logits, ids, shift=False), rel=1e-5)
    assert float(out.loss) != pytest.approx(lmmetrics.cross_entropy(out.logits, ids, shift=True), rel=1e-3)
    for m in (bart, t5):
        with pytest.raises(TypeError, match=rf"model_logits: {type(m).__name__} is an encoder-decoder model"):
            lmmetrics.model_logits(m, ids)


class _Capped(T.LlamaForCausalLM):
    """A soft cap of 30 in its forward: in the model's dtype, or (upcast=True,
    as Beam does) after .float(); the config may name it or not."""

    upcast = False

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        z = out.logits.float() if self.upcast else out.logits
        out.logits = torch.tanh(z / 30.0) * 30.0
        return out


def _bf16(m, top=8.0):
    """m in bfloat16, its head scaled so that its largest logit is about top
    (a trained model's range, where a soft cap of 30 moves logits by
    less than 4% and a loose check would let it pass)."""
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(top / float(m(ids).logits.abs().max()))
    return m.to(torch.bfloat16), ids


def _same_metrics(m, ids, **kw):
    with torch.no_grad():
        full = m(ids).logits
        lazy = lmmetrics.model_logits(m, ids, **kw)
    assert lazy.dtype == str(full.dtype).replace("torch.", "")
    np.testing.assert_array_equal(lmmetrics.token_nll(lazy, ids, shift=True).numpy(),
                                  lmmetrics.token_nll(full, ids, shift=True).numpy())
    return lazy


@pytest.mark.parametrize("upcast", [False, True], ids=["bf16-cap", "float32-cap"])
def test_a_soft_cap_the_model_applies_is_found_or_refused_in_bfloat16(upcast):
    """A soft cap in the forward of a bfloat16 model with logits up to ~8:
    named by the config (RecurrentGemma's logits_soft_cap), the lazy
    logits are the model's to the bit, in its logits' dtype (float32 when
    it upcasts first, as Beam); not named, it is refused (the probe's head
    outputs up to 1000 show the cap), never scored as uncapped."""
    torch.manual_seed(0)
    cfg = T.LlamaConfig(**COMMON)
    cfg.logits_soft_cap = 30.0
    m = _Capped(cfg).eval()
    m.upcast = upcast
    m, ids = _bf16(m)
    _same_metrics(m, ids)
    del m.config.logits_soft_cap
    with pytest.raises(ValueError, match="_Capped transforms its head's output in a way lmmetrics does not know"):
        lmmetrics.model_logits(m, ids)


def test_factors_the_config_names_are_applied_only_when_the_model_does():
    """Granite divides its logits by logits_scaling (bfloat16: the bits of
    the model's own logits); Llama ignores a logit_scale left in its
    config (as MPT does), and so do the lazy logits."""
    torch.manual_seed(0)
    g, ids = _bf16(T.GraniteForCausalLM(T.GraniteConfig(**COMMON, logits_scaling=4.0)).eval())
    lazy = _same_metrics(g, ids)
    assert lazy.scale == 0.25
    cfg = T.LlamaConfig(**COMMON)
    cfg.logit_scale = 4.0
    torch.manual_seed(0)
    assert _same_metrics(T.LlamaForCausalLM(cfg).eval(), ids).scale == 1.0


@pytest.mark.parametrize("scaling", [0.3, 0.96, 3.84])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_granite_divides_by_a_factor_that_is_not_a_power_of_two(dtype, scaling):
    """Granite divides its logits by logits_scaling in their dtype: the
    lazy logits divide too (times the inverse rounds about 1% of 16-bit
    logits differently: the check refused these as an unknown transform,
    and float32 passed it a last bit off), so every metric is the model's
    own logits' to the bit."""
    torch.manual_seed(0)
    m = T.GraniteForCausalLM(T.GraniteConfig(**COMMON, logits_scaling=scaling)).eval()
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # logits up to about 8, after the division
        m.lm_head.weight.mul_(8.0 * scaling / float(m(ids).logits.abs().max()))
    m = m.to(dtype)
    with torch.no_grad():
        full = m(ids).logits
        lazy = lmmetrics.model_logits(m, ids)
    np.testing.assert_array_equal(lazy.rows(np.arange(48)).float().numpy(), full.reshape(48, V).float().numpy())
    assert lazy.divisor == scaling and lazy.dtype == str(dtype).replace("torch.", "")
    assert lmmetrics.evaluate(lazy, ids, shift=True).as_dict() == lmmetrics.evaluate(full, ids, shift=True).as_dict()
    np.testing.assert_array_equal(lmmetrics.token_nll(lazy, ids, shift=True).numpy(),
                                  lmmetrics.token_nll(full, ids, shift=True).numpy())


def test_a_model_under_autocast():
    """A float32 model run under torch.autocast (bfloat16 on the CPU): its
    head ran in bfloat16, and so do the lazy logits, whether the metric is
    computed inside the autocast block or after it."""
    torch.manual_seed(0)
    m = T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).eval()
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = m(ids).logits
        lazy = lmmetrics.model_logits(m, ids)
        inside = lmmetrics.token_nll(lazy, ids, shift=True)
    assert full.dtype == torch.bfloat16 and lazy.dtype == "bfloat16"
    want = lmmetrics.token_nll(full, ids, shift=True).numpy()
    np.testing.assert_array_equal(inside.numpy(), want)
    np.testing.assert_array_equal(lmmetrics.token_nll(lazy, ids, shift=True).numpy(), want)


def test_the_head_input_is_the_models_own():
    """The hidden states are what the model's forward hands its head (the
    forward stopped there), not a guess at its body: a cast between body
    and head (Mamba in bfloat16), a projection (OPT's project_out), a RoPE
    whose frequencies depend on the length (Phi-3 longrope on a text past
    its original context, where the check's short prefix runs otherwise)."""
    torch.manual_seed(0)
    opt = T.OPTForCausalLM(T.OPTConfig(vocab_size=V, hidden_size=32, word_embed_proj_dim=16, ffn_dim=64,
                                       num_hidden_layers=2, num_attention_heads=4)).eval()
    ids = torch.randint(3, V, (2, 40), generator=torch.Generator().manual_seed(5))
    _same_metrics(opt, ids)
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4, "rope_theta": 10000.0}
    phi = T.Phi3ForCausalLM(T.Phi3Config(**COMMON, max_position_embeddings=64, original_max_position_embeddings=16,
                                         pad_token_id=0, eos_token_id=1, bos_token_id=1,
                                         rope_parameters=rope)).eval()
    _same_metrics(phi, ids)


class _LoraHead(torch.nn.Module):
    """A LoRA-style head: the base layer's weight, plus an adapter the
    weight does not show (as peft's lora.Linear)."""

    def __init__(self, base, rank=2, size=0.05):
        super().__init__()
        self.base = base
        g = torch.Generator().manual_seed(3)
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features, generator=g).to(base.weight.dtype))
        self.b = torch.nn.Parameter((torch.randn(base.out_features, rank, generator=g) * size).to(base.weight.dtype))

    @property
    def weight(self):
        return self.base.weight

    def forward(self, x):
        return self.base(x) + (x @ self.a.T) @ self.b.T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_head_that_is_more_than_its_weight_is_refused(dtype):
    """A forward hook on the head (a logit bias on 40 tokens) and a LoRA
    adapter change the head's output by less than a 16-bit logit's
    rounding allows for elsewhere; the head's output must be its weight
    applied as a linear layer to the last bit, or the model is refused
    (these gave perplexities up to 0.8% off, silently)."""
    torch.manual_seed(0)
    m, ids = _bf16(T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).eval(), top=20.0)
    m = m.to(dtype)
    boost = torch.zeros(V, dtype=dtype)
    boost[:40] = 0.25 if dtype == torch.bfloat16 else 1e-3
    hook = m.lm_head.register_forward_hook(lambda mod, args, out: out + boost)
    with pytest.raises(ValueError, match="output head is not its weight .and bias. applied as a linear layer"):
        lmmetrics.model_logits(m, ids)
    hook.remove()
    _same_metrics(m, ids)  # (a hook that changes nothing is no hook)
    m.lm_head = _LoraHead(m.lm_head)
    with pytest.raises(ValueError, match="a LoRA adapter, a forward hook"):
        lmmetrics.model_logits(m, ids)


def test_an_unnamed_factor_within_bfloat16_rounding_is_refused():
    """x 1.002 in bfloat16 moves a logit by less than half its last bit
    almost everywhere, yet by one bit on a few percent of them, always up
    (perplexity 0.2% off, token NLL up to 0.06): the probe's least-squares
    factor sees it."""
    torch.manual_seed(0)
    m = _Scaled(T.LlamaConfig(**COMMON)).eval()
    m.factor = 1.002
    m, ids = _bf16(m, top=20.0)
    with pytest.raises(ValueError, match="_Scaled transforms its head's output"):
        lmmetrics.model_logits(m, ids)


def test_what_the_check_cannot_decide_is_an_error():
    """Training mode with dropout (a functional attention dropout, named by
    the config only); check=False where the config names a transform
    (HyperCLOVAX multiplies by logits_scaling, Granite divides: the check
    decides); a head whose weight is offloaded to the meta device."""
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(5))
    m = T.LlamaForCausalLM(T.LlamaConfig(**COMMON, attention_dropout=0.3)).train()
    with pytest.raises(ValueError, match=r"training mode with dropout \(config.attention_dropout=0.3\).*model.eval"):
        lmmetrics.model_logits(m, ids)
    _same_metrics(T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).train(), ids)  # no dropout: deterministic
    # (GPT-NeoX's config has classifier_dropout=0.1, for a head a causal LM has not)
    _same_metrics(T.GPTNeoXForCausalLM(T.GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=2, num_attention_heads=4)).train(), ids)
    bad = T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).eval()
    with torch.no_grad():
        bad.model.norm.weight[0] = float("nan")
    with pytest.raises(ValueError, match="LlamaForCausalLM's hidden states at its first positions hold NaN"):
        lmmetrics.model_logits(bad, ids)
    g = T.GraniteForCausalLM(T.GraniteConfig(**COMMON, logits_scaling=4.0)).eval()
    with pytest.raises(ValueError, match=r"config names an output transform \(logits_scaling=4.0\)"):
        lmmetrics.model_logits(g, ids, check=False)
    assert lmmetrics.model_logits(g, ids).scale == 0.25
    g.lm_head.to("meta")
    with pytest.raises(TypeError, match="weight on the meta device"):
        lmmetrics.model_logits(g, ids)


class _Chunked(T.LlamaForCausalLM):
    """A model with a rule on the length (xLSTM's chunk size)."""

    def forward(self, input_ids=None, **kwargs):
        if input_ids.shape[1] % 16:
            raise ValueError(f"Sequence length {input_ids.shape[1]} is not divisible by chunk size 16.")
        return super().forward(input_ids=input_ids, **kwargs)


def test_one_sequence_a_4d_mask_and_a_length_rule():
    """1-D input_ids give (T, V) logits; a 4-D mask (two packed documents)
    is the model's; a model that refuses the check's 8 positions says so,
    and check_positions= a length it takes works."""
    torch.manual_seed(0)
    m = T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).eval()
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = m(ids[:1]).logits[0]
        lazy = lmmetrics.model_logits(m, ids[0])
    assert lazy.shape == (16, V)
    np.testing.assert_array_equal(lmmetrics.token_nll(lazy, ids[0], shift=True).numpy(),
                                  lmmetrics.token_nll(full, ids[0], shift=True).numpy())
    m4 = torch.ones(2, 1, 16, 16).tril().bool()
    m4[:, :, 8:, :8] = False
    with torch.no_grad():
        full = m(ids, attention_mask=m4).logits
        lazy = lmmetrics.model_logits(m, ids, attention_mask=m4)
    np.testing.assert_array_equal(lmmetrics.token_nll(lazy, ids, shift=True).numpy(),
                                  lmmetrics.token_nll(full, ids, shift=True).numpy())
    c = _Chunked(T.LlamaConfig(**COMMON)).eval()
    c.load_state_dict(m.state_dict())
    with pytest.raises(ValueError, match="Sequence length 8 is not divisible") as e:  # (the model's own error)
        lmmetrics.model_logits(c, ids)
    if sys.version_info >= (3, 11):
        assert "check_positions= a length it accepts" in e.value.__notes__[0]
    _same_metrics(c, ids, check_positions=16)


class _InPlace(T.LlamaForCausalLM):
    """A model that changes its head's output in place: divided by the
    config's logits_scaling (as Granite does, but with div_), or (mask=True)
    a few vocabulary columns set to the dtype's lowest value (Chameleon's
    image tokens)."""

    mask = False

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self.mask:
            out.logits[:, :, :10] = torch.finfo(out.logits.dtype).min
        else:
            out.logits.div_(self.config.logits_scaling)
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_head_output_changed_in_place(dtype):
    """The check compares the head's output as the head made it, not the
    model's logits after the model changed that tensor in place: a factor
    the config names, applied with div_, is found (it was refused as a
    head that is not its weight, the message for a LoRA adapter), and
    Chameleon's in-place column mask is refused as a transform lmmetrics
    does not know."""
    torch.manual_seed(0)
    m = _InPlace(T.LlamaConfig(**COMMON, logits_scaling=3.84)).eval()
    m, ids = _bf16(m)
    m = m.to(dtype)
    assert _same_metrics(m, ids).divisor == 3.84
    m.mask = True
    with pytest.raises(ValueError, match="_InPlace transforms its head's output in a way lmmetrics does not know"):
        lmmetrics.model_logits(m, ids)


SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)


def _unusual_heads():
    """Heads that do more than lm_head(hidden), and what model_logits must
    find (a factor, a cap, a float32 upcast; None: refused)."""
    yield "beam-upcast-cap", lambda: T.BeamForCausalLM(T.BeamConfig(
        **SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8, final_logit_softcapping=5.0)), \
        ("float32", None, 5.0)
    yield "falcon_h1-multiplier", lambda: T.FalconH1ForCausalLM(T.FalconH1Config(
        **SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4,
        mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16, lm_head_multiplier=0.6)), \
        (None, 0.6, None)
    # (MiniCPM3's logits_scaling divides the hidden states before the head: no factor after it)
    yield "minicpm3-before-head", lambda: T.MiniCPM3ForCausalLM(T.MiniCPM3Config(
        **SMALL, intermediate_size=64, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, dim_model_base=8)), (None, 1.0, None)
    yield "hyperclovax-multiplies", lambda: T.HyperCLOVAXForCausalLM(T.HyperCLOVAXConfig(
        **SMALL, intermediate_size=64, num_key_value_heads=2, logits_scaling=3.84)), (None, 3.84, None)
    # (Dory's head scales each token's logit by a learned factor: refused)
    yield "dory-per-token-scale", lambda: T.DoryForCausalLM(T.DoryConfig(
        **SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8)), None


@pytest.mark.parametrize("name", [n for n, _, _ in _unusual_heads()])
def test_unusual_heads_against_the_models_own_logits_and_loss(name):
    """Each head reproduced to the bit of the model's logits in bfloat16,
    and cross_entropy equals the model's own loss; or refused."""
    build, want = {n: (b, w) for n, b, w in _unusual_heads()}[name]
    torch.manual_seed(0)
    m, ids = _bf16(build().eval(), top=12.0)
    if name.startswith("dory"):
        with torch.no_grad():
            m.lm_head.logit_scale.mul_(torch.rand(V, generator=torch.Generator().manual_seed(4)) + 0.5)
    if want is None:
        with pytest.raises(ValueError, match="output head is not its weight"):
            lmmetrics.model_logits(m, ids)
        return
    out_dtype, factor, cap = want
    lazy = _same_metrics(m, ids)
    assert lazy.dtype == (out_dtype or "bfloat16") and lazy.scale == pytest.approx(factor or 1.0)
    assert lazy.softcap == cap
    with torch.no_grad():
        loss = float(m(ids, labels=ids).loss)
    assert lmmetrics.cross_entropy(lazy, ids, shift=True) == pytest.approx(loss, rel=1e-5)


def test_one_model_from_several_threads():
    """model_logits puts hooks on the model's head for one forward; another
    thread's forward of the same model (model_logits' or a plain one) ran
    through them: its head input was taken for this call's (wrong losses
    with check=False, spurious errors with the check). The hooks see this
    call's thread only."""
    import functools

    from helpers import run_threads

    torch.manual_seed(0)
    m = T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).eval()
    ids = [torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(k)) for k in range(6)]
    with torch.no_grad():
        want = [lmmetrics.cross_entropy(m(input_ids=x).logits.double(), x, shift=True) for x in ids]
    wrong = []

    def lazy(k, check):
        for r in range(8):
            i = (k + r) % len(ids)
            got = lmmetrics.cross_entropy(lmmetrics.model_logits(m, ids[i], check=check), ids[i], shift=True)
            if got != pytest.approx(want[i], rel=1e-5):
                wrong.append((k, i, got, want[i]))

    def plain():
        with torch.no_grad():
            for r in range(16):
                m(input_ids=ids[r % len(ids)])

    run_threads(*[functools.partial(lazy, k, k % 2 == 0) for k in range(4)], plain, switch=True)
    assert not wrong, wrong[:5]
