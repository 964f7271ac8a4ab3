"""Markdown tables from committed bench results (benchmarks/results/*.json), for the README:

    python3 benchmarks/results_tables.py models benchmarks/results/<gpu>-models.json
        what the dispatcher served for each model shape, beside SDPA cuDNN and flash (same run)
    python3 benchmarks/results_tables.py peers FILE
        every shape of a bench with FlashAttention-4 among the peers: ours against cuDNN and FA4
    python3 benchmarks/results_tables.py cross OWN.json [OWN.json ...] OTHER.json
        the same shapes served by this GPU's lookup (OWN, one file or several) and by another GPU's
        lookup re-keyed to this one (OTHER, `gpu_session.sh ship` with OTHER_LOOKUP): where the winners differ, and
        what running the other GPU's configs here costs. The two were timed in separate runs, so
        the rows whose config is the same in both show the run-to-run noise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _rows(path: str) -> list[dict]:
    return json.loads(Path(path).read_text())["rows"]


def _shape(r: dict) -> str:
    from tuner.problem import Problem

    return Problem.from_dict(r).key


def _served(r: dict) -> str:
    return "SDPA cuDNN" if r["family"] == "sdpa_cudnn" else "SDPA flash" if r["family"] == "sdpa_flash" else \
        "SDPA efficient" if r["family"] == "sdpa_efficient" else "tuned"


def models(path: str) -> str:
    from tuner.models import MODELS

    names = {}
    for name, m in MODELS.items():
        for p in m.problems("bf16"):
            names.setdefault(p.key, name)
    out = ["| model | shape | served by | TFLOP/s | SDPA cuDNN | SDPA flash | vs best SDPA |", "|---" * 7 + "|"]
    for r in _rows(path):
        best = max(r.get("sdpa_cudnn_tflops") or 0, r.get("sdpa_flash_tflops") or 0)
        out.append(f"| {names.get(_shape(r), '')} | {_shape(r)} | {_served(r)} | {r['tuned_tflops']:.0f} | "
                   f"{r.get('sdpa_cudnn_tflops') or 0:.0f} | {r.get('sdpa_flash_tflops') or 0:.0f} | "
                   f"{r['tuned_tflops'] / best:.2f}x |")
    return "\n".join(out)


def peers(path: str) -> str:
    out = ["| shape | served by | TFLOP/s | SDPA cuDNN | SDPA flash | FA4 | vs cuDNN | vs FA4 |", "|---" * 8 + "|"]
    wins = []
    for r in _rows(path):
        fa4, cudnn = r.get("fa4_tflops"), r.get("sdpa_cudnn_tflops")
        ratio = lambda peer: f"{r['tuned_tflops'] / peer:.2f}x" if peer and r["tuned_tflops"] else "-"
        num = lambda x: f"{x:.0f}" if x else "-"
        out.append(f"| {_shape(r)} | {_served(r)} | {num(r['tuned_tflops'])} | {num(cudnn)} | "
                   f"{num(r.get('sdpa_flash_tflops'))} | {num(fa4)} | {ratio(cudnn)} | {ratio(fa4)} |")
        if fa4 and r["tuned_tflops"]:
            wins.append(r["tuned_tflops"] >= fa4)
    out.append("")
    out.append(f"At or above FA4 on {sum(wins)} of {len(wins)} shapes.")
    return "\n".join(out)


def _pick(x: dict, other: dict) -> str:
    """A served config by what sets it apart from `other`'s: the SDPA backend, or the differing params."""
    if x["family"] != "flash_fwd_sm90" or other["family"] != x["family"]:
        return _served(x) if x["family"].startswith("sdpa") else x["family"]
    a, b = x["config"] or {}, other["config"] or {}
    return ", ".join(f"{k}={a.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


def cross(own_paths: list[str], other_path: str) -> str:
    own = {_shape(r): r for path in own_paths for r in _rows(path)}
    out = ["| shape | this GPU's pick | TFLOP/s | other GPU's pick | TFLOP/s | other / own |", "|---" * 6 + "|"]
    same, differ = [], []
    for r in _rows(other_path):
        mine = own.get(_shape(r))
        if mine is None or not (mine["tuned_tflops"] and r["tuned_tflops"]):
            continue
        ratio = r["tuned_tflops"] / mine["tuned_tflops"]
        alike = (mine["family"], mine["config"]) == (r["family"], r["config"])
        (same if alike else differ).append(ratio)
        if not alike:
            out.append(f"| {_shape(r)} | {_pick(mine, r)} | {mine['tuned_tflops']:.0f} | {_pick(r, mine)} | "
                       f"{r['tuned_tflops']:.0f} | {ratio:.3f} |")
    spread = lambda xs: f"{min(xs):.3f} to {max(xs):.3f}" if xs else "-"
    out.append("")
    out.append(f"{len(differ)} of {len(same) + len(differ)} shapes have another winner; the other GPU's configs run at "
               f"{spread(differ)} of this GPU's there. Where both picked the same config (noise between the two "
               f"runs): {spread(same)}.")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("models", "peers", "cross"))
    ap.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    if a.what == "cross" and len(a.files) < 2:
        ap.error("cross takes this GPU's bench files, then the other GPU's")
    print(models(a.files[0]) if a.what == "models" else peers(a.files[0]) if a.what == "peers"
          else cross(a.files[:-1], a.files[-1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
