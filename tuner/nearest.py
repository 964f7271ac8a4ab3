"""How near two attention shapes are, for borrowing what was measured on one for the other.

A config's fitness depends exactly on the GPU, dtype, head dim, mask and error budget (another of
any of these is another kernel), and smoothly on the sequence lengths and the parallel work. So
shapes are comparable only where the first agree, and their distance is in octaves: |log2| of the
Nq ratio, plus that of Nk, plus half that of the work (batch x heads). Tuned problems and shape
buckets both have these coordinates; a bucket's are its rounded lengths and a work size that
stands for its class.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TypeVar

from .problem import Bucket, Problem

T = TypeVar("T")
# What a bucket's work class stands for, in batch x heads (problem.WORK_CLASSES: < 32, < 256, < 2048,
# above). Huge stands at its floor: a huge call of a length nobody tuned at that work still takes its
# own GPU's large neighbour an octave of length away (1 + 0.5 x 2 octaves of work) before another
# GPU's huge entry (Dispatcher.kin), as it did before the class existed.
WORK_BH = {"small": 16, "medium": 128, "large": 512, "huge": 2048}
WORK_WEIGHT = 0.5   # an octave of work moves a config's fitness less than an octave of length


def _coords(x: Problem | Bucket) -> tuple[tuple, tuple[float, float, float]]:
    exact = (x.dtype, x.head_dim, x.mask, x.max_error)
    if isinstance(x, Problem):
        return exact, (math.log2(x.seqlen_q), math.log2(x.seqlen_k), math.log2(x.batch * x.heads))
    return exact, (math.log2(x.queries), math.log2(x.seqlen), math.log2(WORK_BH[x.work]))


def _apart(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    return abs(a[0] - b[0]) + abs(a[1] - b[1]) + WORK_WEIGHT * abs(a[2] - b[2])


def distance(a: Problem | Bucket, b: Problem | Bucket) -> float | None:
    """Octaves between two shapes, or None where they are not comparable (another dtype, head dim,
    mask or error budget)."""
    (ea, pa), (eb, pb) = _coords(a), _coords(b)
    return _apart(pa, pb) if ea == eb else None


def octaves(a: Problem | Bucket, b: Problem | Bucket) -> float:
    """Octaves between two shapes' lengths and work, whatever else they are: a tuned problem and
    the bucket it fell into (a decode step's bottom-right mask is its bucket's "full")."""
    return _apart(_coords(a)[1], _coords(b)[1])


def nearest(target: Problem | Bucket, candidates: Iterable[T], shape: Callable[[T], Problem | Bucket],
            limit: int | None = None) -> list[tuple[float, T]]:
    """The comparable candidates, nearest first (ties keep the candidates' order), with their distance."""
    found = [(d, i, c) for i, c in enumerate(candidates) if (d := distance(target, shape(c))) is not None]
    found.sort(key=lambda t: (t[0], t[1]))
    return [(d, c) for d, _, c in found[:limit]]
