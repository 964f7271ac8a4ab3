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
