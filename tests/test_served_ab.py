"""benchmarks/served_ab.py: two checkouts' served_alternatives.py runs compared shape by shape, our
time directly and each side against its own run's best peer."""

from __future__ import annotations

import json
import math
import random

from benchmark_scripts import script

ab = script("served_ab")


def _run(rows: dict[str, dict]) -> dict:
    return {"gpu": "NVIDIA H200", "rows": [{"shape": s, "dtype": "bf16", "alternatives": {}, "tflops": t}
                                           for s, t in rows.items()]}


def test_the_ratio_is_read_directly_and_each_side_against_its_own_peers(tmp_path, capsys):
    rng = random.Random()
    shapes = [f"{rng.randint(1, 64)},32:32,1:{rng.randint(1000, 60000)},80" for _ in range(5)]
    shapes = list(dict.fromkeys(shapes))
    before, after = {}, {}
    for s in shapes:
        b, a, peer_b, peer_a = (rng.uniform(1, 20) for _ in range(4))
        before[s] = {"served": b, "sdpa_cudnn": peer_b, "sdpa_flash": peer_b / 2, "fa4": None}
        after[s] = {"served": a, "sdpa_cudnn": peer_a / 3, "sdpa_flash": peer_a, "fa4": None, "g": 2 * a}
    before["1,8,1:4096,64"] = {"sdpa_cudnn": 3.0, "sdpa_flash": 2.0}   # SDPA served it: no reading of ours
    (tmp_path / "b.json").write_text(json.dumps(_run(before)))
    (tmp_path / "a.json").write_text(json.dumps(_run(after)))

    rows, left = ab.compare(ab.rows_by_shape(tmp_path / "b.json"), ab.rows_by_shape(tmp_path / "a.json"))
    assert [r.shape for r in rows] == shapes and left == ["1,8,1:4096,64: not in AFTER"]
    for r in rows:
        assert math.isclose(r.ratio, after[r.shape]["served"] / before[r.shape]["served"])
        assert math.isclose(r.before_vs_peer, before[r.shape]["served"] / before[r.shape]["sdpa_cudnn"])
        assert math.isclose(r.after_vs_peer, after[r.shape]["served"] / after[r.shape]["sdpa_flash"])
    s = ab.summary(rows)
    assert s["ratio_min"] <= s["ratio_geomean"] <= s["ratio_max"] and s["shapes"] == len(shapes)
    assert s["after_under_peer"] == sum(after[x]["served"] < after[x]["sdpa_flash"] for x in shapes)

    out = tmp_path / "ab.json"
    assert ab.main([str(tmp_path / "b.json"), str(tmp_path / "a.json"), "--after-column", "g", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert [round(r["ratio"], 9) for r in saved["rows"]] == [round(2 * after[x]["served"] / before[x]["served"], 9) for x in shapes]
    assert "left out: 1,8,1:4096,64" in capsys.readouterr().out


def test_nothing_to_compare_says_so_and_fails(tmp_path, capsys):
    (tmp_path / "b.json").write_text(json.dumps(_run({"2,8,1:512,64": {"sdpa_cudnn": 1.0}})))
    (tmp_path / "a.json").write_text(json.dumps(_run({"2,8,1:512,64": {"sdpa_cudnn": 1.0, "served": 2.0}})))
    assert ab.main([str(tmp_path / "b.json"), str(tmp_path / "a.json")]) == 1
    captured = capsys.readouterr()
    assert "no served reading" in captured.out and "no shape has a reading on both sides" in captured.err
