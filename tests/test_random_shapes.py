"""benchmarks/random_shapes.py on the CPU: its draws are shapes `tuner bench` takes, within its caps,
spread over the calls a model makes, and the same seed draws the same shapes."""

from __future__ import annotations

import random

import pytest
from benchmark_scripts import script

from tuner.problem import Problem

rs = script("random_shapes")


def _problems(seed: int, count: int = 200, kinds=rs.KINDS) -> list[Problem]:
    rng = random.Random(seed)
    return [Problem.parse(rs.draw(rng, kinds), "bf16") for _ in range(count)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_draws_parse_and_stay_within_the_caps(seed):
    for p in _problems(seed):
        flops = 4 * p.batch * p.heads * p.seqlen_q * p.seqlen_k * p.head_dim
        kv_bytes = 4 * p.batch * p.kv_heads * p.seqlen_k * p.head_dim
        assert p.batch == 1 or (flops <= rs.FLOP_CAP and kv_bytes <= rs.KV_BYTES_CAP), p.key


def test_draws_cover_prompts_chunks_cross_and_decode_steps():
    ps = _problems(3)
    assert any(p.seqlen_q == p.seqlen_k and p.mask == "causal" for p in ps)
    assert any(p.mask == "causal_br" and 16 < p.seqlen_q < p.seqlen_k for p in ps)
    assert any(p.mask == "none" and p.seqlen_q != p.seqlen_k for p in ps)
    assert any(p.decode_step for p in ps)
    assert any(p.kv_heads < p.heads for p in ps)
    assert len({p.head_dim for p in ps}) >= 5


def test_kind_narrows_the_llm_calls():
    ps = [p for p in _problems(4, kinds=("decode",)) if p.seqlen_q <= 16]
    assert ps and all(p.decode_step and p.mask == "causal_br" for p in ps)
    assert not any(p.seqlen_q == p.seqlen_k and p.mask == "causal" for p in _problems(4, kinds=("decode",)))


def test_the_cli_replays_a_seed_and_refuses_an_unknown_kind(capsys):
    assert rs.main(["--count", "12", "--seed", "5"]) == 0
    first = capsys.readouterr().out
    assert rs.main(["--count", "12", "--seed", "5"]) == 0
    assert capsys.readouterr().out == first and first.startswith("--shape ")
    assert rs.main(["--kind", "prefill"]) == 2
    assert "--kind takes" in capsys.readouterr().err
