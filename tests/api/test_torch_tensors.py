"""Torch CPU tensors: zero-copy input, tensor output, agreement with torch."""
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest

import lmmetrics

torch = pytest.importorskip("torch")
F = torch.nn.functional


def test_agrees_with_torch_float64(isa):
    g = torch.Generator().manual_seed(0)
    for V in (17, 50257):
        z = torch.randn(2, 9, V, generator=g) * 3
        y = torch.randint(0, V, (2, 9), generator=g)
        y[0, :3] = -100
        ref = F.cross_entropy(z.double().reshape(-1, V), y.reshape(-1), reduction="none").reshape(2, 9)
        got = lmmetrics.token_nll(z, y)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == (2, 9)
        assert (got.double() - ref).abs().max().item() < 2e-6
        mean = F.cross_entropy(z.double().reshape(-1, V), y.reshape(-1)).item()
        assert lmmetrics.cross_entropy(z, y) == pytest.approx(mean, abs=1e-6)
        assert isinstance(lmmetrics.cross_entropy(z, y), float)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_half_and_double_tensors(isa, dtype):
    g = torch.Generator().manual_seed(1)
    z = (torch.randn(5, 1000, generator=g) * 2).to(dtype)
    y = torch.randint(0, 1000, (5,), generator=g)
    ref = F.cross_entropy(z.double(), y, reduction="none")  # from the values the kernel saw
    got = lmmetrics.token_nll(z, y)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert (got.double() - ref).abs().max().item() <= tol * (ref.abs().max().item() if dtype == torch.float64 else 1)


def test_shifted_view_is_not_copied(isa):
    g = torch.Generator().manual_seed(2)
    full = torch.randn(2, 8, 50, generator=g)
    ids = torch.randint(0, 50, (2, 8), generator=g)
    logits, targets = full[:, :-1], ids[:, 1:]
    ref = F.cross_entropy(logits.double().reshape(-1, 50), targets.reshape(-1), reduction="none")
    assert (lmmetrics.token_nll(logits, targets).reshape(-1).double() - ref).abs().max() < 2e-6
    # zero-copy: the core reads the tensor's memory, so writing there changes the result
    before = lmmetrics.token_nll(logits, targets)[0, 0].item()
    full[0, 0, targets[0, 0]] += 5.0
    after = lmmetrics.token_nll(logits, targets)[0, 0].item()
    assert after < before - 2


def test_requires_grad_tensor_is_fine():
    z = torch.randn(3, 10, requires_grad=True)
    y = torch.tensor([1, 2, 3])
    assert lmmetrics.cross_entropy(z, y) == pytest.approx(F.cross_entropy(z.double(), y).item(), abs=1e-6)


def test_bits_per_byte_with_torch_table():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, 30, generator=g)
    y = torch.tensor([1, 2, -1, 5])
    tb = torch.randint(0, 4, (30,), generator=g)
    expect = lmmetrics.bits_per_byte(z.numpy(), y.numpy(), tb.numpy())
    assert lmmetrics.bits_per_byte(z, y, tb) == expect


def test_bad_torch_inputs():
    with pytest.raises(TypeError, match="bfloat16"):
        lmmetrics.token_nll(torch.zeros(2, 3, dtype=torch.int32), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="out of range"):
        lmmetrics.token_nll(torch.zeros(2, 3), torch.tensor([0, 3]))
    z = torch.zeros(2, 3)
    z[1, 1] = math.nan
    with pytest.raises(ValueError, match="NaN in logits at row 1"):
        lmmetrics.token_nll(z, torch.tensor([0, 1]))


def test_integer_inputs_of_a_dtype_numpy_lacks_are_named():
    """Targets, token_bytes and document_ids given as a bfloat16 or float8
    tensor are the TypeError of any float dtype (they were torch's "Got
    unsupported ScalarType BFloat16" from .numpy())."""
    z, y = torch.zeros(2, 5), torch.tensor([1, 2])
    for dtype in (torch.bfloat16, torch.float8_e5m2):
        with pytest.raises(TypeError, match=f"targets must hold integers, got dtype {str(dtype)[6:]}"):
            lmmetrics.token_nll(z, y.to(dtype))
        with pytest.raises(TypeError, match="token_bytes must hold integers"):
            lmmetrics.bits_per_byte(z, y, torch.ones(5, dtype=dtype))
        with pytest.raises(TypeError, match="document_ids must hold integers"):
            lmmetrics.evaluate(z, y, document_ids=y.to(dtype))


def test_a_negative_view_is_read_as_its_values(isa):
    """A negative view (``is_neg()``: its memory holds the values negated,
    as the imaginary part of a conjugated complex tensor does) gives the
    numbers of the values it stands for: the core read its memory, the
    NLL of ``x`` for ``-x``."""
    g = torch.Generator().manual_seed(8)
    z, r = torch.randn(6, 40, generator=g) * 3, torch.randn(6, 40, generator=g) * 3
    y = torch.randint(0, 40, (6,), generator=g)
    zn, rn = torch._neg_view(z), torch._neg_view(r)
    assert zn.is_neg() and rn.is_neg()
    neg_z, neg_r = (-z).double(), (-r).double()
    nll = F.cross_entropy(neg_z, y, reduction="none")
    assert (lmmetrics.token_nll(zn, y).double() - nll).abs().max().item() < 2e-6
    assert lmmetrics.cross_entropy(zn, y) == pytest.approx(nll.mean().item(), abs=2e-6)
    entropy = -(neg_z.softmax(1) * neg_z.log_softmax(1)).sum(1)
    assert (lmmetrics.token_entropy(zn).double() - entropy).abs().max().item() < 2e-6
    kl = F.kl_div(neg_z.log_softmax(1), neg_r.log_softmax(1), log_target=True, reduction="none").sum(1)
    assert (lmmetrics.token_kl(zn, reference_logits=rn).double() - kl).abs().max().item() < 2e-6
    assert lmmetrics.evaluate(zn, y, reference_logits=rn).loss == pytest.approx(nll.mean().item(), abs=2e-6)
    yn = torch._neg_view(-y)  # targets too (they were torch's "Can't call numpy() on Tensor that has negative bit")
    assert yn.is_neg()
    assert torch.equal(lmmetrics.token_nll(z, yn), lmmetrics.token_nll(z, y))


def test_tensors_without_dense_values_are_named():
    y = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="logits is on the meta device"):
        lmmetrics.token_nll(torch.zeros(2, 3, device="meta"), y)
    with pytest.raises(ValueError, match="targets is on the meta device"):
        lmmetrics.token_nll(torch.zeros(2, 3), y.to("meta"))
    with pytest.raises(TypeError, match="logits must be a dense.*sparse_coo"):
        lmmetrics.token_nll(torch.zeros(2, 3).to_sparse(), y)
    with pytest.raises(TypeError, match="reference_logits must be a dense.*sparse_coo"):
        lmmetrics.token_kl(torch.zeros(2, 3), reference_logits=torch.zeros(2, 3).to_sparse())
    # a fake tensor (address 0) was the core's "internal error 5"
    fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")
    with fake_tensor.FakeTensorMode():
        fake = torch.zeros(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # (torch warns that a fake tensor's data_ptr is deprecated)
        with pytest.raises(ValueError, match="logits holds no values in memory"):
            lmmetrics.token_entropy(fake)
        with pytest.raises(ValueError, match="reference_logits holds no values in memory"):
            lmmetrics.token_kl(torch.zeros(2, 3), reference_logits=fake)


def test_torch_is_not_imported_for_numpy_input():
    code = ("import sys, numpy as np, lmmetrics; lmmetrics.token_nll(np.zeros((2, 3), np.float32), [0, 1]);"
            "lmmetrics.show_config(False); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_target_out_of_range_is_named_where_it_is_in_the_targets():
    """With shift=True the pass reads targets[..., 1:]: an out-of-range
    target is named at its index in the unshifted targets the caller gave
    (it was named one position early), on every path: numpy, torch, lazy
    logits, an Evaluator; the logits' rows keep their own positions."""
    rng = np.random.default_rng(5)
    z = rng.standard_normal((4, 8, 16)).astype(np.float32)
    t = rng.integers(0, 16, (4, 8))
    t[3, 6] = 99
    h = rng.standard_normal((4, 8, 5)).astype(np.float32)
    w = rng.standard_normal((16, 5)).astype(np.float32)
    want = r"^target 99 at position \(3, 6\) is out of range for a vocabulary of 16$"
    for shift in (False, True):
        for logits, targets in ((z, t), (torch.from_numpy(z), torch.from_numpy(t)),
                                (lmmetrics.projected(h, w), t)):
            with pytest.raises(ValueError, match=want):
                lmmetrics.cross_entropy(logits, targets, shift=shift)
        with pytest.raises(ValueError, match=want):
            lmmetrics.evaluate(z, t, shift=shift)
        with pytest.raises(ValueError, match=want):
            lmmetrics.Evaluator(shift=shift).update(z, t)
    t[3, 6] = 1
    z[3, 6, 2] = np.nan   # (the logits at (3, 6) are read under shift=True: named as row 30 of those given)
    for shift in (False, True):
        with pytest.raises(ValueError, match=r"^NaN in logits at row 30 \(position \(3, 6\)\)$"):
            lmmetrics.cross_entropy(z, t, shift=shift)
        with pytest.raises(ValueError, match=r"^NaN in logits at row 30 \(position \(3, 6\)\)$"):
            lmmetrics.Evaluator(shift=shift).update(torch.from_numpy(z), torch.from_numpy(t))


def test_row_and_target_errors_pickle_whole():
    """A process pool re-raises a worker's error by pickling it: the row and
    target errors come back with their message and fields (they could not
    be rebuilt: their constructors take the fields, not the message)."""
    import pickle

    rng = np.random.default_rng(6)
    z = rng.standard_normal((2, 5, 9)).astype(np.float32)
    t = rng.integers(0, 9, (2, 5))
    z[1, 2, 0] = np.nan
    t[0, 4] = 9
    for shift in (False, True):
        for logits, targets in ((z, np.clip(t, 0, 8)), (np.nan_to_num(z), t)):
            with pytest.raises(ValueError) as info:
                lmmetrics.cross_entropy(logits, targets, shift=shift)
            back = pickle.loads(pickle.dumps(info.value))
            assert type(back) is type(info.value) and str(back) == str(info.value)
            assert vars(back) == vars(info.value)
