"""CUDA-graph capture for the GPU tests: a call captured on a side stream, as torch.cuda.graphs
requires."""

from __future__ import annotations


def capture(call, warmup: bool = True):
    """`call()` captured in a CUDA graph on a side stream, after one eager call there where
    `warmup` (plans and the stream's workspaces made outside the capture; without it the capture
    makes them): (graph, the captured call's output, which each replay rewrites)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        if warmup:
            call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
    torch.cuda.current_stream().wait_stream(side)
    return graph, out


def assert_replays_match_reference(graph, inputs, out, problem, replays: int = 3) -> None:
    """Replay `graph` (which reads `inputs`, q, k, v, and writes `out`, O and the LSE) `replays`
    times on fresh random values written in place, O poisoned with NaN before each: O and the LSE
    against float64 each time, within `problem`'s budgets."""
    import math

    import torch

    from tuner.reference import attention_fp64, compare

    q, k, v = inputs
    for _ in range(replays):
        for t in inputs:
            t.copy_(torch.randn_like(t))
        out[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_o, ref_lse = attention_fp64(q, k, v, problem.mask, 1.0 / math.sqrt(problem.head_dim))
        err = compare(out[0], out[1], ref_o, ref_lse)
        assert err.within(problem.rel_budget, problem.lse_budget), err
