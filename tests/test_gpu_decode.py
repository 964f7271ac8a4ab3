"""On the GPU: the decode path (flash_decode, kvcache_attention) against float64, on fresh random
shapes: few queries (1, 2, 5, 16), ragged key counts up to 32k, GQA ratios 1 to 8, per-sequence
cache lengths (0 and 1 among them), dense and paged caches of several page sizes."""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import replace

import pytest

from cuda_graphs import capture
from tuner.kernel_templates import configs_family
from tuner.problem import Problem

pytestmark = pytest.mark.gpu


def _random_decode_problem(rng: random.Random, dtype: str, mask: str) -> Problem:
    kvh, group = rng.choice([1, 2]), rng.choice([1, 2, 4, 8])
    nk = rng.choice([1, 17, 1000, 4097, rng.randint(1, 32768)])
    return Problem(rng.randint(1, 3), kvh * group, rng.choice([1, 2, 5, 16]), nk, rng.choice([64, 128, 256]), dtype,
                   mask, kvh)


@pytest.mark.parametrize("mask", ["none", "causal_br", "causal"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_decode_family_matches_reference(dtype, mask):
    """The default config and random ones (explicit split counts among them), NaN-poisoned outputs,
    O and LSE within budget, through the search's own measuring path."""
    from tuner.compile import compile_kernel
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.measure import prepare_kernel

    fam, gpu, rng = get_family("flash_decode"), detect(), random.Random()
    for _ in range(3):
        problem = _random_decode_problem(rng, dtype, mask)
        valid = fam.valid_points(gpu, problem)
        for params in [fam.default(gpu, problem)] + rng.sample(valid, min(3, len(valid))):
            ck = compile_kernel(fam, params, problem, gpu.arch)
            run, m = prepare_kernel(fam, params, problem, ck, rng.randrange(2**31), gpu)
            splits = fam.launch(params, problem, gpu).grid[2]
            assert m.status == "ok" and run is not None, f"{problem.key} {params} ({splits} splits): {m.message}"


def _cache(rng: random.Random, torch, b: int, kvh: int, d: int, cap: int, page: int, dt):
    """K and V caches holding `cap` keys per sequence: dense (B, Hk, cap, D) views of (B, cap, Hk, D)
    storage, or pages (num_pages, Hk, page, D) of (num_pages, page, Hk, D) storage with a shuffled
    block table (and spare pages nobody owns)."""
    if not page:
        k, v = (torch.randn(b, cap, kvh, d, device="cuda", dtype=dt).transpose(1, 2) for _ in range(2))
        return k, v, None
    per = -(-cap // page)
    pool = b * per + 3
    k, v = (torch.randn(pool, page, kvh, d, device="cuda", dtype=dt).transpose(1, 2) for _ in range(2))
    table = torch.randperm(pool, device="cuda")[: b * per].view(b, per).to(torch.int32)
    return k, v, table


def _poison_past(torch, k, v, table, lens: list[int], page: int) -> int:
    """NaN in every cache row past each sequence's length, as a cache never written there may hold
    (torch.empty); the keys a sequence can hold (the pages' rows where paged)."""
    cap = table.shape[1] * page if page else k.shape[2]
    for i, n in enumerate(lens):
        for t in (k, v):
            if page:
                pos = torch.arange(n, cap, device="cuda")
                t[table[i, pos // page].long(), :, pos % page] = float("nan")
            else:
                t[i, :, n:] = float("nan")
    return cap


# pages of 16, 64 and 256 rows come as tensor-map boxes on sm_90 (a stage's rows divide them or
# they divide a stage's), 48 row by row
@pytest.mark.parametrize("page", [0, 16, 48, 64, 256], ids=["dense", "page16", "page48", "page64", "page256"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_kvcache_ragged_lengths_dense_and_paged(dtype, page):
    """Each sequence holds its own number of keys (0 and 1 among them); the queries are its last
    positions (bottom-right causal), or see all it holds; against float64 on the keys gathered.
    The cache's rows past each length hold NaN, as a cache never written there may (torch.empty):
    they must not reach O (P = 0 times NaN is NaN)."""
    rng = random.Random()
    for causal in (True, False):
        b, kvh, group, d = rng.randint(3, 6), rng.choice([1, 2, 8]), rng.choice([1, 4, 8]), rng.choice([64, 128])
        _check_ragged_cache(rng, dtype, page, causal, b, kvh, group, rng.choice([1, 2, 5, 16]), d,
                            rng.choice([1000, 5000, 32768]))


def _check_ragged_cache(rng: random.Random, dtype: str, page: int, causal: bool, b: int, kvh: int, group: int,
                        nq: int, d: int, cap: int) -> None:
    """kvcache_attention on a dense (page 0) or paged cache of `cap` keys a sequence holding ragged
    lengths (0 and 1 among them, NaN past each), against float64 sequence by sequence."""
    import torch

    from tuner import kvcache_attention

    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    lens = [0, 1] + [rng.randint(0, cap) for _ in range(b - 2)]
    rng.shuffle(lens)
    k, v, table = _cache(rng, torch, b, kvh, d, cap, page, dt)
    cap = _poison_past(torch, k, v, table, lens, page)
    q = torch.randn(b, nq, kvh * group, d, device="cuda", dtype=dt).transpose(1, 2)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    o, lse = kvcache_attention(q, k, v, seqlens, table, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    what = f"B{b} H{kvh * group}/kv{kvh} nq{nq} d{d} lens {lens} page {page} causal {causal}"
    check_cached_sequences(o, lse, q, k, v, seqlens, table, lens, cap, causal, dtype, what)


def check_cached_sequences(o, lse, q, k_cache, v_cache, seqlens, table, lens: list[int], cap: int, causal: bool,
                           dtype: str, what: str) -> None:
    """Each sequence of kvcache_attention's O and LSE against float64 on the keys it holds (gathered
    from the dense or paged cache): O = 0 and LSE = -inf where it holds none."""
    import torch

    from tuner.kvcache import gather_sequence
    from tuner.reference import attention_fp64, compare

    mask = "causal_br" if causal else "none"
    for i, n in enumerate(lens):
        if n == 0:   # nothing held: every row sees no key
            assert torch.equal(o[i], torch.zeros_like(o[i])) and bool(torch.isneginf(lse[i]).all()), what
            continue
        ks, vs = (gather_sequence(t, seqlens, table, i, cap)[None] for t in (k_cache, v_cache))
        ref_o, ref_lse = attention_fp64(q[i:i + 1], ks, vs, mask, 1.0 / math.sqrt(q.shape[3]))
        err = compare(o[i:i + 1], lse[i:i + 1], ref_o, ref_lse)
        p = Problem(1, q.shape[1], q.shape[2], n, q.shape[3], dtype, mask, k_cache.shape[1])
        assert err.finite, f"{what}: sequence {i} ({n} keys) not finite, or the LSE not -inf where no key is seen"
        assert err.rel <= p.rel_budget and err.lse <= p.lse_budget, f"{what}: sequence {i}: {err}"


@pytest.mark.parametrize("d", [8, 40, 72, 80, 112, 144, 160, 192, 248])
def test_decode_any_head_dim_matches_reference(d, tmp_path):
    """Head dims flash_decode pads its tile to (d rounded up to 32 columns): the default and random
    configs through the measuring path (random dtype, mask, GQA, ragged Nk, NaN-poisoned outputs),
    then kvcache_attention on a dense cache and on pages of 16, 48 and 64 rows (row by row, and boxes
    where the config's stage fits), ragged lengths with NaN past them, and a decode call through the
    dispatcher with nothing tuned, served by flash_decode's default without a warning, all against
    float64."""
    import warnings

    import torch

    from tuner import dispatch
    from tuner.compile import compile_kernel
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.measure import prepare_kernel
    from tuner.reference import attention_fp64, compare

    fam, gpu, rng = get_family("flash_decode"), detect(), random.Random()
    dtype = rng.choice(["fp16", "bf16"])
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    problem = replace(_random_decode_problem(rng, dtype, rng.choice(["none", "causal_br", "causal"])), head_dim=d)
    valid = fam.valid_points(gpu, problem)
    for params in [fam.default(gpu, problem)] + rng.sample(valid, min(3, len(valid))):
        ck = compile_kernel(fam, params, problem, gpu.arch)
        run, m = prepare_kernel(fam, params, problem, ck, rng.randrange(2**31), gpu)
        assert m.status == "ok" and run is not None, f"{problem.key} {params}: {m.message}"
    for page in (0, 16, 48, 64):   # dense and row by row; 16 and 64: the page boxes where the default's stage
        # fits (16: several boxes a stage, each with its tail box where there is one: d = 72-80, 136-144)
        _check_ragged_cache(rng, dtype, page, True, rng.randint(3, 5), rng.choice([1, 2]), rng.choice([1, 4, 8]),
                            rng.choice([1, 5, 16]), d, 5000)
    served = dispatch.reset(tmp_path / "none.json")   # nothing tuned: the default serves
    try:
        q = torch.randn(2, 8, 2, d, device="cuda", dtype=dt)
        k, v = (torch.randn(2, 2, 3001, d, device="cuda", dtype=dt) for _ in range(2))
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # no fallback to SDPA
            o, lse = served(q, k, v, "causal_br", return_lse=True)
        assert configs_family(served.plan(q, k, v, "causal_br").family) == "flash_decode"   # (splits in a cluster where 2-8)
        ref_o, ref_lse = attention_fp64(q, k, v, "causal_br", 1 / math.sqrt(d))
        p = Problem(2, 8, 2, 3001, d, dtype, "causal_br", 2)
        err = compare(o, lse, ref_o, ref_lse)
        assert err.within(p.rel_budget, p.lse_budget), err
    finally:
        dispatch.reset()


@pytest.mark.parametrize("page", [0, 64], ids=["dense", "page64"])
def test_kvcache_prefill_past_decode_queries_through_attention(page):
    """More new queries than flash_decode serves (a prompt's prefill into the cache): attention's
    kernels on each sequence's held keys (on Hopper in one launch, the held-keys variant, on the
    pages too; elsewhere a sequence at a time), lengths 0, 1, fewer than the queries, thousands, rows past
    them NaN, bottom-right causal or not; against float64. A dense cache with no lengths is one
    dispatcher call: none of kvcache's per-sequence warning, and a CUDA graph captures it."""
    import warnings

    import torch

    from tuner import kvcache_attention
    from tuner.kernel_templates.flash_decode import MAX_QUERIES
    from tuner.kvcache import gather_sequence
    from tuner.reference import attention_fp64, compare

    rng = random.Random()
    b, kvh, group, d, cap = 5, 2, 4, rng.choice([64, 128]), 3000
    nq = rng.randint(MAX_QUERIES + 1, 200)
    lens = [0, 1, nq // 2, nq + 7, cap]
    rng.shuffle(lens)
    k, v, table = _cache(rng, torch, b, kvh, d, cap, page, torch.bfloat16)
    cap = _poison_past(torch, k, v, table, lens, page)
    q = torch.randn(b, nq, kvh * group, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for causal in (True, False):
        mask = "causal_br" if causal else "none"
        o, lse = kvcache_attention(q, k, v, seqlens, table, causal=causal, return_lse=True)
        for i, n in enumerate(lens):
            if n == 0:
                assert torch.equal(o[i], torch.zeros_like(o[i])) and bool(torch.isneginf(lse[i]).all()), lens
                continue
            ks, vs = (gather_sequence(t, seqlens, table, i, cap)[None] for t in (k, v))
            ref_o, ref_lse = attention_fp64(q[i:i + 1], ks, vs, mask, 1.0 / math.sqrt(d))
            err = compare(o[i:i + 1], lse[i:i + 1], ref_o, ref_lse)
            p = Problem(1, kvh * group, nq, n, d, "bf16", mask, kvh)
            assert err.finite and err.within(p.rel_budget, p.lse_budget), f"nq {nq} lens {lens} causal {causal}: {i}: {err}"
    if page:
        return
    full = torch.randn(b, kvh, 700, d, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        o, lse = kvcache_attention(q, full, full, return_lse=True)
    assert not [w for w in seen if "one at a time" in str(w.message)], [str(w.message) for w in seen]
    ref_o, ref_lse = attention_fp64(q, full, full, "causal_br", 1.0 / math.sqrt(d))
    p = Problem(b, kvh * group, nq, 700, d, "bf16", "causal_br", kvh)
    assert compare(o, lse, ref_o, ref_lse).within(p.rel_budget, p.lse_budget)
    graph, captured = capture(lambda: kvcache_attention(q, full, full), warmup=False)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, kvcache_attention(q, full, full))


def test_split_workspace_is_reused_and_graph_capture_replays():
    """Several splits per sequence merge through the workspace's self-resetting counters: repeated
    launches give the same bits, and a captured CUDA graph replays on new inputs written in place."""
    import torch

    from tuner import kvcache_attention
    from tuner.kvcache import _plans

    torch.manual_seed(0)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 16384, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([12345], dtype=torch.int32, device="cuda")
    first = kvcache_attention(q, k, v, lens)
    plan = next(p for key, p in _plans.items() if key[0] == q.shape and key[1] == k.shape)
    assert plan.launch.grid[2] > 1, "a batch of one should be split across CTAs"
    for _ in range(3):
        assert torch.equal(kvcache_attention(q, k, v, lens), first)
    graph, captured = capture(lambda: kvcache_attention(q, k, v, lens), warmup=False)
    q.copy_(torch.randn_like(q))
    lens.fill_(777)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, kvcache_attention(q, k, v, lens))


def test_attention_serves_decode_from_a_tuned_flash_decode_entry(tmp_path):
    """`attention` with a handful of queries runs the flash_decode config the lookup holds for its
    bucket, and agrees with float64."""
    import torch

    from tuner import dispatch
    from tuner.export import lookup_of, write_lookup
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.reference import attention_fp64, compare

    gpu, fam = detect(), get_family("flash_decode")
    problem = Problem(4, 32, 1, 8000, 128, "bf16", "causal_br", 8)
    params = dict(fam.default(gpu, problem), splits=2)
    path = tmp_path / "lookup.json"
    write_lookup(lookup_of(gpu.key, [(problem, fam.name, params, 1.0)]), path)
    d = dispatch.reset(path)
    try:
        q = torch.randn(4, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(4, 8, 8000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        o, lse = d(q, k, v, "causal_br", return_lse=True)
        assert configs_family(d.plan(q, k, v, "causal_br").family) == "flash_decode"   # (splits in a cluster where 2-8)
        ref_o, ref_lse = attention_fp64(q, k, v, "causal_br", 1.0 / math.sqrt(128))
        err = compare(o, lse, ref_o, ref_lse)
        assert err.within(problem.rel_budget, problem.lse_budget), err
    finally:
        dispatch.reset()


def test_attention_runs_flash_decode_default_where_nothing_is_tuned(tmp_path):
    """No lookup at all: a decode call still runs our kernel (flash_decode's default), with no
    fallback warning, gradients aside; against float64."""
    import warnings

    import torch

    from tuner import dispatch
    from tuner.reference import attention_fp64, compare

    d = dispatch.reset(tmp_path / "none.json")
    try:
        q = torch.randn(3, 16, 2, 64, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(3, 4, 3001, 64, device="cuda", dtype=torch.float16) for _ in range(2))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            o, lse = d(q, k, v, "causal_br", return_lse=True)
        assert configs_family(d.plan(q, k, v, "causal_br").family) == "flash_decode"   # (splits in a cluster where 2-8)
        ref_o, ref_lse = attention_fp64(q, k, v, "causal_br", 1.0 / math.sqrt(64))
        p = Problem(3, 16, 2, 3001, 64, "fp16", "causal_br", 4)
        assert compare(o, lse, ref_o, ref_lse).within(p.rel_budget, p.lse_budget)
    finally:
        dispatch.reset()


def test_kvcache_attention_under_torch_compile():
    """torch.compile(fullgraph=True) of a decode step (paged cache with lengths) runs the operator:
    the same bits as the eager call."""
    import torch

    from tuner import kvcache_attention

    rng = random.Random()
    k, v, table = _cache(rng, torch, 3, 8, 128, 4096, 64, torch.bfloat16)
    q = torch.randn(3, 2, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    lens = torch.tensor([0, 1, 4000], dtype=torch.int32, device="cuda")

    def step(q, k, v, lens, table):
        o, lse = kvcache_attention(q, k, v, lens, table, return_lse=True)
        return o * 2, lse

    eager = step(q, k, v, lens, table)
    compiled = torch.compile(step, fullgraph=True)(q, k, v, lens, table)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


@pytest.mark.parametrize("mask", ["none", "causal_br", "causal"])
def test_decode_splits_merged_in_a_cluster_match_reference(mask):
    """flash_decode_cluster: 2, 4 and 8 splits of each sequence's keys as one cluster, merged in its
    shared memory, on random shapes (splits that see no key among them: short and causal rows), a
    random flash_decode config each, NaN-poisoned outputs, O and LSE against float64, through the
    search's measuring path."""
    from tuner.compile import compile_kernel
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.measure import prepare_kernel

    fam, plain, gpu, rng = get_family("flash_decode_cluster"), get_family("flash_decode"), detect(), random.Random()
    shapes = 0
    for _ in range(40):   # until three shapes took a cluster: short keys have fewer stages than splits
        problem = _random_decode_problem(rng, rng.choice(["fp16", "bf16"]), mask)
        base = rng.choice([plain.default(gpu, problem)] + plain.valid_points(gpu, problem))
        ran = 0
        for n in (2, 4, 8):
            params = dict(base, splits=n)
            if fam.check(params, gpu, problem) is not None:   # fewer stages than splits
                continue
            ck = compile_kernel(fam, params, problem, gpu.arch)
            run, m = prepare_kernel(fam, params, problem, ck, rng.randrange(2**31), gpu)
            assert m.status == "ok" and run is not None, f"{problem.key} {params}: {m.message}"
            ran += 1
        shapes += ran > 0
        if shapes == 3:
            break
    assert shapes == 3, f"only {shapes} of 40 random shapes took a cluster of splits"


_ARRIVE = r"""
extern "C" __global__ void arrive_and_wait(unsigned* count, unsigned total, long long spin, unsigned* late) {
    if (threadIdx.x == 0) {
        atomicAdd(count, 1u);
        long long start = clock64();
        while (atomicAdd(count, 0u) < total) {
            if (clock64() - start > spin) { atomicAdd(late, 1u); break; }
        }
    }
}
"""


@pytest.mark.parametrize("size", [2, 4, 8])
def test_the_drivers_count_of_one_sm_clusters_all_run_at_once(size):
    """clusters_at_once's count on this device (the driver's, one_sm_clusters) is what the cluster
    form's serving rule trusts: that many clusters of `size` CTAs that each fill an SM all run at
    once (each CTA arrives, then waits for every other), and one cluster more does not (some wait
    out their spin). And a decode call's splits run as one cluster only where its clusters fit."""
    import numpy as np
    import torch
    from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch

    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.kernel_templates.flash_decode import ctas_per_split
    from tuner.launch import _set_max_dynamic_smem, clusters_at_once, one_sm_clusters

    gpu = detect()
    if gpu.major < 9:
        pytest.skip(f"thread-block clusters need sm_90 or later, not {gpu.name} (sm_{gpu.major}{gpu.minor})")
    count = one_sm_clusters(gpu, size)
    assert count is not None and 0 < count <= gpu.sm_count // size and clusters_at_once(gpu, size) == count
    dev = Device(gpu.index)
    dev.set_current()
    kernel = Program(_ARRIVE, "c++", ProgramOptions(arch=gpu.arch)).compile("cubin").get_kernel("arrive_and_wait")
    _set_max_dynamic_smem(kernel, gpu.smem_per_block_optin, gpu.index)
    stream = dev.create_stream()
    late = {}
    for clusters in (count, count + 1):
        flags = torch.zeros(2, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        # with a cluster, cuda.core's grid counts clusters
        config = LaunchConfig(grid=clusters, cluster=size, block=32, shmem_size=gpu.smem_per_block_optin)
        launch(stream, config, kernel, np.uint64(flags.data_ptr()), np.uint32(clusters * size),
               np.int64(400_000_000), np.uint64(flags.data_ptr() + 4))
        stream.sync()
        late[clusters] = int(flags[1])
        assert int(flags[0]) == clusters * size
    assert late[count] == 0 and late[count + 1] > 0, (size, count, late)

    fam = get_family("flash_decode")
    for batch in (1, 2, 4, 8, 16):
        p = Problem(batch, 32, 1, 16384, 128, "bf16", "none", 8)
        params = dict(fam.default(gpu, p), splits=size)
        form = fam.served_form(params, gpu, p)[0]
        fits = ctas_per_split(params, p) <= count
        assert configs_family(form.name) == fam.name, form.name
        assert (form.name == "flash_decode_cluster") == fits, (batch, form.name)


def test_a_decode_step_served_with_its_splits_in_a_cluster():
    """What a model's decode loop runs on Hopper at B8 x 8k (GQA 4): flash_decode's two splits as a
    cluster (the plan says so), through kvcache_attention on a dense cache of ragged lengths (0 and 1
    among them, NaN past each) and through `attention`, against float64; then the cache call captured
    in a CUDA graph and replayed on new values and lengths."""
    import torch

    from tuner import dispatch, kvcache_attention
    from tuner.gpu import detect
    from tuner.kvcache import _plans
    from tuner.reference import attention_fp64, compare

    rng = random.Random()
    b, kvh, group, cap, d = 8, 8, 4, 8192, 128
    _check_ragged_cache(rng, "bf16", 0, True, b, kvh, group, 1, d, cap)
    plan = next(p for key, p in _plans.items() if key[0] == (b, kvh * group, 1, d) and key[1][2] == cap)
    assert plan.family.name == "flash_decode_cluster" and plan.launch.grid[2] == 2, (plan.family.name, plan.launch)

    served = dispatch.reset()
    try:
        q = torch.randn(b, 1, kvh * group, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(b, cap, kvh, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        # what `attention` serves: the cluster form, or an SDPA backend where this GPU's lookup
        # measured one faster for the bucket (the H200's cuDNN at 8k keys; kvcache_attention above
        # runs flash_decode all the same)
        p = Problem(b, kvh * group, 1, cap, d, "bf16", "none", kvh)
        entry = served.serving_entry(p, detect())
        got = served.plan(q, k, v, "none")
        if configs_family(entry["family"]) == "flash_decode":
            assert got.family == "flash_decode_cluster", (entry["family"], got.family, got.reason)
        else:
            assert got.peer == entry["family"], (entry["family"], got.peer, got.reason)
        o, lse = served(q, k, v, "none", return_lse=True)
        ref_o, ref_lse = attention_fp64(q, k, v, "none", 1 / math.sqrt(d))
        assert compare(o, lse, ref_o, ref_lse).within(p.rel_budget, p.lse_budget)

        lens = torch.tensor([rng.randint(1, cap) for _ in range(b)], dtype=torch.int32, device="cuda")
        graph, captured = capture(lambda: kvcache_attention(q, k, v, lens, causal=True, return_lse=True))
        for _ in range(3):
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            lens.copy_(torch.tensor([0, 1] + [rng.randint(0, cap) for _ in range(b - 2)], dtype=torch.int32))
            captured[0].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check_cached_sequences(captured[0], captured[1], q, k, v, lens, None, lens.tolist(), cap, True, "bf16",
                                   f"graph replay, lens {lens.tolist()}")
    finally:
        dispatch.reset()


def test_a_decode_step_in_a_cluster_is_deterministic_and_compiles():
    """The cluster form at B8 x 8k on a dense cache of ragged lengths: the same call twice gives
    the same bits (each split owns fixed stages and rank 0 merges them in a fixed order; PERF_NOTES
    q2 withdrew claimed stages for this), and torch.compile(fullgraph=True) of the step gives the
    eager call's bits."""
    import torch

    from tuner import kvcache_attention
    from tuner.kvcache import _plans

    rng = random.Random()
    b, kvh, group, cap, d = 8, 8, 4, 8192, 128
    q = torch.randn(b, 1, kvh * group, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(b, cap, kvh, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    lens = torch.tensor([cap, 1] + [rng.randint(cap // 2, cap) for _ in range(b - 2)], dtype=torch.int32, device="cuda")

    def step(q, k, v, lens):
        o, lse = kvcache_attention(q, k, v, lens, causal=True, return_lse=True)
        return o * 2, lse

    first = step(q, k, v, lens)
    plan = next(p for key, p in _plans.items() if key[0] == (b, kvh * group, 1, d) and key[1][2] == cap)
    assert plan.family.name == "flash_decode_cluster", plan.family.name
    for _ in range(3):
        again = step(q, k, v, lens)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    compiled = torch.compile(step, fullgraph=True)(q, k, v, lens)
    assert torch.equal(compiled[0], first[0]) and torch.equal(compiled[1], first[1])


@contextlib.contextmanager
def _untuned(tmp_path):
    """attention's dispatcher with nothing tuned (the defaults' rules) and kvcache's plans made
    afresh under it; the default dispatcher and fresh plans again after."""
    from tuner import dispatch
    from tuner.kvcache import _plans

    served = dispatch.reset(tmp_path / "none.json")
    _plans.clear()
    try:
        yield served
    finally:
        _plans.clear()
        dispatch.reset()


def _hopper():
    """This GPU's spec, or the test skipped where it is not Hopper (flash_fwd_sm90's variants)."""
    from tuner.gpu import detect

    gpu = detect()
    if (gpu.major, gpu.minor) != (9, 0):
        pytest.skip(f"flash_fwd_sm90's variants run on Hopper; this is {gpu.name}")
    return gpu


# (B, H, K/V heads, Nq, d, the cache's keys): steps of 48-112 packed GQA rows (flash_fwd_sm90_gqa's
# rule), one over keys split across CTAs, chunks of a prompt (GQA and not) past flash_decode's queries
HELD_KEYS_CASES = [(5, 32, 8, 16, 128, 5000), (4, 64, 8, 8, 64, 3000), (3, 28, 4, 16, 128, 20000),
                   (4, 16, 2, 150, 128, 3000), (2, 8, 8, 333, 64, 9000), (1, 8, 1, 16, 80, 7001)]


@pytest.mark.parametrize("case", HELD_KEYS_CASES, ids=lambda c: "B{}-H{}/kv{}-{}x{}-d{}".format(*c[:4], c[5], c[4]))
def test_kvcache_runs_attentions_hopper_kernel_on_the_held_keys(case, tmp_path):
    """A dense cache's call that attention serves with flash_fwd_sm90, its split or its packed-GQA
    form (nothing tuned: the defaults' rules) runs that config's variant reading each sequence's
    length (the plan names it): ragged lengths (0, 1, a tile's edge and either side of it, the
    capacity; NaN past each, which a tile loaded past the length would carry into O), bottom-right
    causal or not, fp16 and bf16, against float64, with no per-sequence warning; then captured in a
    CUDA graph and replayed on new values and lengths."""
    import warnings

    import torch

    from tuner import kvcache_attention
    from tuner.kernel_templates.flash_fwd_sm90_cache import CACHE_VARIANTS
    from tuner.kvcache import _plans

    gpu = _hopper()
    b, h, kvh, nq, d, cap = case
    rng = random.Random()
    with _untuned(tmp_path) as served:
        for dtype, causal in (("bf16", True), ("fp16", False)):
            entry = served.serving_entry(Problem(b, h, nq, cap, d, dtype, "causal_br" if causal else "none", kvh), gpu)
            variant = CACHE_VARIANTS.get(configs_family(entry["family"]))
            assert variant is not None, f"{case}: attention serves {entry['family']}, which no variant runs"
            dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
            edges = [1, 63, 64, 65, 177, nq - 1, nq + 1, rng.randint(2, cap - 1)]
            lens = [0, cap] + rng.sample([n for n in edges if 0 < n < cap], b - 2) if b > 2 else [cap, rng.randint(0, 63)][:b]
            rng.shuffle(lens)
            k, v, _ = _cache(rng, torch, b, kvh, d, cap, 0, dt)
            _poison_past(torch, k, v, None, lens, 0)
            q = torch.randn(b, nq, h, d, device="cuda", dtype=dt).transpose(1, 2)
            seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                o, lse = kvcache_attention(q, k, v, seqlens, causal=causal, return_lse=True)
            assert not [w for w in seen if "flashtune" in str(w.message)], [str(w.message) for w in seen]
            plan = next(p for key, p in _plans.items() if key[0] == q.shape and key[1] == k.shape and key[-1])
            assert plan.family is not None and plan.family.name == variant.name, (entry["family"], plan.reason)
            check_cached_sequences(o, lse, q, k, v, seqlens, None, lens, cap, causal, dtype,
                                   f"{variant.name} {plan.params} {case} {dtype} causal {causal} lens {lens}")
        graph, captured = capture(lambda: kvcache_attention(q, k, v, seqlens, causal=causal, return_lse=True))
        for _ in range(2):
            lens = [rng.randint(0, cap) for _ in range(b)]
            seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            _poison_past(torch, k, v, None, lens, 0)
            captured[0].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check_cached_sequences(captured[0], captured[1], q, k, v, seqlens, None, lens, cap, causal, "fp16",
                                   f"graph replay of {variant.name} {case}, lens {lens}")
        if case == HELD_KEYS_CASES[0]:   # a model's step under torch.compile: the eager call's bits
            def step(q, k, v, seqlens):
                o, lse = kvcache_attention(q, k, v, seqlens, causal=causal, return_lse=True)
                return o * 2, lse

            eager = step(q, k, v, seqlens)
            compiled = torch.compile(step, fullgraph=True)(q, k, v, seqlens)
            assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


# each held-keys case on pages: of 16 rows (several a K/V tile), 256 (several tiles a page), 48 and
# 80 (a tile's slots of their common rows), 32 and 128; and slots of 8 rows (a chunk at d=128 on
# pages of 8: 22 a tile), of 16 rows of pages of 112 (a packed step at d=64), a packed step at d=256
# on pages of 16
PAGED_HELD_KEYS_CASES = list(zip(HELD_KEYS_CASES, (16, 256, 48, 80, 32, 128))) + [
    (HELD_KEYS_CASES[3], 8), (HELD_KEYS_CASES[1], 112), ((2, 16, 2, 8, 256, 6000), 16)]


# K/V by the producer's cp.async (GATHER_KV) on each ring layout: d=64 (one 128-byte panel), 88 (64-byte
# panels, the last chunk past the head dim), 80 and 72 (K's tail panel of 32-byte rows, the columns
# past 72 zeros), 96 (three 64-byte panels), 128 (two 128-byte panels, Bc 128;
# on pages of 48 Bc 96, slots starting 0, 16 or 32 rows into a page); slots of 8, 16, 32 and 48 rows;
# and a tuned Bc of 176 narrowed to 128 (cache_form) in the split and packed-GQA families; on each, the
# copies however few boxes the tile takes (gather_min_boxes 0: d=64 on pages of 16 and d=128 on pages of
# 32 and 48 take boxes where served)
@pytest.mark.parametrize("base,d,page,bc,cwg", [("flash_fwd_sm90", 64, 16, 0, 2), ("flash_fwd_sm90", 88, 16, 0, 2),
                                                ("flash_fwd_sm90", 80, 16, 0, 2), ("flash_fwd_sm90_gqa", 72, 8, 0, 2),
                                                ("flash_fwd_sm90", 96, 8, 0, 2), ("flash_fwd_sm90", 128, 32, 0, 2),
                                                ("flash_fwd_sm90", 128, 48, 0, 2), ("flash_fwd_sm90_split", 128, 8, 176, 2),
                                                ("flash_fwd_sm90_gqa", 64, 8, 176, 2), ("flash_fwd_sm90_gqa", 64, 8, 128, 3)])
def test_paged_gather_lands_each_tile_as_the_boxes_do(base, d, page, bc, cwg, tmp_path, monkeypatch):
    """A family's paged cache form on tiles of several slots, two consumers, with the producer's
    warpgroup copying K/V by cp.async (gather on) and with a TMA box per slot and panel (off): ragged
    lengths (0, 1, page +- 1, a tile's edge, the capacity), NaN past them, both within budget of
    float64, and O and the LSE bit for bit the same (the copies land the boxes' bytes: rows past a
    length and before a page's first row as zeros). `bc`: the seed's Bc (0: its own); `cwg` the
    seed's consumers (three: the copies in the producer's 24 registers, gather_min_split 24)."""
    import torch

    from tuner import kvcache, kvcache_attention
    from tuner.kernel_templates import FAMILIES
    from tuner.kernel_templates.flash_fwd_sm90_cache import CACHE_VARIANTS

    gpu = _hopper()
    b, h, kvh, nq, cap = 6, 8, 2, 40, -(-3000 // page) * page
    problem = Problem(b, h, nq, cap, d, "bf16", "causal_br", kvh)
    variant = CACHE_VARIANTS[base].paged(page)
    monkeypatch.setattr(variant, "gather_min_boxes", 0)
    if cwg == 3:
        monkeypatch.setattr(variant, "gather_min_split", 24)
    seeds = (dict(seed, Bc=bc or seed["Bc"]) for seed in FAMILIES[base].seeds(gpu, problem))
    forms = (variant.cache_form(seed, problem) for seed in seeds if seed["cwg"] == cwg and seed["split"])
    params = next(f for f in forms if variant.check(f, gpu, problem) is None)
    assert variant.gathers(params, problem) and params["Bc"] <= 128 and (cwg == 2 or params["split"] == 24), params
    monkeypatch.setattr(kvcache, "held_keys_config", lambda *args: (variant, params))
    rng = random.Random()
    lens = [0, 1, page - 1, page + 1, rng.choice([127, 128, 129, 177]), cap]
    rng.shuffle(lens)
    k, v, table = _cache(rng, torch, b, kvh, d, cap, page, torch.bfloat16)
    _poison_past(torch, k, v, table, lens, page)
    q = torch.randn(b, nq, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    outs = []
    with _untuned(tmp_path):
        for gather in (True, False):
            kvcache._plans.clear()
            monkeypatch.setattr(variant, "gather", gather)
            o, lse = kvcache_attention(q, k, v, seqlens, table, return_lse=True)
            plan = next(p for key, p in kvcache._plans.items() if key[0] == q.shape and key[-1])
            assert plan.family is variant and plan.params == params, (plan.family, plan.reason)
            check_cached_sequences(o, lse, q, k, v, seqlens, table, lens, cap, True, "bf16",
                                   f"{variant.name} {params} gather {gather} lens {lens}")
            outs.append((o.clone(), lse.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), f"d={d} page {page} {params}"


@pytest.mark.parametrize("case,page", PAGED_HELD_KEYS_CASES,
                         ids=lambda c: "page{}".format(c) if isinstance(c, int) else "B{}-H{}/kv{}-{}x{}-d{}".format(*c[:4], c[5], c[4]))
def test_kvcache_runs_attentions_hopper_kernel_on_pages(case, page, tmp_path):
    """The held-keys variants on a paged cache (a shuffled block table, spare pages): the plan names
    the paged variant; ragged lengths at the pages' and tiles' edges (0, 1, page - 1, page + 1, a
    tile either side, the capacity), NaN in every page row past them, bottom-right causal in bf16 and
    unmasked in fp16, against float64, with no per-sequence warning; the call without lengths (every
    page row held); a CUDA graph replayed on new lengths."""
    import warnings

    import torch

    from tuner import kvcache_attention
    from tuner.kernel_templates.flash_fwd_sm90_cache import CACHE_VARIANTS
    from tuner.kvcache import _plans

    gpu = _hopper()
    b, h, kvh, nq, d, cap = case
    cap = -(-cap // page) * page   # the keys a table row names
    rng = random.Random()
    with _untuned(tmp_path) as served:
        for dtype, causal in (("bf16", True), ("fp16", False)):
            entry = served.serving_entry(Problem(b, h, nq, cap, d, dtype, "causal_br" if causal else "none", kvh), gpu)
            variant = CACHE_VARIANTS[configs_family(entry["family"])].paged(page)
            dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
            edges = [1, page - 1, page + 1, 63, 65, 129, 177, nq + 1, rng.randint(2, cap - 1)]
            lens = [0, cap] + rng.sample([n for n in edges if 0 < n < cap], b - 2) if b > 2 else [cap, rng.choice(edges)][:b]
            rng.shuffle(lens)
            k, v, table = _cache(rng, torch, b, kvh, d, cap, page, dt)
            _poison_past(torch, k, v, table, lens, page)
            q = torch.randn(b, nq, h, d, device="cuda", dtype=dt).transpose(1, 2)
            seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                o, lse = kvcache_attention(q, k, v, seqlens, table, causal=causal, return_lse=True)
            assert not [w for w in seen if "flashtune" in str(w.message)], [str(w.message) for w in seen]
            plan = next(p for key, p in _plans.items() if key[0] == q.shape and key[1] == k.shape and key[-1])
            assert plan.family is not None and plan.family.name == variant.name, (entry["family"], plan.reason)
            what = f"{variant.name} {plan.params} {case} {dtype} causal {causal} lens {lens}"
            check_cached_sequences(o, lse, q, k, v, seqlens, table, lens, cap, causal, dtype, what)
        full_k, full_v = (torch.randn_like(t) for t in (k, v))   # no lengths: every row of a sequence's pages
        o, lse = kvcache_attention(q, full_k, full_v, None, table, causal=causal, return_lse=True)
        check_cached_sequences(o, lse, q, full_k, full_v, None, table, [cap] * b, cap, causal, "fp16",
                               f"{variant.name} {case} without lengths")
        graph, captured = capture(lambda: kvcache_attention(q, k, v, seqlens, table, causal=causal, return_lse=True))
        lens = [rng.randint(0, cap) for _ in range(b)]
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        _poison_past(torch, k, v, table, lens, page)
        captured[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_cached_sequences(captured[0], captured[1], q, k, v, seqlens, table, lens, cap, causal, "fp16",
                               f"graph replay of {variant.name} {case}, lens {lens}")
