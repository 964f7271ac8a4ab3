"""On the GPU: flash_fwd_sm90_tail (a persistent launch's last two rounds of work tiles cut into one
segment of equal work per CTA, a cut tile's halves joined by the later one) against float64, on fresh
random shapes whose tiles leave the last round part-full; relaunches and graph replays (the halves'
counters reset themselves), and `attention` serving a persistent config in that form."""

from __future__ import annotations

import math
import random

import pytest
from cuda_graphs import assert_replays_match_reference, capture
from test_gpu_kernel import _assert_within_budget, _run, _run_inputs

from tuner.problem import Problem

pytestmark = pytest.mark.gpu


@pytest.fixture
def cut_any(monkeypatch):
    """tail_from cuts tiles of any length (the kernel's mechanics on small shapes; the policy's
    thresholds are what the H100 measured, test_tail_cpu.py)."""
    from tuner.kernel_templates import flash_fwd_sm90_tail

    monkeypatch.setattr(flash_fwd_sm90_tail, "TAIL_LONG_KV_TILES", 2)


def _cut_problem(rng: random.Random, rows: int, bc: int, d: int, sms: int, dtype: str | None = None) -> Problem:
    """An unmasked shape of one to three rounds of `rows`-row work tiles on `sms` SMs whose tail
    tail_from cuts: queries and keys not multiples of the tiles, Nq != Nk, GQA 1 to 4."""
    from tuner.family import ceil_div
    from tuner.kernel_templates.flash_fwd_sm90_tail import tail_from

    while True:
        kvh = rng.choice([1, 2])
        heads, batch = kvh * rng.choice([1, 2, 4]), rng.randint(1, 2)
        nq = rng.randint(rows * (sms // 8) // (batch * heads), rows * 3 * sms // (batch * heads))
        nk = rng.choice([bc + 1, 3 * bc - 5, 1000, 2049, nq + 77])
        tiles = batch * heads * ceil_div(nq, rows)
        if tiles > sms and tail_from(tiles, sms, ceil_div(nk, bc)) < tiles:
            return Problem(batch, heads, nq, nk, d, dtype or rng.choice(["fp16", "bf16"]), "none", kvh)


@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_cut_tail_matches_reference(d, cut_any):
    """The family's default and a random valid config, each launched twice on fresh inputs (the
    second launch finds the counters the first reset), O and the LSE against float64."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family

    fam, gpu, rng = get_family("flash_fwd_sm90_tail"), detect(), random.Random()
    probe = Problem(1, 8, 8192, 8192, d, "bf16", "none", 8)
    configs = [fam.default(gpu, probe)]
    configs += rng.sample(fam.valid_points(gpu, probe), 1)
    for params in configs:
        problem = _cut_problem(rng, 64 * params["cwg"], params["Bc"], d, gpu.sm_count, probe.dtype)
        if fam.check(params, gpu, problem) is not None:   # registers or shared memory of another dtype
            continue
        for _ in range(2):
            err = _run(fam, params, problem, rng.randrange(2**31), rng.choice(["bhnd", "bnhd"]))
            _assert_within_budget(err, problem, f"{problem.key} {params}")


def test_cut_tail_replays_in_a_cuda_graph(cut_any):
    """A captured launch with a cut tail, replayed on new inputs: each replay's halves meet anew."""
    import torch

    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.measure import poisoned_outputs

    fam, gpu = get_family("flash_fwd_sm90_tail"), detect()
    problem = _cut_problem(random.Random(7), 128, 128, 128, gpu.sm_count, "bf16")
    params = fam.default(gpu, problem)
    shape = (problem.batch, problem.heads, problem.seqlen_q, 128)
    q = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(problem.batch, problem.kv_heads, problem.seqlen_k, 128, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    out = poisoned_outputs(problem, q)
    graph, _ = capture(lambda: _run_inputs(fam, params, problem, q, k, v, sync=False, out=out))
    assert_replays_match_reference(graph, (q, k, v), out, problem)


def test_attention_serves_a_persistent_config_with_its_tail_cut(tmp_path):
    """A lookup entry of a persistent flash_fwd_sm90 config serves an unmasked call whose last round
    is part-full in the cut form (the plan's family says so), O and the LSE against float64."""
    from tuner.family import ceil_div
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.kernel_templates.flash_fwd_sm90_tail import tail_from

    gpu, sm90, tail = detect(), get_family("flash_fwd_sm90"), get_family("flash_fwd_sm90_tail")
    # 2 x 100 tiles of 128 rows, 24 K/V tiles each: 1.5 rounds on 132 SMs, cut under the shipped rule
    # (and too few keys for pairs of CTAs, which serve 4096 keys or more: test_gpu_pairs.py)
    problem = Problem(1, 2, 100 * 128 - 37, 3001, 128, "bf16", "none", 1)
    params = next(p for p in sm90.seeds(gpu, problem) if p["persistent"] and not p["chain"] and p["cwg"] == 2
                  and p["Bc"] == 128 and tail.check(p, gpu, problem) is None)
    assert tail_from(problem.query_blocks(128), gpu.sm_count, ceil_div(problem.seqlen_k, 128)) < problem.query_blocks(128)
    assert_served_in_form(tmp_path, problem, params, tail.name)


def assert_served_in_form(tmp_path, problem: Problem, params: dict, family: str, token_major: bool = False) -> None:
    """A lookup of one flash_fwd_sm90 entry (`params`, tuned on `problem`) serves `problem` through
    `attention` in the form `family` (the plan says so), O and the LSE against float64; inputs
    head-major or (token_major) (B, H, N, D) views of (B, N, H, D) storage."""
    import torch

    from tuner import dispatch
    from tuner.export import lookup_of, write_lookup
    from tuner.gpu import detect
    from tuner.reference import attention_fp64, compare

    gpu, d = detect(), problem.head_dim
    path = tmp_path / "lookup.json"
    write_lookup(lookup_of(gpu.key, [(problem, "flash_fwd_sm90", params, 1.0)]), path)
    disp = dispatch.reset(path)
    try:
        def draw(heads, n):
            if token_major:
                return torch.randn(problem.batch, n, heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            return torch.randn(problem.batch, heads, n, d, device="cuda", dtype=torch.bfloat16)

        q = draw(problem.heads, problem.seqlen_q)
        k, v = draw(problem.kv_heads, problem.seqlen_k), draw(problem.kv_heads, problem.seqlen_k)
        assert disp.plan(q, k, v, "none").family == family
        o, lse = disp(q, k, v, "none", return_lse=True)
        ref_o, ref_lse = attention_fp64(q, k, v, "none", 1.0 / math.sqrt(d))
        err = compare(o, lse, ref_o, ref_lse)
        assert err.within(problem.rel_budget, problem.lse_budget), err
    finally:
        dispatch.reset()
