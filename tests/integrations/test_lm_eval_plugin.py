"""lmmetrics.lm_eval.LazyHFLM ("hf-lmmetrics") against lm-eval's own HFLM
on a tiny random Llama with a tokenizer trained here: every loglikelihood,
is_greedy and rolling loglikelihood, simple_evaluate on the local tasks of
tests/data/lm_eval, batch sizes 1, 4 and auto, the fallbacks to HFLM, the
registration and the command line.

The reference is HFLM(softmax_dtype="float32", logits_cache=False): with
logits_cache=True, HFLM scores the shorter member of a cache group whose
continuations differ in length at the representative's leading positions
(the group shares every token but the last; LazyHFLM scores each member at
its own trailing positions, as HFLM without the cache does)."""
import gc
import glob
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.peers  # against a heavy peer's own code: pytest -m peers

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
huggingface = pytest.importorskip("lm_eval.models.huggingface")
import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

import lmmetrics  # noqa: E402
from lmmetrics.lm_eval import LazyHFLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TASKS = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
TEXT = "naïve café 日本語 🙂 the cat sat on the mat. "
MAX_LENGTH = 32
HFLM = huggingface.HFLM


@pytest.fixture(scope="module")
def tokenizer():
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.train_from_iterator([TEXT * 10], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")


def _llama(dtype=torch.float32):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, bos_token_id=0, eos_token_id=1,
                                        max_position_embeddings=128)).to(dtype).eval()


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only loses time to threads
    # batch_size="auto" runs gc.collect() several times (accelerate's and
    # lm-eval's cache clearing): 0.6 s each over torch, transformers and
    # lm-eval's objects unless those are frozen out of the collector
    gc.freeze()
    yield _llama()
    gc.unfreeze()
    torch.set_num_threads(threads)


def _lm(cls, model, tokenizer, **kwargs):
    kwargs = {"batch_size": 1, "max_length": MAX_LENGTH, **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cls(pretrained=model, tokenizer=tokenizer, device="cpu", **kwargs)


def _reference(model, tokenizer, softmax_dtype="float32"):
    return _lm(HFLM, model, tokenizer, softmax_dtype=softmax_dtype, logits_cache=False)


def _string_requests():
    """Shared contexts with one-token and longer continuations, an empty
    context, a context left-truncated at MAX_LENGTH."""
    contexts = ["the cat", "naïve café", "", TEXT * 3]
    continuations = [" sat", " on", " the mat.", " 日本語 🙂", "x"]
    return [Instance("loglikelihood", {}, (c, x), i)
            for i, (c, x) in enumerate((c, x) for c in contexts for x in continuations)]


@pytest.fixture(scope="module")
def token_requests(model, tokenizer):
    """Token-level requests: greedy continuations of 1-3 tokens (from the
    model's own argmax) and the same with a token changed, the pair whose
    cache group holds continuations of different lengths, and one longer
    than the window (left truncation)."""
    reqs = []
    for i, text in enumerate(["the cat sat", "日本語 🙂", "naïve", "on the mat. the"]):
        ctx = tokenizer(text).input_ids
        ids = list(ctx)
        with torch.no_grad():
            for _ in range(1 + i % 3):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        greedy = ids[len(ctx):]
        reqs.append((None, ctx, greedy))
        reqs.append((None, ctx, greedy[:-1] + [(greedy[-1] + 1) % 320]))
    reqs += [(None, [0, 5, 6, 7], [8, 9]), (None, [0, 5, 6, 7, 8], [9]), (None, [0, 5, 6, 7, 8], [10])]
    long = tokenizer(TEXT * 4).input_ids
    reqs.append((None, long[:-3], long[-3:]))
    return reqs


def _assert_close(got, want):
    assert len(got) == len(want)
    for (g, g_greedy), (w, w_greedy) in zip(got, want):
        assert abs(g - w) <= 1e-4 + 1e-6 * abs(w), (g, w)
        assert g_greedy == w_greedy


@pytest.mark.parametrize("logits_cache", [False, True])
@pytest.mark.parametrize("batch_size", [1, 4, "auto"])
def test_loglikelihood_matches_hflm(model, tokenizer, token_requests, batch_size, logits_cache):
    ref = _reference(model, tokenizer)
    lm = _lm(LazyHFLM, model, tokenizer, batch_size=batch_size, max_batch_size=8, logits_cache=logits_cache)
    reqs = _string_requests()
    _assert_close(lm.loglikelihood(reqs, disable_tqdm=True), ref.loglikelihood(reqs, disable_tqdm=True))
    want = ref._loglikelihood_tokens(token_requests, disable_tqdm=True)
    got = lm._loglikelihood_tokens(token_requests, disable_tqdm=True)
    _assert_close(got, want)
    assert [g for _, g in got[:8]] == [True, False] * 4  # the greedy continuations, then one token changed


def test_rolling_loglikelihood_matches_hflm(model, tokenizer):
    docs = [Instance("loglikelihood_rolling", {}, (TEXT * n + "the end.",), n) for n in (1, 4, 12)]
    want = _reference(model, tokenizer).loglikelihood_rolling(docs, disable_tqdm=True)
    assert len(tokenizer(TEXT * 12).input_ids) > 4 * MAX_LENGTH  # several windows, batched across documents
    for batch_size in (1, 4, "auto"):
        got = _lm(LazyHFLM, model, tokenizer, batch_size=batch_size, max_batch_size=8).loglikelihood_rolling(
            docs, disable_tqdm=True)
        for g, w in zip(got, want):
            assert abs(g - w) <= 1e-4 + 1e-6 * abs(w), (batch_size, g, w)


def test_bfloat16_model_matches_hflm_with_a_float32_softmax(tokenizer, model):
    bf16 = _llama(torch.bfloat16)
    reqs = _string_requests()
    want = _lm(HFLM, bf16, tokenizer, batch_size=4, softmax_dtype="float32", logits_cache=False).loglikelihood(
        reqs, disable_tqdm=True)
    # (the same batches: a bfloat16 forward depends on the padded width)
    lazy = _lm(LazyHFLM, bf16, tokenizer, batch_size=4, logits_cache=False)
    _assert_close(lazy.loglikelihood(reqs, disable_tqdm=True), want)


@pytest.mark.parametrize("case", ["ties", "autocast"])
def test_greedy_ties_full_window_continuations_and_autocast_match_hflm(tokenizer, case):
    """Exact ties at the argmax (two head rows equal, every other logit 0:
    lm-eval's argmax takes the lower index, so a continuation of the higher
    one is not greedy), continuations of max_length tokens (the whole
    window scored, after one context token or a left-truncated context),
    and HFLM's mixed_precision_dtype (the forward under bfloat16 autocast,
    the head applied outside it by the lazy path)."""
    model, kwargs = _llama(), {}
    if case == "ties":
        with torch.no_grad():
            w = model.get_output_embeddings().weight
            v = w[7].clone() * 5
            w.zero_()
            w[7] = w[9] = v
    else:
        kwargs = {"mixed_precision_dtype": "bfloat16"}
    reqs = []
    for text in ["the cat sat", "naïve", "on the mat. the"]:
        ctx = tokenizer(text).input_ids
        ids = list(ctx)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
            for _ in range(3):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        greedy = ids[len(ctx):]
        reqs += [(None, ctx, greedy), (None, ctx, [9 if t == 7 else 7 if t == 0 else t for t in greedy])]
    long = tokenizer(TEXT * 4).input_ids
    reqs += [(None, long[:1], long[1:1 + 8]), (None, long[:-8], long[-8:])]
    want = _lm(HFLM, model, tokenizer, batch_size=3, max_length=8, softmax_dtype="float32", logits_cache=False,
               **kwargs)._loglikelihood_tokens(reqs, disable_tqdm=True)
    if case == "ties":
        assert [g for _, g in want[:6]].count(True) >= 3 and any(7 in r[2] for r in reqs)  # both outcomes, a tie
    for batch_size in (1, 3):
        got = _lm(LazyHFLM, model, tokenizer, batch_size=batch_size, max_length=8, **kwargs)._loglikelihood_tokens(
            reqs, disable_tqdm=True)
        _assert_close(got, want)


def test_a_model_with_fewer_positions_than_the_probe(tokenizer):
    """The one-time check of the model reads at most max_length tokens: a
    model with 6 learned positions is served by the lazy path (no fallback
    warning) and matches HFLM."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt = GPT2LMHeadModel(GPT2Config(vocab_size=320, n_embd=32, n_layer=1, n_head=2, n_positions=6,
                                     bos_token_id=0, eos_token_id=1)).eval()
    reqs = [Instance("loglikelihood", {}, (c, x), i)
            for i, (c, x) in enumerate([("the cat", " sat"), ("the cat sat on", " the mat."), ("", " on")])]
    want = _lm(HFLM, gpt, tokenizer, max_length=6, softmax_dtype="float32", logits_cache=False).loglikelihood(
        reqs, disable_tqdm=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _lm(LazyHFLM, gpt, tokenizer, max_length=6).loglikelihood(reqs, disable_tqdm=True)
    assert not [w for w in seen if "hf-lmmetrics" in str(w.message)]
    _assert_close(got, want)


def test_the_head_runs_only_where_a_continuation_is_scored(model, tokenizer, token_requests, monkeypatch):
    lm = _lm(LazyHFLM, model, tokenizer, batch_size=4)
    assert lm._lazy_plan() is not None  # (model_logits' check, on a probe, is done)
    rows, calls = [], []
    real_rows = lmmetrics._engine.lazy.Projected.rows
    monkeypatch.setattr(lmmetrics._engine.lazy.Projected, "rows",
                        lambda self, index, *a, **k: rows.append(len(index)) or real_rows(self, index, *a, **k))
    hook = model.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    try:
        lm._loglikelihood_tokens(token_requests, disable_tqdm=True)
    finally:
        hook.remove()
    assert not calls  # the head module never ran on a batch
    assert sum(rows) == sum(len(x) for _, _, x in token_requests)


def test_auto_batch_size_probes_the_lazy_path(model, tokenizer):
    # a head that runs out of memory on more than 64 positions at once, as
    # HFLM's (B, T, V) logits would on a real device
    def oom(module, args, out):
        if out.shape[:-1].numel() > 64:
            raise RuntimeError("CUDA out of memory. (simulated by the test)")

    hook = model.get_output_embeddings().register_forward_hook(oom)
    try:
        assert _lm(HFLM, model, tokenizer, batch_size="auto", max_batch_size=16)._detect_batch_size() == 2
        lm = _lm(LazyHFLM, model, tokenizer, batch_size="auto", max_batch_size=16)
        assert lm._detect_batch_size() == 16
        docs = [Instance("loglikelihood_rolling", {}, (TEXT * 4,), 0)]
        got = lm.loglikelihood_rolling(docs, disable_tqdm=True)
    finally:
        hook.remove()
    want = _reference(model, tokenizer).loglikelihood_rolling(docs, disable_tqdm=True)
    assert abs(got[0] - want[0]) <= 1e-4 + 1e-6 * abs(want[0])


@pytest.fixture(scope="module")
def task_manager():
    # the local tasks only (indexing lm-eval's own thousands of task files takes a minute)
    return TaskManager(include_path=str(TASKS), include_defaults=False)


@pytest.fixture(scope="module")
def reference_results(model, tokenizer, task_manager):
    """simple_evaluate's numbers from HFLM with float32 and float64 softmaxes."""
    return {dtype: _evaluate(_reference(model, tokenizer, dtype), task_manager) for dtype in ("float32", "float64")}


def _evaluate(lm, task_manager):
    res = lm_eval.simple_evaluate(model=lm, tasks=["lmmetrics_tiny_mc", "lmmetrics_tiny_ppl"],
                                  task_manager=task_manager, verbosity="ERROR")
    return res["results"]


@pytest.mark.parametrize("batch_size", [1, 4, "auto"])
def test_simple_evaluate_on_local_tasks(model, tokenizer, task_manager, reference_results, batch_size):
    got = _evaluate(_lm(LazyHFLM, model, tokenizer, batch_size=batch_size, max_batch_size=8), task_manager)
    want, exact = reference_results["float32"], reference_results["float64"]
    for key in ("acc,none", "acc_norm,none"):
        assert got["lmmetrics_tiny_mc"][key] == want["lmmetrics_tiny_mc"][key]
    bpb = got["lmmetrics_tiny_ppl"]["bits_per_byte,none"]
    assert bpb == pytest.approx(want["lmmetrics_tiny_ppl"]["bits_per_byte,none"], rel=1e-7, abs=0)
    # closer to HFLM's float64 log-softmax and sums than HFLM's float32 is
    assert bpb == pytest.approx(exact["lmmetrics_tiny_ppl"]["bits_per_byte,none"], rel=1e-8, abs=0)
    for key in ("word_perplexity,none", "byte_perplexity,none"):
        assert got["lmmetrics_tiny_ppl"][key] == pytest.approx(want["lmmetrics_tiny_ppl"][key], rel=1e-6)


def _seq2seq():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=320, d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                               d_kv=16, decoder_start_token_id=0, pad_token_id=0)).eval()


@pytest.mark.parametrize("case", ["seq2seq", "hook on the head", "tensor parallel", "no input embeddings"])
def test_models_the_lazy_path_refuses_are_computed_by_hflm(model, tokenizer, case, monkeypatch):
    hook = None
    if case == "seq2seq":
        m, why = _seq2seq(), "seq2seq model"
    elif case == "hook on the head":
        m = model
        hook = m.get_output_embeddings().register_forward_hook(lambda mod, a, out: out + 0.5)
        why = "forward hook"
    elif case == "tensor parallel":
        m, why = model, "tensor-parallel"
        monkeypatch.setattr(m, "_tp_size", 2, raising=False)
    else:  # (transformers' default get_input_embeddings raises NotImplementedError; it crashed the probe)
        m, why = model, "no input embeddings here"

        def absent():
            raise NotImplementedError("no input embeddings here")

        monkeypatch.setattr(m, "get_input_embeddings", absent)
    try:
        reqs = _string_requests()[:6]
        want = _lm(HFLM, m, tokenizer, batch_size=4).loglikelihood(reqs, disable_tqdm=True)
        lm = _lm(LazyHFLM, m, tokenizer, batch_size=4)
        with pytest.warns(UserWarning, match="hf-lmmetrics: computing log-likelihoods with HFLM's") as seen:
            got = lm.loglikelihood(reqs, disable_tqdm=True)
        assert why in str(seen[0].message) and "\n" not in str(seen[0].message)
        assert got == want  # HFLM's own computation
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per model
            lm.loglikelihood(reqs[:1], disable_tqdm=True)
    finally:
        if hook is not None:
            hook.remove()


def test_registered_with_lm_eval_and_declared_as_an_entry_point():
    assert get_model("hf-lmmetrics") is LazyHFLM
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    target = project["entry-points"]["lm_eval.models"]["hf-lmmetrics"]
    module, name = target.split(":")
    assert getattr(__import__(module, fromlist=[name]), name) is LazyHFLM


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    src = Path(lmmetrics.__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(src)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def test_importing_lmmetrics_does_not_import_lm_eval():
    code = "import sys, lmmetrics, lmmetrics.cli; print('lm_eval' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=True)
    assert out.stdout.strip() == "False"


def test_without_lm_evals_hf_extra_the_import_error_says_what_to_install():
    """`pip install lm-eval` alone brings no accelerate, which lm-eval's
    HFLM imports: importing lmmetrics.lm_eval said only "No module named
    'accelerate'"; it now names lm-eval's hf extra."""
    code = ("import sys; sys.modules['accelerate'] = None\n"
            "try:\n    import lmmetrics.lm_eval\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=True)
    assert "pip install 'lm-eval[hf]'" in out.stdout and "accelerate" in out.stdout, out.stdout


# `python -m lmmetrics.lm_eval ARGS`, in a fresh interpreter, as runpy runs
# -m (alter_sys: the module runs as __main__ with sys.argv set), with one
# change for speed: lm-eval's TaskManager indexes the --include_path tasks
# only, not its own thousands of task files (a minute on 2 cores)
_AS_MAIN = """
import runpy, sys
from lm_eval.tasks import manager
init = manager.TaskManager.__init__
manager.TaskManager.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "include_defaults": False})
sys.argv[0] = "lmmetrics.lm_eval"
runpy.run_module("lmmetrics.lm_eval", run_name="__main__", alter_sys=True)
"""


def test_command_line(model, tokenizer, reference_results, tmp_path):
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    cmd = [sys.executable, "-c", _AS_MAIN, "run", "--model", "hf-lmmetrics",
           "--model_args", f"pretrained={tmp_path / 'model'},max_length={MAX_LENGTH},dtype=float32",
           "--tasks", "lmmetrics_tiny_mc,lmmetrics_tiny_ppl", "--include_path", str(TASKS),
           "--device", "cpu", "--batch_size", "4", "--output_path", str(tmp_path / "out")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "found in sys.modules" not in out.stderr  # (runpy's warning: the module ran once)
    (path,) = glob.glob(str(tmp_path / "out" / "**" / "results*.json"), recursive=True)
    got = json.loads(Path(path).read_text())["results"]
    want = reference_results["float32"]
    assert got["lmmetrics_tiny_mc"]["acc,none"] == want["lmmetrics_tiny_mc"]["acc,none"]
    assert got["lmmetrics_tiny_ppl"]["bits_per_byte,none"] == pytest.approx(
        want["lmmetrics_tiny_ppl"]["bits_per_byte,none"], rel=1e-7, abs=0)
