"""A best-config lookup made from a committed bench result (benchmarks/results/*.json), the configs
that bench timed, plus the family default for any other problem given: a benchmark then runs tuned
kernels without a search."""

from __future__ import annotations

import json
from pathlib import Path


def write_lookup(results: str | Path, out: str | Path, extra=(), gpu=None) -> int:
    """Writes the lookup to `out`; `extra` problems get the default config of the first family that
    runs them on `gpu`. Returns the number of entries."""
    from tuner import export
    from tuner.kernel_templates import get_family
    from tuner.problem import Problem

    doc = json.loads(Path(results).read_text())
    served = [(Problem.from_dict(row), row["family"], row["config"], row["tuned_tflops"])
              for row in doc["rows"] if row.get("config") and row.get("tuned_tflops")]
    for p in extra:
        fam = next(get_family(n) for n in ("flash_fwd_sm90", "flash_fwd_mma", "flash_fwd_simt")
                   if get_family(n).supports(gpu, p) is None)
        served.append((p, fam.name, fam.default(gpu, p), 1.0))
    doc = export.lookup_of(gpu.key if gpu else doc["gpu_key"], served)
    export.write_lookup(doc, out)
    return len(doc["entries"])
