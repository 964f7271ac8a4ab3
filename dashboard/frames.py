"""The tables the pages draw: the tuned best beside its peers, how it fares against each, the
winners per GPU, a study's trials split into measured and not, the lookup. Plain pandas over
`data`'s cached loaders, so each table has one home whichever page shows it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pandas as pd

from tuner.dashboard import data
from tuner.kernel_templates import times_a_length_mix
from tuner.peers import PEER_FAMILIES, peer_dtype
from tuner.problem import GPT2_FP32, Problem, standard_grid

# The peers in the order a reader compares against them: the strongest first.
PEER_ORDER = ("sdpa_cudnn", "fa4", "sdpa_flash", "sdpa_efficient", "sdpa_math")
assert set(PEER_ORDER) == set(PEER_FAMILIES)
RESOURCES = ("registers", "spill_bytes", "stack_bytes", "static_smem", "dynamic_smem")


def params_text(params: dict) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":")) if params else "{}"


def peer_label(family: str) -> str:
    return family.removeprefix("sdpa_")


def shape_kind(p: Problem) -> str:
    """"grid" for docs/benchmarks.md's standard grid (and the fp32 GPT-2 shapes), else "model"."""
    plain = dataclasses.replace(p, max_error=0.0)
    return "grid" if plain in GPT2_FP32 or plain in standard_grid(p.dtype) else "model"


def problems(summ: pd.DataFrame, gpu_key: str | None = None) -> dict[str, Problem]:
    """The problems in `summ` (on one GPU), by key."""
    rows = summ if gpu_key is None else summ[summ["gpu_key"] == gpu_key]
    return {r.problem_key: Problem(int(r.batch), int(r.heads), int(r.seqlen_q), int(r.seqlen_k), int(r.head_dim),
                                   r.dtype, r.mask, int(r.kv_heads))
            for r in rows.drop_duplicates("problem_key").itertuples(index=False)}


def best_frame(url: str, summ: pd.DataFrame) -> pd.DataFrame:
    """One row per tuned best (GPU, family, problem) left by the filters, its peers beside it
    (`<peer> TFLOP/s`, the latest ok row of each on the same GPU and problem). A varlen variant's
    best has none: it was timed on a packed length mix, the peers on the padded problem."""
    keep = set(zip(summ["gpu_key"], summ["family"], summ["problem_key"]))
    rows = []
    for b in data.best(url):
        if b.family in PEER_FAMILIES or (b.gpu_key, b.family, b.problem.key) not in keep:
            continue
        peers = {} if times_a_length_mix(b.family) else \
            {f: p.tflops for f, p in data.peers(url, b.gpu_key, b.problem.key).items() if p.tflops}
        top = max(peers.values(), default=None)
        row: dict[str, Any] = {"GPU": b.gpu_key, "problem": b.problem.key, "family": b.family,
                               "params": params_text(b.params), "ms": b.median_ms, "TFLOP/s": b.tflops}
        row.update({f"{peer_label(f)} TFLOP/s": peers[f] for f in PEER_ORDER if f in peers})
        row["vs best peer"] = b.tflops / top if top else None
        rows.append(row)
    return pd.DataFrame(rows)


def dense(best: pd.DataFrame) -> pd.DataFrame:
    """best_frame's rows of dense runs: a varlen variant's TFLOP/s are of its length mix, so it is
    never the fastest family of its padded problem nor a point of the roofline."""
    return best[~best["family"].map(times_a_length_mix)] if not best.empty else best


def fastest(best: pd.DataFrame) -> pd.DataFrame:
    """The fastest dense tuned family per (GPU, problem)."""
    best = dense(best)
    return best if best.empty else best.sort_values("TFLOP/s", ascending=False).drop_duplicates(["GPU", "problem"])


def versus(best: pd.DataFrame, summ: pd.DataFrame) -> pd.DataFrame:
    """The fastest tuned family per (GPU, problem) against each peer measured beside it: one row
    per pair with the ratio (above 1: ours is faster), the shape's kind and a sort order."""
    cols = ["GPU", "problem", "kind", "family", "params", "TFLOP/s", "peer", "peer TFLOP/s", "ratio", "order"]
    top = fastest(best)
    if top.empty:
        return pd.DataFrame(columns=cols)
    known = problems(summ)
    rows = []
    for r in top.to_dict("records"):
        p = known[r["problem"]]
        order = (shape_kind(p) != "grid", p.dtype, p.head_dim, p.seqlen_k, p.causal, r["problem"])
        for f in PEER_ORDER:
            peer_tflops = r.get(f"{peer_label(f)} TFLOP/s")
            if peer_tflops is not None and not pd.isna(peer_tflops):
                rows.append({"GPU": r["GPU"], "problem": r["problem"], "kind": shape_kind(p), "family": r["family"],
                             "params": r["params"], "TFLOP/s": r["TFLOP/s"], "peer": peer_label(f),
                             "peer TFLOP/s": peer_tflops, "ratio": r["TFLOP/s"] / peer_tflops, "order": order})
    return pd.DataFrame(rows, columns=cols)


def winners_across_gpus(best: pd.DataFrame) -> pd.DataFrame:
    """Problems tuned on more than one GPU: each GPU's winner (family and params) and its TFLOP/s,
    and whether the winners differ; differing ones first."""
    top = fastest(best)
    if top.empty:
        return pd.DataFrame()
    shared = top.groupby("problem")["GPU"].nunique()
    top = top[top["problem"].isin(shared[shared > 1].index)]
    if top.empty:
        return pd.DataFrame()
    top = top.assign(winner=top["family"] + " " + top["params"])
    wide = top.pivot(index="problem", columns="GPU", values=["winner", "TFLOP/s"])
    wide.columns = [f"{gpu} {what}" for what, gpu in wide.columns]
    wide["winners differ"] = top.groupby("problem")["winner"].nunique() > 1
    return wide.reset_index().sort_values(["winners differ", "problem"], ascending=[False, True])


def peer_run_dtype(family: str, p: Problem) -> str:
    """The dtype a kernel of `family` ran in on `p`: a peer runs in peer_dtype (bf16 for fp8 inputs)."""
    return peer_dtype(p) if family in PEER_FAMILIES else p.dtype


def roofline_points(long: pd.DataFrame, known: dict[str, Problem]) -> pd.DataFrame:
    """Each (kernel, problem) bar as a point: the dtype it ran in and its arithmetic intensity
    (FLOP per byte of that dtype moved)."""
    dtypes, intensity = [], []
    for kernel, key in zip(long["family"], long["problem"]):
        p = known[key]
        ran = dataclasses.replace(p, dtype=peer_run_dtype(kernel, p))
        dtypes.append(ran.dtype)
        intensity.append(ran.flops() / ran.bytes_moved())
    return long.assign(dtype=dtypes, **{"FLOP/byte": intensity})


def sort_key(value: object) -> tuple[int, float, str]:
    """Numbers in numeric order (32 before 128), then anything else as text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def ordered(values: pd.Series) -> list[object]:
    return sorted(values.dropna().unique().tolist(), key=sort_key)


def trials(df: pd.DataFrame) -> pd.DataFrame:
    """A study's rows in trial order with `trial` (the Optuna trial number, else the row's place)
    and `outcome`: "ok", or the status with its reason. Validity is the stored status, never
    Optuna's value (a point `check` rejects may be told to Optuna as 0 or as a failed trial)."""
    if df.empty:
        return df.assign(trial=[], outcome=[])
    place = pd.Series(range(len(df)), index=df.index)
    trial = df["trial_number"].astype("Float64").fillna(place).astype(int)
    reason = df["message"].fillna("").map(lambda m: " ".join(str(m).split())[:120])
    outcome = df["status"].where(df["status"] == "ok", df["status"] + ": " + reason)
    return df.assign(trial=trial, outcome=outcome).sort_values(["trial", "id"])


def lookup_frame(doc: dict) -> pd.DataFrame:
    """The lookup's entries as rows that fit a page: the bucket names dtype, head dim, mask and
    shape class, and the params (the widest column) come last."""
    cols = ["gpu_key", "family", "bucket", "TFLOP/s", "ms", "params"]
    rows = [{**e, "params": params_text(e["params"]), "TFLOP/s": e["tflops"], "ms": e["median_ms"]}
            for e in doc.get("entries", [])]
    return pd.DataFrame(rows, columns=cols)
