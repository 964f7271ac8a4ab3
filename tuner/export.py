"""The best-config lookup: a versioned JSON document the runtime dispatcher reads.

The dispatcher must run without Optuna or the database, so this module imports the DB lazily
(only `export_from_db` needs it) and `read_lookup` validates everything it hands on.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .files import atomic_write
from .nearest import octaves
from .problem import DTYPES, MASKS, Bucket, Problem, mask_of

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from .db.queries import BestEntry

SCHEMA = "flashtune.best-configs"
# 2: entries say `mask` (none, causal, causal_br) where version 1 said `causal` (a bool, top-left:
# all that flashtune ran then), and buckets round Nq and Nk apart. Version 1 is still read, its
# entries upgraded as they are read (upgrade_v1_entry); what is written is always this version.
SCHEMA_VERSION = 2

# field -> accepted types (bool is excluded from numbers explicitly below)
_ENTRY_FIELDS: dict[str, tuple[type, ...]] = {
    "gpu_key": (str,), "family": (str,), "dtype": (str,), "head_dim": (int,), "mask": (str,),
    "bucket": (str,), "params": (dict,), "tflops": (int, float), "median_ms": (int, float),
    "problem": (dict,),
}


SHIPPED_ENV = "FLASHTUNE_SHIPPED_LOOKUPS"   # "0": the user's lookup alone
SHIPPED_DIR = Path(__file__).parent / "lookups"


def shipped_lookups() -> list[Path]:
    """The lookups flashtune ships (tuner/lookups/, one GPU each, tuned on it), unless
    FLASHTUNE_SHIPPED_LOOKUPS=0."""
    if os.environ.get(SHIPPED_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return []
    return sorted(SHIPPED_DIR.glob("*.json"))


def shipped_lookup(gpu_key: str) -> Path:
    """Where flashtune ships the lookup tuned on `gpu_key`'s GPU (it may ship none)."""
    return SHIPPED_DIR / f"{gpu_key.replace('/', '_')}.json"


def shipped_entries(family: str) -> list[BestEntry]:
    """The shipped lookups' entries of one family, as stored bests (a search's warm starts)."""
    from .db.queries import BestEntry

    out = []
    for path in shipped_lookups():
        for e in read_lookup(path)["entries"]:
            if e["family"] == family:
                out.append(BestEntry(e["gpu_key"], family, Problem.from_dict(e["problem"]), e["bucket"], e["params"],
                                     e["tflops"], e["median_ms"], 0))
    return out


def default_lookup_path() -> Path:
    """TUNER_LOOKUP wins; otherwise best.json in the per-user flashtune data dir."""
    env = os.environ.get("TUNER_LOOKUP")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("flashtune")) / "best.json"


def _group(e: dict[str, Any]) -> tuple[str, str, int, str, str]:
    return (e["gpu_key"], e["dtype"], e["head_dim"], e["mask"], e["bucket"])


def _slot(e: dict[str, Any]) -> tuple[Any, ...]:
    """What one entry serves: a family in a (GPU, dtype, head dim, mask, bucket) group."""
    return (*_group(e), e["family"])


def _document(entries: list[dict[str, Any]]) -> dict[str, Any]:
    rows = sorted(entries, key=lambda e: (*_group(e), -e["tflops"], e["family"]))
    return {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "entries": rows,
    }


def _offset(e: dict[str, Any]) -> float:
    """Octaves between the problem an entry was tuned on and its bucket's own shape (tuner.nearest)."""
    return octaves(Problem.from_dict(e["problem"]), Bucket.from_key(e["bucket"]))


def _answers_better(e: dict[str, Any], than: dict[str, Any]) -> bool:
    """Whether entry `e` should fill a slot `than` fills: a bucket's entries answer for its shape, so
    the one tuned nearer that shape; of two tuned as near, the faster.

    The dispatcher takes a group's fastest runnable entry by TFLOP/s, which compares families only
    on one problem: a larger problem of the same bucket runs more TFLOP/s whatever serves it. Kept
    by speed alone, a group mixed problems (PERF_NOTES "h4": a B32 decode step's cuDNN entry beside
    a B16 one's kernel, and B16, the bucket's own work, served cuDNN at 0.92x of the kernel)."""
    return (_offset(e), -e["tflops"]) < (_offset(than), -than["tflops"])


def build_lookup(entries: list[BestEntry]) -> dict[str, Any]:
    """One entry per (GPU, dtype, head dim, mask, bucket, family), fastest first per group.

    Several tuned problems can fall into one bucket; per family the one tuned nearest the bucket's
    shape is kept (`_answers_better`), since the dispatcher takes the first entry of a group whose
    family it can run.
    """
    fastest: dict[tuple[Any, ...], dict[str, Any]] = {}
    for b in entries:
        p = b.problem
        e = {
            "gpu_key": b.gpu_key, "family": b.family, "dtype": p.dtype, "head_dim": p.head_dim,
            "mask": Bucket.from_key(b.bucket_key).mask, "bucket": b.bucket_key, "params": dict(b.params),
            "tflops": float(b.tflops), "median_ms": float(b.median_ms), "problem": p.to_dict(),
        }
        k = _slot(e)
        if k not in fastest or _answers_better(e, fastest[k]):
            fastest[k] = e
    return _document(list(fastest.values()))


def merge_lookups(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`old` with `new`'s entries added: where both serve the same slot, the new entry (measured
    more recently, from the database being exported) replaces the old one, unless the old one was
    tuned nearer the bucket's shape (`_offset`; see `_answers_better`); nothing else is lost."""
    slots = {_slot(e): e for e in old["entries"]}
    for e in new["entries"]:
        was = slots.get(_slot(e))
        if was is None or _offset(e) <= _offset(was):
            slots[_slot(e)] = e
    return _document(list(slots.values()))


def _missing(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """The entries of `old` whose slot `new` does not fill: what replacing old by new would lose."""
    have = {_slot(e) for e in new["entries"]}
    return [e for e in old["entries"] if _slot(e) not in have]


def stale_slots(file_doc: dict[str, Any], db_doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Where a lookup file no longer says what the database would export now: slots the file
    lacks ("missing") and slots whose config the file holds another of ("changed", the database's
    entry). A slot only the file fills is no sign of age (a merge of another database adds them)."""
    have = {_slot(e): e for e in file_doc["entries"]}
    missing, changed = [], []
    for e in db_doc["entries"]:
        old = have.get(_slot(e))
        if old is None:
            missing.append(e)
        elif old["params"] != e["params"]:
            changed.append(e)
    return {"missing": missing, "changed": changed}


def lookup_of(gpu_key: str, served: list[tuple[Problem, str, dict, float]]) -> dict[str, Any]:
    """A lookup serving each (problem, family, params, TFLOP/s) on `gpu_key`, as if a search had
    measured it: for benchmarks and tests that run given configs without a database."""
    from .db.queries import BestEntry

    return build_lookup([BestEntry(gpu_key, fam, p, p.bucket().key, params, tflops, p.flops() / tflops / 1e9, i)
                         for i, (p, fam, params, tflops) in enumerate(served)])


def _check_entry(e: Any) -> str | None:
    """Why an entry is unusable, or None."""
    if not isinstance(e, dict):
        return "is not an object"
    for name, types in _ENTRY_FIELDS.items():
        if name not in e:
            return f"lacks field {name!r}"
        v = e[name]
        if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
            return f"field {name!r} has type {type(v).__name__}"
    if e["dtype"] not in DTYPES:
        return f"unknown dtype {e['dtype']!r}"
    if e["mask"] not in MASKS:
        return f"unknown mask {e['mask']!r}"
    try:
        bucket = Bucket.from_key(e["bucket"])
        problem = Problem(**e["problem"])
    except (TypeError, ValueError) as err:
        return str(err).splitlines()[0] if str(err) else "bad bucket or problem"
    if (bucket.dtype, bucket.head_dim, bucket.mask) != (e["dtype"], e["head_dim"], e["mask"]):
        return f"bucket {e['bucket']!r} disagrees with dtype/head_dim/mask"
    if problem.bucket() != bucket:
        return f"problem {problem.key} is not in bucket {e['bucket']!r}"
    return None


def validate_lookup(doc: Any, source: str = "lookup") -> dict[str, Any]:
    """Raise ValueError (one line, naming `source`) unless `doc` is a lookup this version reads."""
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: not a flashtune best-config lookup (top level is not an object)")
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{source}: not a flashtune best-config lookup (schema {doc.get('schema')!r})")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"{source}: invalid lookup version {version!r}")
    if version > SCHEMA_VERSION:
        raise ValueError(
            f"{source}: lookup version {version} was written by a newer flashtune "
            f"(this one reads version {SCHEMA_VERSION}); upgrade flashtune or re-export"
        )
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise ValueError(f"{source}: lookup has no 'entries' list")
    if version == 1:
        entries = [upgrade_v1_entry(e) for e in entries]
        doc = {**doc, "version": SCHEMA_VERSION, "entries": entries}
    entries = [_decode_rekeyed(e) for e in entries]
    doc = {**doc, "entries": entries}
    for i, e in enumerate(entries):
        why = _check_entry(e)
        if why:
            raise ValueError(f"{source}: entry {i} {why}")
    return doc


def upgrade_v1_entry(e: Any) -> Any:
    """A version-1 entry as version 2 says it: `causal` (a bool, top-left) becomes `mask`, and the
    bucket is the problem's own under today's rule. Anything malformed is left for _check_entry
    to name."""
    if not (isinstance(e, dict) and isinstance(e.get("causal"), bool) and isinstance(e.get("problem"), dict)):
        return e
    out = {k: v for k, v in e.items() if k != "causal"}
    out["mask"] = mask_of(e["causal"])
    try:
        problem = Problem.from_dict(e["problem"])
    except (TypeError, ValueError):
        return out
    out["problem"], out["bucket"] = problem.to_dict(), problem.bucket().key
    return out


def _decode_rekeyed(e: Any) -> Any:
    """An entry for one query on the bottom-right diagonal, written before such a step was bucketed
    as no mask (problem.seen_mask), in the bucket its problem has now; anything else as it is."""
    if not (isinstance(e, dict) and isinstance(e.get("problem"), dict) and e.get("mask") == "causal_br"
            and isinstance(e.get("bucket"), str)):
        return e
    try:
        problem = Problem.from_dict(e["problem"])
    except (TypeError, ValueError):
        return e
    if problem.seqlen_q != 1 or problem.mask != "causal_br":
        return e
    bucket = problem.bucket()
    return {**e, "bucket": bucket.key, "mask": bucket.mask}


def read_lookup(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{p}: no best-config lookup there (run `tuner export`)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: cannot read the best-config lookup: {e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:  # deeply nested arrays or objects: no lookup is shaped like that
        raise ValueError(f"{p}: not a flashtune best-config lookup (JSON nested too deeply)") from None
    return validate_lookup(doc, str(p))


def write_lookup(doc: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Atomic: a dispatcher reading concurrently sees the old file or the new one, never half."""
    p = Path(path)
    doc = validate_lookup(doc, str(p))   # a version-1 document is written as this version
    atomic_write(p, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode("utf-8"), durable=True)


class LookupRefused(ValueError):
    """Writing would overwrite a file that is not a lookup, or lose entries of one (one line)."""


SQLITE_MAGIC = b"SQLite format 3\x00"
# How an existing lookup may be replaced: merged into, replaced only by one at least as complete
# (nothing it serves is lost), or replaced whatever it holds (a damaged lookup included).
POLICIES = ("merge", "complete", "force")


def existing_lookup(path: str | os.PathLike[str], *, force: bool = False) -> dict[str, Any] | None:
    """The lookup at `path`, or None where there is none to keep (no file, an empty one).

    Refuses (LookupRefused) a file that is not a lookup: a database, someone else's JSON, a
    directory; and, unless `force`, a damaged lookup or one of a newer version.
    """
    p = Path(path)
    if p.is_dir():
        raise LookupRefused(f"{p} is a directory, not a best-config lookup")
    try:
        with p.open("rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except FileNotFoundError:
        return None
    except OSError as e:
        raise LookupRefused(f"{p}: cannot read it ({e.strerror or e}), so it is not replaced") from None
    if not head:
        return None
    if head == SQLITE_MAGIC:
        raise LookupRefused(f"{p} is a SQLite database, not a best-config lookup: refusing to overwrite it")
    try:
        return read_lookup(p)
    except ValueError as e:
        if not _claims_to_be_a_lookup(p):
            raise LookupRefused(f"{p} is not a flashtune best-config lookup: refusing to overwrite it") from None
        if force:
            return None
        raise LookupRefused(f"{e}; remove it, or replace it with `tuner export -o {p} --force`") from None


def _claims_to_be_a_lookup(p: Path) -> bool:
    """A damaged lookup (an entry or version this flashtune cannot read) still names its schema."""
    try:
        return f'"schema": "{SCHEMA}"' in p.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return False


def publish_lookup(doc: dict[str, Any], path: str | os.PathLike[str], policy: str = "complete") -> dict[str, Any]:
    """Write `doc` to `path` without losing what a lookup there serves; returns what was written.

    "merge": the old entries stay, `doc`'s are added (merge_lookups). "complete": refused unless
    `doc` fills every slot the old lookup fills. "force": `doc` replaces any lookup (never a file
    that is not one).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    old = existing_lookup(path, force=policy == "force")
    if old is not None and policy == "merge":
        doc = merge_lookups(old, doc)
    elif old is not None and policy == "complete" and (lost := _missing(old, doc)):
        e = lost[0]
        raise LookupRefused(
            f"{path} holds {len(lost)} entr{'y' if len(lost) == 1 else 'ies'} the new lookup lacks (e.g. "
            f"{e['gpu_key']} {e['bucket']} {e['family']}): pass --merge to add the new entries to it, "
            f"or --force to replace it")
    write_lookup(doc, path)
    return doc


def lookup_from_db(session: Session, gpu_key: str | None = None) -> dict[str, Any]:
    """The lookup ft_best makes (optionally one GPU's entries), with the SDPA backends the
    dispatcher can run as entries of their own (peers.DISPATCHED_PEERS, each at its latest timing)
    for the problems a family was tuned on, so that choosing SDPA for a bucket is a measured
    decision like choosing a tuned family."""
    from .db.queries import best_rows, peer_best_rows
    from .peers import DISPATCHED_PEERS

    tuned = best_rows(session, gpu_key)
    # a peer only where a family was tuned on the same problem: a problem that was only benched
    # (peers and no search) would otherwise fill a bucket with SDPA alone, and hide the tuned
    # configs another lookup (a shipped one) holds for it
    searched = {(b.gpu_key, b.problem.key) for b in tuned}
    peers = [b for b in peer_best_rows(session, gpu_key, tuple(DISPATCHED_PEERS)) if (b.gpu_key, b.problem.key) in searched]
    return build_lookup(tuned + peers)


def export_from_db(session: Session, path: str | os.PathLike[str], gpu_key: str | None = None,
                   policy: str = "complete") -> int:
    """Write the lookup from ft_best (publish_lookup's `policy`); returns its entry count."""
    return len(publish_lookup(lookup_from_db(session, gpu_key), path, policy)["entries"])
