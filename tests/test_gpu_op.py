"""On the GPU: `attention` as an operator. Gradients against float64 autograd on random shapes,
every backward backend, a training run beside SDPA's, torch.compile(fullgraph=True), CUDA-graph
capture of a whole training step, and a transformers model under the SDPA switch."""

from __future__ import annotations

import itertools
import random
import warnings

import pytest

from tuner.problem import Problem

pytestmark = pytest.mark.gpu

# Relative Frobenius error of O and of each gradient against float64 allowed at the least: ours
# may be up to twice SDPA's own error on the same inputs, or this, whichever is larger.
FLOOR = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.5e-2}
TORCH = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@pytest.fixture
def dispatcher(tmp_path):
    """The process's dispatcher pointed at a lookup of this test (`serve(problems)` fills it)."""
    from models import lookup_with_defaults
    from tuner import dispatch
    from tuner.gpu import detect

    path = tmp_path / "best.json"

    def serve(problems):
        lookup_with_defaults(path, problems, detect())
        return dispatch.reset(path)

    dispatch.reset(tmp_path / "none.json")
    yield serve
    dispatch.reset()


def _random_problem(rng: random.Random, dtype: str, causal: bool) -> Problem:
    lengths = [1, 17, 63, 129, 200, 333, 1000]
    nq = rng.choice(lengths)
    nk = nq if rng.random() < 0.5 else rng.choice(lengths)
    kvh = rng.choice([1, 2, 4])
    d = rng.choice([64, 128] if dtype == "fp32" else [64, 128, 256])
    return Problem(rng.randint(1, 3), kvh * rng.choice([1, 2]), nq, nk, d, dtype, causal, kvh)


def _inputs(p: Problem, layout: str, seed: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, TORCH[p.dtype])

    def make(heads, n):
        shape = (p.batch, n, heads, p.head_dim) if layout == "bnhd" else (p.batch, heads, n, p.head_dim)
        t = torch.randn(shape, generator=g, device="cuda", dtype=dt)
        return (t.transpose(1, 2) if layout == "bnhd" else t).requires_grad_()

    return make(p.heads, p.seqlen_q), make(p.kv_heads, p.seqlen_k), make(p.kv_heads, p.seqlen_k)


def _errors(fn, q, k, v, causal: bool, scale, reference=None):
    """Errors of fn's O and of its q, k, v gradients (for a random upstream gradient) against
    float64 autograd of SDPA's math on the same values (or of `reference` on their float64
    copies): relative to the reference's norm, or to a tenth of the upstream gradient's where the
    reference is smaller (a row that sees one key has dq = 0 exactly: what is computed there is
    P = exp(s - LSE) rounded around 1 times the upstream gradient, an infinite relative error; at
    Nq = 1 that is all of dq)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    o = fn(q, k, v, causal, scale)
    grad = torch.randn_like(o)
    got = (o.detach(), *torch.autograd.grad(o, (q, k, v), grad))
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if reference is not None:
        ref = reference(*x64)
    else:
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(*x64, is_causal=causal, scale=scale, enable_gqa=True)
    want = (ref.detach(), *torch.autograd.grad(ref, x64, grad.double()))
    out = []
    floor = 0.1 * float(grad.double().norm())
    for name, a, b in zip(("O", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), f"NaN/Inf in {name}"
        out.append(float((a.double() - b).norm()) / max(float(b.norm()), floor))
    return out


def _ours(q, k, v, causal, scale):
    import tuner

    return tuner.attention(q, k, v, is_causal=causal, scale=scale)


def compiled_as_close_as_sdpa(problem: Problem, dispatcher, family: str):
    """torch.compile(fullgraph=True) of `attention` on fresh (B, N, H, D) inputs of `problem`, which
    `dispatcher` must plan on `family`; O and dq, dk, dv (the backward from the kernel's LSE) against
    float64 autograd, each within twice SDPA's error on the same values or bf16's floor. Returns the
    inputs, for the caller's own checks of how the call ran."""
    import torch

    import tuner

    compiled = torch.compile(lambda q, k, v, causal, scale: tuner.attention(q, k, v, is_causal=causal, scale=scale),
                             fullgraph=True)
    seed = random.randrange(2**31)
    q, k, v = _inputs(problem, "bnhd", seed)
    ours = _errors(compiled, q, k, v, False, None)
    assert dispatcher.plan(q, k, v, False).family == family
    theirs = _errors(_sdpa, *_inputs(problem, "bnhd", seed), False, None)
    for name, a, b in zip(("O", "dq", "dk", "dv"), ours, theirs):
        assert a <= max(FLOOR[problem.dtype], 2 * b), f"{name} error {a:.3g} (SDPA's {b:.3g})"
    return q, k, v


def _sdpa(q, k, v, causal, scale):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def _check_against_sdpa(p: Problem, rng: random.Random, served: bool) -> None:
    layout = rng.choice(["bhnd", "bnhd"])
    scale = rng.choice([None, 0.05])
    seed = rng.randrange(2**31)
    what = f"{p.key} {layout} scale={scale} {'tuned' if served else 'fallback'}"
    try:
        ours = _errors(_ours, *_inputs(p, layout, seed), p.causal, scale)
    except AssertionError as exc:
        raise AssertionError(f"{what}: {str(exc).splitlines()[0]}") from None
    theirs = _errors(_sdpa, *_inputs(p, layout, seed), p.causal, scale)
    for name, a, b in zip(("O", "dq", "dk", "dv"), ours, theirs):
        assert a <= max(FLOOR[p.dtype], 2 * b), f"{what}: {name} error {a:.3g} (SDPA's {b:.3g})"


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_through_tuned_kernels(dispatcher, dtype, causal):
    """Our forward (the family default for each exact shape) and the backward seam: O, dq, dk, dv
    against float64 on fresh random shapes: GQA, ragged lengths, Nq != Nk, both layouts, a custom scale."""
    rng = random.Random()
    for _ in range(3):
        p = _random_problem(rng, dtype, causal)
        dispatcher([p])
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="flashtune")   # a fallback would mean our kernel did not run
            _check_against_sdpa(p, rng, served=True)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gradients_through_the_fallback(dispatcher, dtype):
    """No kernel of ours serves it: torch's forward with an LSE, then the same backward seam. An
    untuned 16-bit call runs a default of ours on Hopper (flash_decode's for up to DECODE_QUERIES
    queries, flash_fwd_sm90's or its split's past that), so the 16-bit calls here take a head dim no
    kernel takes (84 and 100: not multiples of 8; each warns once, hence two); fp32 prefill has no
    default kernel."""
    from dataclasses import replace

    from tuner.problem import DECODE_QUERIES

    rng = random.Random()
    for causal in (False, True):
        p = _random_problem(rng, dtype, causal)
        while p.seqlen_q <= DECODE_QUERIES:
            p = _random_problem(rng, dtype, causal)
        why = "no tuned config"
        if dtype != "fp32":
            p = replace(p, head_dim=100 if causal else 84)
            why = f"no flashtune kernel takes head dim {p.head_dim}"
        with pytest.warns(UserWarning, match=why):
            _check_against_sdpa(p, rng, served=False)


@pytest.mark.parametrize("name", ["cudnn", "flash", "efficient", "math"])
def test_every_backward_backend_on_our_lse(dispatcher, name, monkeypatch):
    """Each of torch's backward kernels, forced, from our kernel's O and LSE, on cases it claims."""
    from tuner.torch_attention import BACKENDS, Case

    monkeypatch.setenv("TUNER_BACKWARD", name)
    rng = random.Random()
    done = 0
    for _ in range(40):
        if done == 3:
            break
        p = _random_problem(rng, rng.choice(["bf16", "fp16", "fp32"]), rng.random() < 0.5)
        if name == "math" and p.seqlen_q * p.seqlen_k > 200_000:
            continue
        q, _, _ = _inputs(p, "bhnd", 0)
        import torch

        k = torch.empty(p.batch, p.kv_heads, p.seqlen_k, p.head_dim, device="cuda", dtype=q.dtype)
        if BACKENDS[name].why_not_backward(Case.of(q, k, p.mask)):
            continue
        dispatcher([p])
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="flashtune")
            _check_against_sdpa(p, rng, served=True)
        done += 1
    assert done, f"no random case that {name} takes"


def test_gradients_of_a_decode_step(dispatcher):
    """One query row against 7 keys and against hundreds, GQA (a decode step trained through; the
    fuzz test drew B4-H32/kv8 x 1 x 7): flash_decode's forward and the backward seam within twice
    SDPA's error. cuDNN runs such a forward but not its backward, whose gradients read 0.92-0.94
    off on the H100 (benchmarks/PERF_NOTES.md, "w5")."""
    from tuner.backward import choose
    from tuner.torch_attention import Case

    rng = random.Random()
    for nk, dtype in ((7, "fp16"), (rng.randint(200, 3000), "bf16")):
        p = Problem(4, 32, 1, nk, 64, dtype, False, 8)
        q, k, _ = _inputs(p, "bnhd", 0)
        assert choose(Case.of(q, k, p.mask)).name != "cudnn"
        _check_against_sdpa(p, rng, served=True)   # no lookup: flash_decode's default serves a decode call


def _batches(steps: int, b: int = 4, n: int = 201, vocab: int = 256, seed: int = 0):
    """Token sequences with structure to learn: mostly t -> 7t + 3 mod vocab, some noise."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(steps):
        t = torch.empty(b, n, dtype=torch.long, device="cuda")
        t[:, 0] = torch.randint(0, vocab, (b,), generator=g, device="cuda")
        noise = torch.rand(b, n, generator=g, device="cuda") < 0.1
        rand = torch.randint(0, vocab, (b, n), generator=g, device="cuda")
        for i in range(1, n):
            t[:, i] = torch.where(noise[:, i], rand[:, i], (7 * t[:, i - 1] + 3) % vocab)
        out.append(t)
    return out


def _train(impl: str, batches, compile_: bool = False) -> list[float]:
    import torch

    from models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(impl=impl).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = torch.compile(model.loss, fullgraph=True) if compile_ else model.loss
    losses = []
    for tokens in batches:
        loss = step(tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _model_problems():
    # TinyGPT: dim 256, 2 heads of 128 sharing one K/V head, 200 tokens, causal, under bf16 autocast
    return [Problem(4, 2, 200, 200, 128, "bf16", True, 1)]


def test_training_follows_sdpa(dispatcher):
    """50 steps from the same seed with flashtune's attention and with SDPA's: the loss curves agree
    within bf16 noise, and both learn."""
    dispatcher(_model_problems())
    batches = _batches(50)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flashtune")
        ours = _train("flashtune", batches)
    theirs = _train("sdpa", batches)
    assert ours[-1] < 0.5 * ours[0] and theirs[-1] < 0.5 * theirs[0], (ours, theirs)
    worst = max(abs(a - b) / b for a, b in zip(ours, theirs))
    assert worst < 0.03, f"loss curves part by {worst:.2%}: {ours} vs {theirs}"


def test_compiled_training_fullgraph(dispatcher):
    """The same training under torch.compile(fullgraph=True): no graph break (fullgraph raises on
    one), and the losses follow eager flashtune's."""
    dispatcher(_model_problems())
    batches = _batches(8, seed=1)
    eager = _train("flashtune", batches)
    compiled = _train("flashtune", batches, compile_=True)
    worst = max(abs(a - b) / b for a, b in zip(compiled, eager))
    assert worst < 0.03, f"compiled losses part from eager by {worst:.2%}: {compiled} vs {eager}"


def test_cuda_graph_of_a_training_step(dispatcher):
    """Forward, backward and optimizer step captured in one CUDA graph and replayed: the losses and
    weights follow the same steps run eagerly from the same start."""
    import torch

    from models import TinyGPT

    dispatcher(_model_problems())
    warm, batches = _batches(3, seed=2), _batches(6, seed=3)

    def make():
        torch.manual_seed(0)
        model = TinyGPT().cuda()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)

    def step(model, opt, tokens):
        opt.zero_grad(set_to_none=True)
        loss = model.loss(tokens)
        loss.backward()
        opt.step()
        return loss

    model, opt = make()
    ref, ref_opt = make()
    static = warm[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up, as capture needs: plans, cuDNN's graphs, the optimizer's state
        for tokens in warm:
            static.copy_(tokens)
            step(model, opt, static)
    torch.cuda.current_stream().wait_stream(side)
    for tokens in warm:   # the same steps for the eager twin
        step(ref, ref_opt, tokens)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = model.loss(static)
        static_loss.backward()
        opt.step()
    for tokens in batches:
        static.copy_(tokens)
        graph.replay()
        loss = step(ref, ref_opt, tokens).item()
        assert abs(static_loss.item() - loss) <= 0.02 * loss, (static_loss.item(), loss)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0.05, atol=2e-3)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_the_cpp_call_path_runs_what_the_python_path_runs(dispatcher, dtype):
    """With the extension built, tuned calls go through it (its plans count their launches) and
    give the Python path's O and LSE bit for bit: new tensors every call (on Hopper, tensor maps
    patched in C++), both layouts, GQA with Nq != Nk, the LSE asked for or not, a custom scale; and
    inside a captured CUDA graph, replayed on new values. O is checked against float64 too."""
    import torch
    import torch.nn.functional as F

    from tuner import native
    from tuner.dispatch import Dispatcher

    assert native.module(wait=True) is not None, f"the C++ call path did not build: {native.failure()}"
    problems = [Problem(2, 8, 300, 200, 128, dtype, "causal_br", 2), Problem(1, 4, 129, 129, 64, dtype, False)]
    fast = dispatcher(problems)
    slow = Dispatcher(fast._path, native=False)
    for p in problems:
        for layout in ("bhnd", "bnhd", "bhnd"):
            q, k, v = (t.detach() for t in _inputs(p, layout, seed=len(layout) + p.head_dim))
            for scale in (None, 0.07):
                for _ in range(2):   # the first call of a shape plans (Python path), the next go native
                    o = fast.output(q, k, v, p.mask, scale)
                    o2, lse = fast.forward(q, k, v, p.mask, scale)
                want, want_lse = slow.forward(q, k, v, p.mask, scale)
                assert fast.plan(q, k, v, p.mask).launcher is not None, "no tuned kernel: nothing to compare"
                assert torch.equal(o, want) and torch.equal(o2, want) and torch.equal(lse, want_lse), (p.key, layout)
                assert o.stride() == want.stride() and o.dtype == want.dtype
                x64 = [t.double() for t in (q, k, v)]
                ref = F.scaled_dot_product_attention(*x64, scale=scale, enable_gqa=True, **({
                    "attn_mask": torch.ones(p.seqlen_q, p.seqlen_k, dtype=torch.bool, device="cuda").tril(
                        p.seqlen_k - p.seqlen_q)} if p.mask == "causal_br" else {}))
                err = float((o.double() - ref).norm() / ref.norm())
                assert err < FLOOR[dtype] * 2, (p.key, layout, err)
    assert fast._fast is not None and fast._fast.launches >= 2 * 3 * 2 * 3, "the C++ path did not launch"
    # captured: the graph holds the launch the C++ path made; replays read new values at the same addresses
    p = problems[0]
    q, k, v = (t.detach() for t in _inputs(p, "bnhd", seed=5))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fast.output(q, k, v, p.mask)   # this stream's binding, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    before = fast._fast.launches
    with torch.cuda.graph(graph):
        static_o = fast.output(q, k, v, p.mask)
    assert fast._fast.launches == before + 1
    for seed in (6, 7):
        for t, new in zip((q, k, v), _inputs(p, "bnhd", seed=seed)):
            t.copy_(new.detach())
        static_o.fill_(float("nan"))
        graph.replay()
        assert torch.equal(static_o, slow.output(q, k, v, p.mask))


def test_transformers_model_under_the_sdpa_switch(dispatcher):
    """A transformers Llama (random weights, its own `sdpa` attention) runs our kernels unchanged
    inside tuner.sdpa_override(), with the logits and gradients of its own SDPA."""
    transformers = pytest.importorskip("transformers")
    import torch

    import tuner
    import tuner.op

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda().to(torch.bfloat16)
    tokens = torch.randint(0, 512, (2, 300), device="cuda")
    dispatcher([Problem(2, 4, 300, 300, 128, "bf16", True, 2)])

    def run():
        model.zero_grad(set_to_none=True)
        out = model(tokens, labels=tokens)
        out.loss.backward()
        return out.logits.detach().float(), model.model.layers[0].self_attn.q_proj.weight.grad.float()

    theirs = run()
    calls = []
    real = tuner.op._forward
    with tuner.sdpa_override(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="flashtune")   # neither a fallback nor a call left with SDPA
        tuner.op._forward = lambda *a: calls.append(a[0].shape) or real(*a)
        try:
            ours = run()
        finally:
            tuner.op._forward = real
    assert len(calls) == 2, calls   # each layer's attention went through flashtune
    for a, b in zip(ours, theirs):
        assert float((a - b).norm() / b.norm()) < 2e-2


@pytest.mark.parametrize("shape", ["prefill", "decode"])
@pytest.mark.parametrize("peer", ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient"])
def test_a_measured_peer_serves_without_a_warning(tmp_path, peer, shape):
    """A bucket whose lookup says an SDPA backend measured fastest runs that backend (no fallback
    warning), with O and gradients as SDPA's, GQA and a ragged length included; a decode step too
    (one query against a ragged cache, 4 query heads a K/V head, either layout), where cuDNN leads
    the H200's large batches."""
    from tuner import dispatch
    from tuner.export import lookup_of, write_lookup
    from tuner.gpu import detect

    rng = random.Random()
    p = (Problem(2, 8, 333, 333, 128, "bf16", "causal", kv_heads=2) if shape == "prefill"
         else Problem(3, 16, 1, rng.randint(100, 3000), rng.choice([64, 128]), "bf16", "none", kv_heads=4))
    path = tmp_path / "best.json"
    write_lookup(lookup_of(detect().key, [(p, peer, {}, 1.0)]), path)
    d = dispatch.reset(path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="flashtune")
            _check_against_sdpa(p, rng, served=True)
            q, k, v = (t.detach() for t in _inputs(p, "bhnd", 1))
            assert d.plan(q, k, v, p.causal).peer == peer
    finally:
        dispatch.reset()


def test_a_decode_step_served_by_cudnn_replays_in_a_cuda_graph(tmp_path):
    """A model's decode loop under CUDA graphs, where the step's bucket serves SDPA cuDNN (the H200's
    large batches): one eager call, then captured on token-major K/V views and replayed on new
    values written in place, O against float64 each time, and the plan a cuDNN one."""
    import torch

    import tuner
    from cuda_graphs import capture
    from tuner import dispatch
    from tuner.export import lookup_of, write_lookup
    from tuner.gpu import detect
    from tuner.reference import attention_fp64, compare

    rng = random.Random()
    p = Problem(rng.randint(8, 16), 32, 1, rng.randint(1500, 4000), 128, "bf16", "none", kv_heads=8)
    path = tmp_path / "best.json"
    write_lookup(lookup_of(detect().key, [(p, "sdpa_cudnn", {}, 1.0)]), path)   # measured long: no short peer
    d = dispatch.reset(path)
    try:
        q = torch.randn(p.batch, p.heads, 1, p.head_dim, device="cuda", dtype=torch.bfloat16)
        cache = [torch.randn(p.batch, p.seqlen_k, p.kv_heads, p.head_dim, device="cuda", dtype=torch.bfloat16)
                 for _ in range(2)]
        k, v = (t.transpose(1, 2) for t in cache)

        def check(o):
            ref, _ = attention_fp64(q, k, v, "none", p.head_dim ** -0.5)
            assert compare(o, None, ref, None).rel < FLOOR["bf16"]

        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="flashtune")
            check(tuner.attention(q, k, v))
            assert d.plan(q, k, v, False).peer == "sdpa_cudnn"
            graph, captured = capture(lambda: tuner.attention(q, k, v), warmup=False)
            for _ in range(2):
                q.copy_(torch.randn_like(q))
                for t in cache:
                    t.copy_(torch.randn_like(t))
                graph.replay()
                torch.cuda.synchronize()
                check(captured)
    finally:
        dispatch.reset()


def _assert_packed_causal_matches(o, packed, cu) -> None:
    """Each non-empty sequence of a packed causal bf16 call's O (`packed`: q, k, v) against float64
    SDPA on its own rows (a NaN fails the comparison too)."""
    import torch

    for a, b in itertools.pairwise(cu.tolist()):
        if a == b:
            continue
        q1, k1, v1 = (t[a:b].transpose(0, 1)[None].double() for t in packed)
        ref = torch.nn.functional.scaled_dot_product_attention(q1, k1, v1, is_causal=True, enable_gqa=True)
        got = o[a:b].transpose(0, 1)[None].double()
        assert float((got - ref).norm() / ref.norm()) < FLOOR["bf16"], (tuple(packed[0].shape), a, b)


@pytest.mark.parametrize("d", [36, 264])
def test_a_head_dim_no_kernel_takes_runs_sdpa_with_one_warning(dispatcher, d):
    """SDPA takes any head dim; where none of flashtune's kernels does (not a multiple of 8, or past
    256), `attention` runs torch's, forward and backward as close to float64 as SDPA's, and says so
    once, naming the head dim; packed sequences of it run torch's attention per sequence."""
    import torch

    import tuner

    dispatcher([])
    rng = random.Random()
    p = Problem(2, 8, 333, 400, d, "bf16", "causal", kv_heads=2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _check_against_sdpa(p, rng, served=False)
        q, k, v = (t.detach() for t in _inputs(p, "bhnd", 2))
        tuner.attention(q, k, v, is_causal=True)
    said = [str(w.message) for w in seen if f"head dim {d}" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in seen]
    cu = torch.tensor([0, 100, 333], dtype=torch.int32, device="cuda")
    packed = [torch.randn(333, h, d, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = tuner.attention(*packed, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=233, max_seqlen_k=233)
    _assert_packed_causal_matches(o, packed, cu)


def _hopper():
    """This GPU, where flash_fwd_sm90 runs (sm_90); elsewhere the test skips."""
    from tuner.gpu import detect

    gpu = detect()
    if (gpu.major, gpu.minor) != (9, 0):
        pytest.skip(f"flash_fwd_sm90 is Hopper's; {gpu.name} is {gpu.cc}")
    return gpu


@pytest.mark.parametrize("d", [80, 96, 192])
def test_a_head_dim_no_lookup_tunes_runs_the_hopper_default(dispatcher, d):
    """Phi-3's 96, Stable Diffusion's 80, 192: lookups borrow only within a head dim and tune none of
    these, so on Hopper a prefill that fills the GPU runs flash_fwd_sm90's default, its tile padded
    to the head dim: O and the gradients as close to float64 as SDPA's, with no warning; packed
    sequences of it run flash_fwd_sm90_varlen, against float64."""
    import torch

    import tuner
    from tuner import borrowing, dispatch, varlen

    gpu = _hopper()
    dispatcher([])
    rng = random.Random()
    p = Problem(2, 8, rng.choice([1500, 2047]), rng.choice([1500, 2100]), d, rng.choice(["bf16", "fp16"]),
                rng.choice([False, True]), kv_heads=2)
    assert borrowing.fills_gpu(p, gpu)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flashtune")   # a fallback says so: it must not happen
        _check_against_sdpa(p, rng, served=True)
        q, k, v = (t.detach() for t in _inputs(p, "bhnd", 2))
        # the default, or where it is persistent and an unmasked call's tail is cut, its cut form
        assert dispatch.default().plan(q, k, v, p.causal).family in ("flash_fwd_sm90", "flash_fwd_sm90_tail")
    lens = [0, 1, 700, 64, 129, 2000, 333]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    packed = [torch.randn(cu[-1].item(), h, d, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2)]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flashtune")
        o = tuner.attention(*packed, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                            max_seqlen_k=max(lens))
    assert [pl.family.name for pl in varlen._plans.values()] == ["flash_fwd_sm90_varlen"]   # this dispatcher's one plan
    _assert_packed_causal_matches(o, packed, cu)


@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_a_call_of_few_blocks_runs_one_consumer(dispatcher, d):
    """A prefill whose 64-row blocks make under a wave of CTAs (a few heads of a short prompt) runs
    flash_fwd_sm90's default at one consumer (dispatch._one_consumer_where_idle): a random such
    shape, rows and keys off the tiles, GQA or not, causal or not, matches float64 as SDPA does,
    gradients too, with no fallback."""
    from tuner import dispatch
    from tuner.kernel_templates.flash_fwd_sm90 import one_consumer_pays

    gpu = _hopper()
    dispatcher([])
    rng = random.Random()
    kvh = rng.choice([1, 2, 4])
    p = Problem(1, kvh * rng.choice([1, 2]), rng.randrange(65, 400), rng.randrange(100, 1900), d,
                rng.choice(["bf16", "fp16"]), rng.choice([False, True]), kvh)
    assert one_consumer_pays(gpu, p)
    entry = dispatch.default().serving_entry(p, gpu)
    assert (entry["family"], entry["params"]["cwg"]) == ("flash_fwd_sm90", 1), (p.key, entry)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flashtune")
        _check_against_sdpa(p, rng, served=True)


@pytest.fixture
def autotuning(tmp_path, monkeypatch):
    """First-call autotuning on, its measurements in a fresh database: (the lookup path to serve from,
    the measured rows of a problem). Off again, and the dispatcher reset, after the test."""
    from tuner import autotune, dispatch
    from tuner.db.engine import make_engine, session_factory
    from tuner.db.queries import measurements

    url = f"sqlite:///{tmp_path / 'results.db'}"
    monkeypatch.setenv("TUNER_DB", url)

    def rows(p: Problem) -> list[dict]:
        with session_factory(make_engine(url))() as s:
            return [r for r in measurements(s) if r["problem_key"] == p.key]

    autotune.set_autotune(True)
    try:
        yield tmp_path / "best.json", rows
    finally:
        autotune.set_autotune(None)
        dispatch.reset()


def _first_call(q, k, v, **how):
    """tuner.attention's first call of a shape, any flashtune warning (a fallback) an error."""
    import tuner

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flashtune")
        return tuner.attention(q, k, v, **how)


def test_first_call_autotune_times_measures_and_stores(autotuning, monkeypatch):
    """With autotuning on, a shape of an untuned bucket has the nearest tuned configs and the SDPA
    backends timed on it once: the output is right, the database holds the measurements, the
    lookup the bucket's winners, and a second dispatcher serves the bucket without tuning again."""
    import torch
    import torch.nn.functional as F

    from models import lookup_with_defaults
    from tuner import autotune, dispatch
    from tuner.export import read_lookup
    from tuner.gpu import detect

    gpu = detect()
    path, measured = autotuning
    near = Problem(1, 16, 2048, 2048, 128, "bf16", "causal")
    lookup_with_defaults(path, [near], gpu)
    p = Problem(2, 16, 3000, 3000, 128, "bf16", "causal", kv_heads=4)
    assert p.bucket() != near.bucket()
    dispatch.reset(path)
    q, k, v = (t.detach() for t in _inputs(p, "bnhd", 7))
    o = _first_call(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    assert float((o.double() - ref).norm() / ref.norm()) < FLOOR["bf16"]
    rows = measured(p)
    assert {r["family"] for r in rows} >= {"flash_fwd_sm90" if gpu.major == 9 else "flash_fwd_mma", "sdpa_flash"}
    assert all(r["run_id"].startswith("autotune-") for r in rows) and any(r["status"] == "ok" for r in rows)
    assert p.bucket().key in {e["bucket"] for e in read_lookup(path)["entries"]}
    calls = []
    monkeypatch.setattr(autotune, "tune", lambda *a, **kw: calls.append(a) or [])
    d = dispatch.reset(path)
    d.plan(q, k, v, True)
    assert calls == []
    torch.cuda.synchronize()


def test_first_call_autotune_of_a_gqa_prefill_that_packs_times_the_packed_kernel(autotuning):
    """A GQA prefill of short rows that packs (gqa_packing.packs_prefill) has flash_fwd_sm90_gqa's default
    timed beside the nearest tuned configs on its first call: the database holds its measurement, the
    lookup a packed entry for the bucket, and the output is right whichever won."""
    import torch
    import torch.nn.functional as F

    from models import lookup_with_defaults
    from tuner import dispatch
    from tuner.export import read_lookup
    from tuner.gpu import detect
    from tuner.gqa_packing import packs_prefill

    gpu = detect()
    if gpu.major != 9:
        pytest.skip(f"flash_fwd_sm90_gqa runs on Hopper; this GPU is sm_{gpu.major}{gpu.minor}")
    path, measured = autotuning
    p = Problem(4, 16, 517, 8162, 128, "bf16", "causal_br", kv_heads=2)
    assert packs_prefill(p, gpu)
    lookup_with_defaults(path, [Problem(4, 16, 2048, 8192, 128, "bf16", "causal_br", kv_heads=2)], gpu)
    dispatch.reset(path)
    q, k, v = (t.detach() for t in _inputs(p, "bnhd", 11))
    o = _first_call(q, k, v, mask="causal_br")
    visible = torch.ones(p.seqlen_q, p.seqlen_k, dtype=torch.bool, device="cuda").tril(p.seqlen_k - p.seqlen_q)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=visible, enable_gqa=True)
    assert float((o.double() - ref).norm() / ref.norm()) < FLOOR["bf16"]
    rows = measured(p)
    assert any(r["family"] == "flash_fwd_sm90_gqa" and r["status"] == "ok" for r in rows), rows
    assert any(e["family"] == "flash_fwd_sm90_gqa" and e["bucket"] == p.bucket().key
               for e in read_lookup(path)["entries"])
    torch.cuda.synchronize()


def test_the_sdpa_switch_runs_an_empty_batch_as_sdpa_does():
    """Under the switch, a model's SDPA call on an empty microbatch returns what SDPA returns (torch
    2.11's CUDA SDPA returns None there), not flashtune's refusal; outside it, flashtune's attention
    refuses in one line."""
    import torch
    import torch.nn.functional as F

    import tuner

    q = torch.randn(0, 8, 33, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    theirs = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with tuner.sdpa_override(), pytest.warns(UserWarning, match="empty inputs"):
        ours = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert (ours is None) == (theirs is None)
    if theirs is not None:
        assert ours.shape == theirs.shape == q.shape and ours.dtype == theirs.dtype
    with pytest.raises(ValueError, match="empty input"):
        tuner.attention(q, q, q, is_causal=True)


@pytest.mark.parametrize("scale", [-0.25, 0.0])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_negative_or_zero_scale(dispatcher, dtype, scale):
    """tuner.launch.kernel_scale. scale < 0: every kernel keeps each row's max of the raw scores,
    the smallest scaled one for a negative scale, so exp2((s - max) * scale) overflowed where a
    row's scores spread over more than 128 / |scale| / log2(e). scale = 0: a masked key's (or a
    ragged tile's missing key's) -inf * 0 was a NaN. Scores that wide, through each path that
    launches our kernels, against float64: a prefill served a tuned config (GQA, Nq != Nk, both
    masks), a decode step, a KV cache with ragged lengths, packed sequences."""
    import torch

    import tuner
    from tuner.kvcache import kvcache_attention
    from tuner.launch import LOG2E
    from tuner.reference import attention_fp64, compare

    dt = getattr(torch, TORCH[dtype])
    g = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))

    def rnd(*shape):
        return (3 * torch.randn(*shape, generator=g, device="cuda")).to(dt)

    def check(o, lse, q, k, v, mask, what):
        ref_o, ref_lse = attention_fp64(q, k, v, mask, scale)
        err = compare(o, lse, ref_o, ref_lse)
        p = Problem(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], dtype, mask, k.shape[1])
        assert err.finite and err.rel <= p.rel_budget and err.lse <= p.lse_budget, f"{what} {dtype}: {err}"

    prefill = [Problem(2, 8, 333, 1000, 128, dtype, mask, 2) for mask in ("none", "causal")]
    served = dispatcher(prefill)
    q, k, v = rnd(2, 8, 333, 128), rnd(2, 2, 1000, 128), rnd(2, 2, 1000, 128)
    s = torch.matmul(q.double(), k.double().repeat_interleave(4, dim=1).transpose(-1, -2))
    spread = (s.amax(-1) - s.amin(-1)) * abs(scale) * LOG2E
    if scale < 0:
        assert float(spread.max()) > 128, f"the inputs do not spread wide enough to test this: {float(spread.max()):.0f}"
    with torch.no_grad():
        for p in prefill:
            assert served.plan(q, k, v, p.mask, None).launcher is not None, f"{p.key}: not served by our kernels"
            o, lse = served.forward(q, k, v, p.mask, scale)
            check(o, lse, q, k, v, p.mask, f"prefill {p.key}")
            check(tuner.attention(q, k, v, is_causal=p.causal, scale=scale), lse, q, k, v, p.mask,
                  f"prefill {p.key} through tuner.attention")
        qd, kd, vd = rnd(4, 32, 1, 128), rnd(4, 8, 700, 128), rnd(4, 8, 700, 128)
        o, lse = served.forward(qd, kd, vd, "none", scale)
        check(o, lse, qd, kd, vd, "none", "decode step")
        lens = [900, 517]
        qc, kc, vc = rnd(2, 8, 3, 128), rnd(2, 2, 900, 128), rnd(2, 2, 900, 128)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        o, lse = kvcache_attention(qc, kc, vc, seqlens, scale=scale, return_lse=True)
        for i, n in enumerate(lens):
            check(o[i:i + 1], lse[i:i + 1], qc[i:i + 1], kc[i:i + 1, :, :n], vc[i:i + 1, :, :n], "causal_br",
                  f"KV cache sequence {i} ({n} keys)")
        lens_q, lens_k = [300, 1, 129], [300, 1, 700]
        cu = lambda ls: torch.tensor([0, *itertools.accumulate(ls)], dtype=torch.int32, device="cuda")
        qv, kv, vv = rnd(sum(lens_q), 8, 128), rnd(sum(lens_k), 2, 128), rnd(sum(lens_k), 2, 128)
        o, lse = tuner.varlen_attention(qv, kv, vv, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), mask="causal_br",
                                        scale=scale, return_lse=True)
        view = lambda t, r0, n: t[r0:r0 + n].transpose(0, 1)[None]   # one packed sequence as (1, H, N, D)
        a = c = 0
        for nq, nk in zip(lens_q, lens_k):
            check(view(o, a, nq), lse[:, a:a + nq][None], view(qv, a, nq), view(kv, c, nk), view(vv, c, nk),
                  "causal_br", f"packed sequence ({nq}, {nk})")
            a, c = a + nq, c + nk
