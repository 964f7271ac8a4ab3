"""benchmarks/retime_entries.py's offline part: which shipped entries it weighs, and when a twin
replaces one."""

from __future__ import annotations

import pytest
from benchmark_scripts import script
from dashboard_dbs import H200

from tuner import export
from tuner.dispatch import Dispatcher

retime = script("retime_entries")


@pytest.fixture(scope="module")
def h200_entries():
    return export.read_lookup(export.SHIPPED_DIR / "NVIDIA-H200_sm_90.json")["entries"]


def test_matching_takes_the_family_s_entries_holding_every_match(h200_entries):
    both = retime.matching(h200_entries, "flash_fwd_sm90", {"persistent": 1, "cwg": 2}, None, None)
    assert both and all(e["family"] == "flash_fwd_sm90" and e["params"]["persistent"] == 1
                        and e["params"]["cwg"] == 2 for e in both)
    d128 = retime.matching(h200_entries, "flash_fwd_sm90", {"persistent": 1, "cwg": 2}, 128, "causal")
    assert d128 and set(map(id, d128)) < set(map(id, both))
    assert all(e["head_dim"] == 128 and e["mask"] == "causal" for e in d128)
    assert retime.matching(h200_entries, "no_such_family", {}, None, None) == []


def test_without_draws_a_twin_wins_only_where_faster_in_every_repeat():
    assert retime.verdict([1.02, 1.03, 1.02], [1.00, 1.01, 1.00])["twin_wins"]
    v = retime.verdict([0.98, 1.03, 1.02], [1.00, 1.01, 1.00])   # one repeat the entry's
    assert not v["twin_wins"] and v["ratio"] == pytest.approx(1.03 / 1.01)   # the median ratio
    with pytest.raises(ValueError):
        retime.verdict([1.0, 1.0], [1.0])


def test_with_draws_a_twin_wins_where_faster_in_the_median_and_over_the_draws():
    entry, twin = [0.98, 1.03, 1.02], [1.00, 1.01, 1.00]   # the median repeat the twin's
    v = retime.verdict(entry, twin, [1.04, 0.99, 1.02])
    assert v["twin_wins"] and v["draws"] == pytest.approx((1.04 * 0.99 * 1.02) ** (1 / 3))
    assert not retime.verdict(entry, twin, [1.01, 0.97, 1.0])["twin_wins"]   # the draws' geomean the entry's
    assert not retime.verdict([1.0, 0.99, 1.01], [1.0, 1.0, 1.0], [1.05])["twin_wins"]   # the median a tie


def test_a_margin_keeps_a_tie_with_the_searchs_pick():
    entry, twin = [1.004, 1.003, 1.004], [1.0, 1.0, 1.0]
    assert retime.verdict(entry, twin, [1.02])["twin_wins"]
    assert not retime.verdict(entry, twin, [1.02], margin=0.005)["twin_wins"]   # 0.4% at the shape
    assert not retime.verdict([1.02] * 3, twin, [1.003], margin=0.005)["twin_wins"]   # 0.3% over the draws
    assert retime.verdict([1.02] * 3, twin, [1.01], margin=0.005)["twin_wins"]
    assert not retime.verdict(entry, twin, margin=0.005)["twin_wins"]   # no draws: every repeat past it


def test_served_draws_are_calls_the_lookup_serves_by_the_entry(h200_entries):
    path = export.SHIPPED_DIR / "NVIDIA-H200_sm_90.json"
    dispatcher = Dispatcher(path)
    entry = next(e for e in h200_entries if e["bucket"] == "bf16/d128/causal/n2048/small" and e["family"] == "flash_fwd_sm90")
    draws = retime.served_draws(entry, dispatcher, H200, 4)
    assert len(draws) == 4 and len(set(draws)) == 4
    for p in draws:
        served = dispatcher.select(p, H200)
        assert (served["bucket"], served["params"]) == (entry["bucket"], entry["params"])
        assert p.head_dim == 128 and p.dtype == "bf16" and p.mask == "causal"
        fam, params = retime._form(entry, dict(entry["params"], chain=0), p, H200)
        assert fam.check(params, H200, p) is None and params["chain"] == 0


def test_assignments_read_name_value_and_refuse_anything_else():
    assert retime._assignments(["chain=0", " stages = 3"]) == {"chain": 0, "stages": 3}
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        retime._assignments(["chain"])


def test_a_run_cut_short_keeps_the_entries_it_timed(tmp_path, monkeypatch):
    """The rows and winning twins are written after every entry: a run its time limit stops at the
    second entry leaves the first in --json and --lookup-out."""
    import json

    import tuner.gpu
    import tuner.timing

    monkeypatch.setattr(tuner.gpu, "detect", lambda: H200)
    monkeypatch.setattr(tuner.timing, "Timer", lambda: None)
    calls = []

    def in_turns(entry, twin, problem, gpu, seeds, timer):
        calls.append(entry["bucket"])
        if len(calls) > 1:
            raise KeyboardInterrupt   # the limit, mid-way through the second entry
        return {"entry": [1.02] * len(seeds), "twin": [1.0] * len(seeds)}

    monkeypatch.setattr(retime, "in_turns", in_turns)
    out, twins = tmp_path / "rows.json", tmp_path / "twins.json"
    with pytest.raises(KeyboardInterrupt):
        retime.main(["--match", "persistent=1", "--match", "cwg=2", "--set", "persistent=0", "--head-dim", "128",
                     "--repeats", "3", "--json", str(out), "--lookup-out", str(twins)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["bucket"] for r in rows] == calls[:1] and rows[0]["twin_wins"]
    (entry,) = export.read_lookup(twins)["entries"]
    assert entry["bucket"] == calls[0] and entry["params"]["persistent"] == 0
