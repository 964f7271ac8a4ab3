"""`flashtune::attention` without a GPU: the operator's registration, its fake implementation under
torch.compile(fullgraph=True) on fake CUDA tensors, opcheck's checks with a CPU stand-in kernel,
the backward seam's choice, the SDPA switch and the SDPA-compatible signature.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import tuner
import tuner.op as op
from tuner.backward import NoBackwardError, choose
from tuner.dispatch import out_layout
from tuner.torch_attention import MATH, Case


@pytest.fixture(scope="module")
def cpu_kernels():
    """A CPU implementation of both ops (torch's math backend) so opcheck can run them for real:
    the stand-in computes, the registration under test (schema, fake, autograd) is the real one."""
    def forward(q, k, v, is_causal=False, scale=None, max_error=None, need_lse=True, bottom_right=False):
        o, lse = MATH.forward(q, k, v, op.op_mask(is_causal, bottom_right), scale)
        size, stride = out_layout(q)
        return torch.empty_strided(size, stride, dtype=o.dtype).copy_(o), lse.contiguous()

    lib = torch.library.Library("flashtune", "IMPL")
    lib.impl("attention", forward, "CPU")
    lib.impl("attention_backward", op._backward, "CPU")   # the seam itself, on the math backend
    mp = pytest.MonkeyPatch()
    mp.setenv("TUNER_BACKWARD", "math")
    yield
    mp.undo()
    lib._destroy()


def _inputs(b, h, hk, nq, nk, d, layout="bhnd", dtype=torch.float32, grad=True):
    def make(heads, n):
        t = torch.randn(b, n, heads, d, dtype=dtype).transpose(1, 2) if layout == "bnhd" else \
            torch.randn(b, heads, n, d, dtype=dtype)
        return t.requires_grad_(grad)

    return make(h, nq), make(hk, nk), make(hk, nk)


@pytest.mark.parametrize("b,h,hk,nq,nk,causal,layout,scale", [
    (2, 4, 2, 5, 7, True, "bhnd", None),      # GQA, Nq < Nk, top-left causal
    (1, 2, 2, 9, 4, True, "bnhd", 0.3),       # Nq > Nk, a custom scale, (B, N, H, D) storage
    (2, 3, 1, 16, 16, False, "bnhd", None),   # MQA
])
def test_opcheck_schema_fake_autograd(cpu_kernels, b, h, hk, nq, nk, causal, layout, scale):
    q, k, v = _inputs(b, h, hk, nq, nk, 64, layout)
    result = torch.library.opcheck(torch.ops.flashtune.attention, (q, k, v, causal, scale, None, True))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("b,h,hk,nq,nk", [(2, 4, 2, 5, 9), (1, 2, 1, 6, 6)], ids=["fewer-q", "square"])
def test_opcheck_bottom_right(cpu_kernels, b, h, hk, nq, nk):
    q, k, v = _inputs(b, h, hk, nq, nk, 64, "bnhd")
    result = torch.library.opcheck(torch.ops.flashtune.attention, (q, k, v, True, None, None, True, True))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.filterwarnings("ignore:Lower right causal bias")
@pytest.mark.parametrize("nq,nk", [(5, 9), (9, 5)], ids=["fewer-q", "more-q"])
def test_bottom_right_through_the_op_is_causal_lower_right(cpu_kernels, nq, nk):
    """mask="causal_br" reaches the op as bottom_right=True: O and the gradients are torch's
    causal_lower_right on the rows that see a key; rows that see none (Nq > Nk) are O = 0, LSE
    -inf, and pass no gradient (the backward seam hands the kernels LSE +inf there)."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = _inputs(2, 4, 2, nq, nk, 32)
    o, lse = torch.ops.flashtune.attention(q, k, v, True, None, None, True, True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(nq, nk), enable_gqa=True)
    empty = max(0, nq - nk)
    torch.testing.assert_close(o[:, :, empty:], ref[:, :, empty:], rtol=1e-4, atol=1e-5)
    assert (o[:, :, :empty] == 0).all() and torch.isneginf(lse[:, :, :empty]).all()
    assert torch.isfinite(lse[:, :, empty:]).all()
    g = torch.randn_like(o)
    ours = torch.autograd.grad(o, (q, k, v), g)
    theirs = torch.autograd.grad(ref[:, :, empty:], (q, k, v), g[:, :, empty:])
    for a, b in zip(ours, theirs):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_cpu_stand_in_is_attention(cpu_kernels):
    """So the checks above are of a real computation: O and its gradients against SDPA's math."""
    q, k, v = _inputs(2, 4, 2, 6, 9, 32, "bnhd")
    o, lse = torch.ops.flashtune.attention(q, k, v, True, None, None, True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-5)
    assert o.stride() == out_layout(q)[1]   # (B, N, H, D) storage, as q
    g = torch.randn_like(o)
    ours = torch.autograd.grad(o, (q, k, v), g)
    theirs = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_lse_is_not_differentiable_and_need_lse_false_refuses_backward(cpu_kernels):
    q, k, v = _inputs(1, 2, 2, 4, 4, 32)
    o, lse = torch.ops.flashtune.attention(q, k, v, False, None, None, True)
    assert lse.grad_fn is None and o.grad_fn is not None
    o2, _ = torch.ops.flashtune.attention(q, k, v, False, None, None, False)
    with pytest.raises(RuntimeError, match="need_lse=False"):
        o2.sum().backward()


# ---- torch.compile on fake CUDA tensors ----

class Block(torch.nn.Module):
    """A Llama-style attention block: fused QKV projection, GQA, (B, N, H, D) views, output projection."""

    def __init__(self, h=4, hk=2, d=64, sdpa=False):
        super().__init__()
        self.h, self.hk, self.d, self.sdpa = h, hk, d, sdpa
        self.qkv = torch.nn.Linear(h * d, (h + 2 * hk) * d, bias=False, dtype=torch.bfloat16)
        self.out = torch.nn.Linear(h * d, h * d, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.d, self.hk * self.d, self.hk * self.d], -1)
        q, k, v = (t.view(b, n, -1, self.d).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:   # the model's own SDPA call, for the switch
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            y = tuner.attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, -1)) * 2


def _trace(model_kw: dict, n: int = 33, dynamic: bool = False):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.device("meta"):
        model = Block(**model_kw)
    with mode:
        model = model.to_empty(device="cuda").requires_grad_(False)
        x = torch.empty(2, n, model.h * model.d, device="cuda", dtype=torch.bfloat16)
        y = torch.compile(model, fullgraph=True, backend=backend, dynamic=dynamic)(x)
    return graphs, y


def _ops(graphs) -> list[str]:
    return [str(node.target) for g in graphs for node in g.graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_traces_the_op(dynamic):
    graphs, y = _trace({}, dynamic=dynamic)
    assert len(graphs) == 1   # fullgraph: a break would have raised; one graph
    assert "flashtune.attention" in _ops(graphs)
    assert y.shape == (2, 33, 256) and y.dtype == torch.bfloat16 and y.device.type == "cuda"


def test_compile_with_the_sdpa_switch_routes_the_models_own_call():
    with tuner.sdpa_override():
        graphs, _ = _trace({"sdpa": True})
    ops = _ops(graphs)
    assert "flashtune.attention" in ops
    assert not any("scaled_dot_product" in o for o in ops), ops
    graphs, _ = _trace({"sdpa": True})   # switched off again: SDPA's own op
    assert any("scaled_dot_product" in o for o in _ops(graphs))


def test_fake_implementation_layouts_and_dtypes():
    with FakeTensorMode():
        q = torch.empty(2, 7, 8, 128, device="cuda", dtype=torch.float8_e4m3fn).transpose(1, 2)
        kv = torch.empty(2, 2, 11, 128, device="cuda", dtype=torch.float8_e4m3fn)
        o, lse = torch.ops.flashtune.attention(q, kv, kv, True, None, None, False)
        assert o.dtype == torch.bfloat16 and o.shape == q.shape and o.stride() == (7 * 8 * 128, 128, 8 * 128, 1)
        assert lse.shape == (2, 8, 7) and lse.dtype == torch.float32 and lse.is_contiguous()
        x = torch.empty(1, 2, 16, 84, device="cuda", dtype=torch.float16)   # no kernel takes d=84: SDPA runs it
        o, lse = torch.ops.flashtune.attention(x, x, x, False, None, None, False)
        assert o.shape == x.shape and lse.shape == (1, 2, 16)


# ---- the backward seam ----

def _case(dtype=torch.bfloat16, d=128, nq=64, nk=64, causal=True, gqa=False, cc=(9, 0)):
    return Case(dtype, d, nq, nk, causal, gqa, cc)


@pytest.mark.parametrize("case,expected", [
    (_case(), "cudnn"),
    (_case(d=256), "flash"),                                   # cuDNN's backward stops at 128 here
    (_case(d=256, nq=10, nk=300), "efficient"),                 # FA2's causal diagonal is the other one
    (_case(d=256, nq=10, nk=300, causal=False), "flash"),
    (_case(nq=10, nk=300), "efficient"),                       # cuDNN's causal with Nq != Nk is not trusted
    (_case(nq=10, nk=300, causal=False), "cudnn"),
    (_case(nq=1, nk=1), "flash"),                              # cuDNN refuses s_q = s_kv = 1
    (_case(nq=2, nk=1, causal=False), "flash"),                # and one key (not asked)
    (_case(nq=1, nk=300, causal=False), "flash"),              # a decode step: cuDNN runs its forward, not its backward
    (_case(dtype=torch.float32), "efficient"),
    (_case(dtype=torch.float16, d=96, cc=(7, 5)), "efficient"),
    (_case(dtype=torch.float32, d=100), "math"),
])
def test_backward_choice(case, expected, monkeypatch):
    monkeypatch.delenv("TUNER_BACKWARD", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    assert choose(case).name == expected


def test_cudnn_serves_a_decode_steps_forward_but_not_its_backward(monkeypatch):
    """One query against many keys: cuDNN's forward is a dispatched peer there (measured against
    float64, PERF_NOTES d10), its backward gave dq, dk, dv 0.92-0.94 off on the H100."""
    from tuner.torch_attention import BACKENDS

    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    step = _case(nq=1, nk=300, causal=False)
    assert BACKENDS["cudnn"].why_not(step) is None
    assert "2 or more query rows" in BACKENDS["cudnn"].why_not_backward(step)
    assert BACKENDS["cudnn"].why_not_backward(_case(nq=2, nk=300, causal=False)) is None


def test_no_backward_for_fp8_raises_naming_why(monkeypatch):
    monkeypatch.delenv("TUNER_BACKWARD", raising=False)
    with pytest.raises(NoBackwardError, match="math takes fp32/fp16/bf16"):
        choose(_case(dtype=torch.float8_e4m3fn))


def test_forced_backward_and_a_bad_name(monkeypatch):
    monkeypatch.setenv("TUNER_BACKWARD", "efficient")
    assert choose(_case()).name == "efficient"
    monkeypatch.setenv("TUNER_BACKWARD", "fa9")
    with pytest.raises(ValueError, match="TUNER_BACKWARD='fa9'"):
        choose(_case())


# ---- the SDPA switch and the signature ----

def test_switch_routes_and_restores(monkeypatch):
    original = F.scaled_dot_product_attention
    routed = []
    monkeypatch.setattr(op, "attention", lambda *a, **kw: routed.append(kw) or "ours")
    monkeypatch.setattr(op, "_served", lambda q, k, v: None)
    q = torch.randn(1, 2, 8, 64)
    with tuner.sdpa_override():
        with tuner.sdpa_override():   # nests
            assert F.scaled_dot_product_attention(q, q, q, is_causal=True) == "ours"
        assert F.scaled_dot_product_attention is not original
    assert F.scaled_dot_product_attention is original
    assert routed[0]["is_causal"] is True
    tuner.set_sdpa_override(True)
    try:
        assert F.scaled_dot_product_attention is op.routed_sdpa
    finally:
        tuner.set_sdpa_override(False)
    assert F.scaled_dot_product_attention is original


def test_switch_leaves_what_it_does_not_serve_to_sdpa_with_one_warning():
    q = torch.randn(1, 2, 8, 64)   # a CPU call: SDPA's, with one warning naming why
    ref = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    op._warned.clear()
    with tuner.sdpa_override(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        b = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(a, ref)
    torch.testing.assert_close(b, ref)
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and "stays with torch (inputs on cpu)" in msgs[0], msgs


def test_mask_and_dropout_go_to_sdpa_with_one_warning_each():
    q = torch.randn(1, 2, 8, 64)
    mask = torch.rand(8, 8) > 0.3
    op._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = tuner.attention(q, q, q, attn_mask=mask)
        tuner.attention(q, q, q, attn_mask=mask)
        torch.manual_seed(0)
        dropped = tuner.attention(q, q, q, dropout_p=0.5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    torch.manual_seed(0)
    torch.testing.assert_close(dropped, F.scaled_dot_product_attention(q, q, q, dropout_p=0.5))
    msgs = sorted(str(w.message) for w in caught)
    assert len(msgs) == 2 and "an attn_mask is not served" in msgs[0] and "dropout is not served" in msgs[1], msgs


def test_causal_spellings():
    with pytest.raises(ValueError, match="disagree"):
        tuner.attention(*_inputs(1, 1, 1, 4, 4, 64, grad=False), is_causal=True, causal=False)
    with pytest.raises(ValueError, match="CUDA tensors"):   # both spellings reach the same validation
        tuner.attention(*_inputs(1, 1, 1, 4, 4, 64, grad=False), causal=True)
    with pytest.raises(ValueError, match=r"is_causal=True \(the top-left diagonal\) and mask='bottom_right' disagree"):
        tuner.attention(*_inputs(1, 1, 1, 4, 8, 64, grad=False), is_causal=True, mask="bottom_right")
    with pytest.raises(ValueError, match="mask must be one of none, causal, causal_br"):
        tuner.attention(*_inputs(1, 1, 1, 4, 8, 64, grad=False), mask="diagonal")
    with pytest.raises(ValueError, match="exclude each other"):
        tuner.attention(*_inputs(1, 1, 1, 4, 8, 64, grad=False), attn_mask=torch.ones(4, 8, dtype=torch.bool),
                        mask="causal_br")
    with pytest.raises(ValueError, match=r"attn_mask takes a tensor; a mask name goes in mask= \(mask='causal_br'\)"):
        tuner.attention(*_inputs(1, 1, 1, 4, 8, 64, grad=False), "causal_br")   # the dispatcher's positional mask


@pytest.mark.parametrize("kw,mask", [({}, "none"), ({"is_causal": True}, "causal"), ({"causal": True}, "causal"),
                                     ({"mask": "causal_br"}, "causal_br"), ({"mask": "bottom_right"}, "causal_br"),
                                     ({"mask": "causal", "is_causal": True}, "causal"), ({"mask": "none"}, "none")])
def test_mask_spellings_reach_the_dispatcher(monkeypatch, kw, mask):
    """is_causal keeps SDPA's top-left meaning; the bottom-right diagonal is mask="causal_br"."""
    seen = []

    class Spy:
        def output(self, q, k, v, causal, scale, max_error):
            seen.append(causal)
            return "o"

    monkeypatch.setattr(op, "_dispatcher", lambda: Spy())
    assert tuner.attention(*_inputs(1, 2, 1, 4, 8, 64, grad=False), **kw) == "o"
    assert seen == [mask]


def test_dropout_with_bottom_right_masks_as_causal_lower_right():
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = _inputs(1, 2, 2, 4, 8, 32, grad=False)
    op._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(1)
        ours = tuner.attention(q, k, v, dropout_p=0.3, mask="causal_br")
    torch.manual_seed(1)
    ref = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, attn_mask=causal_lower_right(4, 8))
    torch.testing.assert_close(ours, ref)


def test_fp8_with_gradients_is_refused_not_dropped():
    q = torch.zeros(1, 2, 16, 64, dtype=torch.float8_e4m3fn).requires_grad_()
    with pytest.raises(ValueError, match="no backward for float8_e4m3fn"):
        tuner.attention(q, q, q)


def test_operator_kernels_take_the_schema_defaults():
    """A compiled graph calls an operator's kernel without the arguments left at their schema
    defaults, so every kernel of the flashtune operators must default them the same way."""
    import inspect

    from tuner.kvcache import kvcache_forward
    from tuner.varlen import varlen_backward, varlen_forward

    kernels = {"attention": op._forward, "attention_backward": op._backward, "attention_varlen": varlen_forward,
               "attention_varlen_backward": varlen_backward, "kvcache_attention": kvcache_forward}
    for name, fn in kernels.items():
        schema = getattr(torch.ops.flashtune, name).default._schema
        params = list(inspect.signature(fn).parameters.values())
        assert len(params) >= len(schema.arguments), name
        for arg, p in zip(schema.arguments, params):
            if arg.has_default_value():
                assert p.default is not inspect.Parameter.empty and p.default == arg.default_value, (name, arg.name)


def test_switch_leaves_nested_tensors_to_sdpa():
    """A model's SDPA call on nested (jagged) tensors stays with SDPA, named as such, before any
    check that would read their ragged shape."""
    njt = torch.nested.nested_tensor([torch.randn(3, 4, 8), torch.randn(5, 4, 8)], layout=torch.jagged).transpose(1, 2)
    assert op._served(njt, njt, njt) == "nested (jagged) tensors"


def test_switch_leaves_empty_inputs_to_sdpa():
    """A model's SDPA call on an empty batch (or no keys) stays with SDPA, whatever it returns there,
    where flashtune's attention refuses empty inputs with a ValueError."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 16, 64, device="cuda", dtype=torch.bfloat16)
        assert op._served(q, q, q) is None
        empty = torch.empty(0, 8, 16, 64, device="cuda", dtype=torch.bfloat16)
        assert op._served(empty, empty, empty) == "empty inputs"
        no_keys = torch.empty(2, 8, 0, 64, device="cuda", dtype=torch.bfloat16)
        assert op._served(q, no_keys, no_keys) == "empty inputs"


def test_kernel_scale_flips_q_for_a_negative_scale():
    """tuner.launch.kernel_scale: a negative scale reaches the kernels as |scale| with q negated (the
    same scores, so the same O and LSE), e4m3 by its sign bit; 0 as a scale that keeps a masked
    key's -inf; None and a positive scale pass untouched; a scale that is not a finite number is
    refused in one line."""
    from tuner.launch import LOG2E, kernel_scale

    q = torch.randn(2, 5, 3, 16).transpose(1, 2)   # a (B, N, H, D) view: strides must survive
    k, v = torch.randn(2, 3, 7, 16), torch.randn(2, 3, 7, 16)
    for scale in (None, 0.125):
        q2, s2 = kernel_scale(q, scale)
        assert q2 is q and s2 == scale
    q2, s2 = kernel_scale(q, 0.0)   # masked keys' -inf times it must stay -inf, and no exponential move
    assert q2 is q and s2 > 0 and torch.isneginf(torch.tensor(float("-inf")) * s2 * LOG2E)
    c = torch.tensor(s2 * LOG2E, dtype=torch.float32)
    assert c > 0 and torch.equal(torch.exp2(torch.tensor([1e20, -1e20, 0.5]) * c), torch.ones(3))
    q2, s2 = kernel_scale(q, -0.3)
    assert s2 == 0.3 and torch.equal(q2, -q) and q2.stride() == q.stride()
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=-0.3)
    got = F.scaled_dot_product_attention(q2.double(), k.double(), v.double(), scale=s2)
    torch.testing.assert_close(got, want)
    q8 = (4 * torch.randn(2, 3, 5, 16)).to(torch.float8_e4m3fn).transpose(1, 2)
    f8, s8 = kernel_scale(q8, -2.0)
    assert s8 == 2.0 and f8.dtype == q8.dtype and f8.stride() == q8.stride()
    assert torch.equal(f8.float(), -q8.float())
    for bad in (float("nan"), float("-inf"), float("inf")):
        with pytest.raises(ValueError, match="finite"):
            kernel_scale(q, bad)
