"""Two checkouts' served calls on the same shapes, each timed by served_alternatives.py in its own
process with the peers beside it: our time after over before, read directly, and each against the
best peer of its own run.

    python3 benchmarks/served_ab.py BEFORE.json AFTER.json [--before-column served] [--after-column served] [--json OUT]

A change whose Python side moves too (a tile's width, a default's rule) cannot run both sides in one
process, as ab_kernel.py does for kernel sources. Across two processes on one GPU our kernels read the
same configs alike, while the peers' readings of short calls moved up to 3x (SDPA flash 12.5 -> 19.0
TFLOP/s on a 30 us decode step; PERF_NOTES "z2"): the direct ratio is the one to judge by, the
best-peer columns say where each side stands. gpu_session.sh's `ab-tree` step makes both files.
A column is any entry served_alternatives.py timed ("served", "default", a --config's name).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # served_alternatives, beside this script

from served_alternatives import PEERS  # noqa: E402  (the peers its rows time)


@dataclass(frozen=True)
class ShapeAB:
    """One shape's two readings (TFLOP/s), the ratio, and each side against its own run's best peer."""

    shape: str
    before: float
    after: float
    ratio: float
    before_vs_peer: float | None
    after_vs_peer: float | None


def best_peer(tflops: dict[str, float | None]) -> float | None:
    """The fastest peer a row timed (None where it timed none)."""
    return max((v for k, v in tflops.items() if k in PEERS and v), default=None)


def rows_by_shape(path: str | Path) -> dict[str, dict]:
    return {row["shape"]: row for row in json.loads(Path(path).read_text())["rows"]}


def compare(before: dict[str, dict], after: dict[str, dict], before_column: str = "served",
            after_column: str = "served") -> tuple[list[ShapeAB], list[str]]:
    """The shapes both runs timed in their columns, in BEFORE's order; and those left out (a column
    missing where SDPA served, or a shape only one run has), each said why."""
    out, left = [], []
    for shape, b in before.items():
        a = after.get(shape)
        if a is None:
            left.append(f"{shape}: not in AFTER")
            continue
        tb, ta = b["tflops"].get(before_column), a["tflops"].get(after_column)
        if not tb or not ta:
            left.append(f"{shape}: no {before_column if not tb else after_column} reading")
            continue
        pb, pa = best_peer(b["tflops"]), best_peer(a["tflops"])
        out.append(ShapeAB(shape, tb, ta, ta / tb, pb and tb / pb, pa and ta / pa))
    return out, left


def summary(rows: list[ShapeAB]) -> dict[str, float | int]:
    """Geometric means, extremes and counts under the best peer, over the compared shapes."""
    ratios = [r.ratio for r in rows]
    vs_b = [r.before_vs_peer for r in rows if r.before_vs_peer]
    vs_a = [r.after_vs_peer for r in rows if r.after_vs_peer]
    return dict(shapes=len(rows), ratio_geomean=statistics.geometric_mean(ratios), ratio_min=min(ratios),
                ratio_max=max(ratios), before_vs_peer_geomean=statistics.geometric_mean(vs_b) if vs_b else 0.0,
                after_vs_peer_geomean=statistics.geometric_mean(vs_a) if vs_a else 0.0,
                before_under_peer=sum(v < 1 for v in vs_b), after_under_peer=sum(v < 1 for v in vs_a))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--before-column", default="served")
    ap.add_argument("--after-column", default="served")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows, left = compare(rows_by_shape(args.before), rows_by_shape(args.after), args.before_column, args.after_column)
    for why in left:
        print(f"left out: {why}")
    if not rows:
        print("served_ab: no shape has a reading on both sides", file=sys.stderr)
        return 1
    peer = lambda v: f"{v:.3f}" if v else "-"
    print(f"{'shape':<36} {'before':>8} {'after':>8} {'after/before':>12} {'before/peer':>11} {'after/peer':>10}")
    for r in rows:
        print(f"{r.shape:<36} {r.before:8.1f} {r.after:8.1f} {r.ratio:12.3f} {peer(r.before_vs_peer):>11} {peer(r.after_vs_peer):>10}")
    s = summary(rows)
    print(f"\nafter / before over {s['shapes']} shapes: geometric mean {s['ratio_geomean']:.3f}, "
          f"{s['ratio_min']:.3f}-{s['ratio_max']:.3f}; against the best peer of its run: before "
          f"{s['before_vs_peer_geomean']:.3f} ({s['before_under_peer']} under), after "
          f"{s['after_vs_peer_geomean']:.3f} ({s['after_under_peer']} under)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(summary=s, rows=[asdict(r) for r in rows], left_out=left), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
