"""A results database whose stored bests are the configs of a committed bench result, so that
`tuner bench` re-times exactly those on this GPU beside the peers, with no search first:

    python3 benchmarks/results_db.py benchmarks/results/<gpu>-fp16-bf16.json sqlite:////tmp/grid.db --dtype bf16
    tuner bench --db sqlite:////tmp/grid.db --dtype bf16 --peer sdpa_flash --peer sdpa_cudnn \
        $(python3 benchmarks/results_db.py benchmarks/results/<gpu>-fp16-bf16.json --shapes --dtype bf16)

Each config is stored as one `ok` measurement carrying the file's figures (versions
{"from": <file>}), on the GPU this machine has.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> int:
    from tuner.db import queries
    from tuner.db.engine import make_engine, session_factory
    from tuner.gpu import detect
    from tuner.problem import Problem
    from tuner.records import Measurement

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("db", nargs="?")
    ap.add_argument("--dtype", help="only the rows of this dtype")
    ap.add_argument("--shapes", action="store_true", help="print the rows' problems as `tuner bench` --shape "
                                                           "arguments (B,H,N,D[,causal]) instead of storing them")
    a = ap.parse_args(argv)
    doc = json.loads(Path(a.results).read_text())
    if a.shapes:
        print(" ".join(f"--shape {r['batch']},{r['heads']},{r['seqlen_q']},{r['head_dim']}{',causal' * r['causal']}"
                       for r in doc["rows"] if a.dtype in (None, r["dtype"])))
        return 0
    if a.db is None:
        ap.error("a database URL is needed to store the bests")
    gpu = detect()
    sessions = session_factory(make_engine(a.db))
    n = 0
    with sessions.begin() as s:
        for row in doc["rows"]:
            if not row.get("config") or not row.get("tuned_tflops") or a.dtype not in (None, row["dtype"]):
                continue
            p = Problem.from_dict(row)
            ms = row["tuned_ms"][1] if row.get("tuned_ms") else p.flops() / row["tuned_tflops"] / 1e9
            m = Measurement("ok", median_ms=ms, tflops=row["tuned_tflops"], versions={"from": Path(a.results).name})
            queries.record_measurement(s, gpu, p, row["family"], row["config"], m)
            queries.update_best(s, gpu.key, p.key, row["family"])
            n += 1
    print(f"{n} stored bests from {a.results} in {a.db}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
