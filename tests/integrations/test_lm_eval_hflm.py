"""lm-evaluation-harness's own HFLM.loglikelihood_rolling (the wikitext
task's computation) on a tiny random Llama with a tokenizer trained here,
against the recipe the docs give (docs/guides/long-texts.md): the ids as
lm-eval's model encodes them (special tokens included, as lm-eval >= 0.4.9.2
does) and its prefix token."""
import pytest

pytestmark = pytest.mark.peers  # against a heavy peer's own code: pytest -m peers

import lmmetrics

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
huggingface = pytest.importorskip("lm_eval.models.huggingface")
from lm_eval.api.instance import Instance  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

TEXT = "naïve café 日本語 🙂 the cat sat on the mat. " * 10


def _bos_tokenizer():
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("max_length", [16, 32])
def test_sliding_window_nll_gives_lm_evals_rolling_loglikelihood(max_length):
    tokenizer = _bos_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, bos_token_id=0, eos_token_id=1,
                                         max_position_embeddings=64)).eval()
    lm = huggingface.HFLM(pretrained=model, tokenizer=tokenizer, max_length=max_length, batch_size=1, device="cpu")
    (want,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (TEXT,), 0)], disable_tqdm=True)
    # the recipe: ids as lm-eval's model encodes them, its prefix token (BOS, else EOS)
    ids = tokenizer(TEXT).input_ids
    assert ids[0] == tokenizer.bos_token_id  # the BOS lm-eval scores after its own prefix
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    assert prefix == lm.prefix_token_id
    nll = lmmetrics.sliding_window_nll(model, ids, max_length=max_length, prefix_token=prefix)
    assert -float(nll.double().nansum()) == pytest.approx(want, rel=1e-6)
    # text encoded without special tokens gives another number (one BOS fewer)
    other = lmmetrics.sliding_window_nll(model, tokenizer(TEXT, add_special_tokens=False).input_ids,
                                         max_length=max_length, prefix_token=prefix)
    assert abs(-float(other.double().nansum()) - want) > 1e-3
