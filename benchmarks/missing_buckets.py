"""The buckets one GPU's lookup has tuned and another's lacks, as `tuner search` arguments: what a
GPU serves only by borrowing its kin's entries (Dispatcher.kin) until it is searched itself.

    python3 benchmarks/missing_buckets.py --from tuner/lookups/NVIDIA-H100-80GB-HBM3_sm_90.json \\
        --to tuner/lookups/NVIDIA-H200_sm_90.json

prints one line per (family, dtype, error budget): the family, then the --dtype, --max-error and
--shape arguments of the problems the first lookup's entries were tuned on, e.g.
`flash_fwd_sm90_split --dtype bf16 --shape 1,8:1,1024:65536,128,causal_br ...`.
gpu_session.sh's `fill` step searches each line. SDPA's entries are measured beside every search
(its peers), and the packed variants (varlen) are left out: they are tuned on a length mix
(`varlen-ship`), not on the padded problem a lookup records.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from tuner.kernel_templates import FAMILIES, VARIANTS_BY_NAME
from tuner.problem import MASK_KEYS, Problem


def shape_arg(p: Problem) -> str:
    """`p` as the CLI's --shape (SHAPE_FORMAT), K/V heads and keys always spelled out."""
    return f"{p.batch},{p.heads}:{p.kv_heads},{p.seqlen_q}:{p.seqlen_k},{p.head_dim},{MASK_KEYS[p.mask]}"


def missing(source: list[dict], target: list[dict]) -> dict[tuple[str, str, float], list[Problem]]:
    """The problems of `source`'s tuned entries whose (bucket, family) `target` has no entry for,
    by (family, dtype, error budget), each problem once, in the source's order."""
    have = {(e["bucket"], e["family"]) for e in target}
    out: dict[tuple[str, str, float], list[Problem]] = defaultdict(list)
    for e in source:
        fam = e["family"]
        if fam not in FAMILIES or fam in VARIANTS_BY_NAME or (e["bucket"], fam) in have:
            continue
        p = Problem.from_dict(e["problem"])
        group = out[(fam, p.dtype, p.max_error)]
        if p not in group:
            group.append(p)
    return dict(out)


def search_lines(groups: dict[tuple[str, str, float], list[Problem]]) -> list[str]:
    lines = []
    for (fam, dtype, max_error), problems in sorted(groups.items()):
        err = f" --max-error {max_error:g}" if max_error else ""
        lines.append(f"{fam} --dtype {dtype}{err} " + " ".join(f"--shape {shape_arg(p)}" for p in problems))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="source", type=Path, required=True, help="the lookup whose buckets to cover")
    ap.add_argument("--to", dest="target", type=Path, required=True, help="the lookup that lacks some of them")
    args = ap.parse_args()
    source, target = (json.loads(p.read_text())["entries"] for p in (args.source, args.target))
    for line in search_lines(missing(source, target)):
        print(line)


if __name__ == "__main__":
    main()
