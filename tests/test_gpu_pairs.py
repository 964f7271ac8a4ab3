"""On the GPU: flash_fwd_sm90_pairs (persistent CTAs in clusters of two, each K/V tile multicast into
both, the cluster's tiles from a static schedule, the last rounds cut a segment a cluster) against
float64: fresh random shapes whose pairs of query blocks leave the last one half past N, Nq != Nk,
GQA, launched twice (the cut halves' counters reset themselves), with and without a cut tail."""

from __future__ import annotations

import random

import pytest
from test_gpu_kernel import _assert_within_budget, _run
from test_gpu_tail import _cut_problem, assert_served_in_form

from tuner.problem import Problem

pytestmark = pytest.mark.gpu


@pytest.fixture
def cut_any(monkeypatch):
    """tail_from cuts tiles of any length (the mechanics on small shapes)."""
    from tuner.kernel_templates import flash_fwd_sm90_tail

    monkeypatch.setattr(flash_fwd_sm90_tail, "TAIL_LONG_KV_TILES", 2)


def _configs(fam, gpu, d: int, rng: random.Random) -> list[dict]:
    probe = Problem(1, 8, 8192, 8192, d, "bf16", "none", 8)
    points = [p for p in fam.valid_points(gpu, probe)]
    return [fam.default(gpu, probe)] + rng.sample(points, 2)


@pytest.mark.parametrize("d", [64, 80, 128])
def test_pairs_with_a_cut_tail_match_reference(d, cut_any):
    """Shapes of one to three rounds of pairs on the clusters whose last rounds are cut."""
    from tuner.gpu import detect
    from tuner.kernel_templates.flash_fwd_sm90_pairs import FAMILY as fam

    gpu, rng = detect(), random.Random()
    for params in _configs(fam, gpu, d, rng):
        problem = _cut_problem(rng, 2 * 64 * params["cwg"], params["Bc"], d, gpu.sm_count // 2)
        if fam.check(params, gpu, problem) is not None:
            continue
        for _ in range(2):
            err = _run(fam, params, problem, rng.randrange(2**31), rng.choice(["bhnd", "bnhd"]))
            _assert_within_budget(err, problem, f"{problem.key} {params}")


@pytest.mark.parametrize("d", [64, 128])
def test_pairs_without_a_cut_match_reference(d):
    """Fewer pairs than clusters (a short launch), an odd number of query blocks (the last pair's
    second CTA has no rows), and whole rounds: no cut."""
    from tuner.gpu import detect
    from tuner.kernel_templates.flash_fwd_sm90_pairs import FAMILY as fam

    gpu, rng = detect(), random.Random()
    for params in _configs(fam, gpu, d, rng):
        rows = 64 * params["cwg"]
        shapes = [Problem(1, 2, 3 * rows - 5, rng.randint(100, 3000), d, "bf16", "none", 1),
                  Problem(2, 4, 5 * rows + 1, rng.randint(params["Bc"] + 1, 5000), d, "fp16", "none", 2),
                  Problem(1, 6, 2 * rows * (gpu.sm_count // 2) // 3, 1024, d, "bf16", "none", 6)]
        for problem in shapes:
            if fam.check(params, gpu, problem) is not None:
                continue
            err = _run(fam, params, problem, rng.randrange(2**31), rng.choice(["bhnd", "bnhd"]))
            _assert_within_budget(err, problem, f"{problem.key} {params}")


def _paired_seed(sm90, pairs, gpu, problem: Problem) -> dict:
    """A persistent two-consumer seed of flash_fwd_sm90 the rule serves in pairs for `problem`, without
    ping-pong where that is what keeps it out (the cut tail's registers at Bc 176)."""
    return next(p for p in (dict(s, pingpong=0) for s in sm90.seeds(gpu, problem))
                if p["persistent"] and not p["chain"] and p["cwg"] == 2 and pairs.pairs_form(p, gpu, problem) is not None)


def test_attention_serves_a_long_d128_persistent_config_in_pairs(tmp_path):
    """A lookup entry of a persistent flash_fwd_sm90 config serves an unmasked d=128 call of 4096
    keys or more in clusters of two (its tail cut: 1.5 rounds of pairs), GQA, Nq != Nk, token-major
    inputs, O and the LSE against float64."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family

    gpu, sm90, pairs = detect(), get_family("flash_fwd_sm90"), get_family("flash_fwd_sm90_pairs")
    problem = Problem(1, 4, 100 * 128 - 37, 9001, 128, "bf16", "none", 2)   # 4 x 50 pairs, 71 K/V tiles each
    params = _paired_seed(sm90, pairs, gpu, problem)
    assert_served_in_form(tmp_path, problem, params, pairs.name, token_major=True)


def test_pairs_served_under_torch_compile_and_in_a_cuda_graph(tmp_path):
    """What a model does with the op: `attention` served in pairs (200 pairs on the clusters, the last
    rounds cut) inside torch.compile(fullgraph=True), then captured in a CUDA graph and replayed on new values,
    O against float64 each time (the cut halves' join slots reset themselves between replays)."""
    import math

    import torch
    from cuda_graphs import capture

    import tuner
    from tuner import dispatch
    from tuner.export import lookup_of, write_lookup
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.reference import attention_fp64, compare

    gpu, sm90, pairs = detect(), get_family("flash_fwd_sm90"), get_family("flash_fwd_sm90_pairs")
    problem = Problem(1, 4, 100 * 128 - 37, 4100, 128, "bf16", "none", 2)
    params = _paired_seed(sm90, pairs, gpu, problem)
    path = tmp_path / "lookup.json"
    write_lookup(lookup_of(gpu.key, [(problem, "flash_fwd_sm90", params, 1.0)]), path)
    disp = dispatch.reset(path)
    try:
        q = torch.randn(1, 4, problem.seqlen_q, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 2, problem.seqlen_k, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        assert disp.plan(q, k, v, "none").family == pairs.name

        def check(o) -> None:
            ref_o, ref_lse = attention_fp64(q, k, v, "none", 1.0 / math.sqrt(128))
            err = compare(o, None, ref_o, None)
            assert err.within(problem.rel_budget, problem.lse_budget), err

        compiled = torch.compile(lambda q, k, v: tuner.attention(q, k, v), fullgraph=True)
        check(compiled(q, k, v))
        graph, out = capture(lambda: tuner.attention(q, k, v))
        for _ in range(3):
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check(out)
    finally:
        dispatch.reset()
