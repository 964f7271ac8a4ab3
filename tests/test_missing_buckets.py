"""benchmarks/missing_buckets.py: what one GPU's lookup has tuned and another's lacks, as the
`tuner search` arguments gpu_session.sh's `fill` step runs (CPU; the searches need the GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmark_scripts import script
from tuner.problem import Problem

ROOT = Path(__file__).resolve().parents[1]


def _entry(family: str, p: Problem, gpu: str = "NVIDIA H100/sm_90") -> dict:
    return dict(bucket=p.bucket().key, family=family, gpu_key=gpu, problem=p.to_dict(), params={}, median_ms=1.0)


CHUNK = Problem(1, 32, 512, 8192, 128, "bf16", "causal_br", 8)
STEP = Problem(32, 32, 1, 8192, 128, "fp16", "none", 8)
WIDE = Problem(1, 8, 512, 4096, 64, "bf16", "causal_br", max_error=2e-2)


def test_each_missing_bucket_and_family_is_searched_once_by_family_dtype_and_budget(tmp_path):
    mod = script("missing_buckets")
    source = [_entry("flash_fwd_sm90", CHUNK), _entry("flash_fwd_sm90_split", CHUNK), _entry("sdpa_cudnn", CHUNK),
              _entry("flash_fwd_sm90", Problem(1, 32, 500, 8000, 128, "bf16", "causal_br", 8)),   # CHUNK's bucket
              _entry("flash_decode", STEP), _entry("flash_decode_varlen", STEP), _entry("flash_fwd_sm90", WIDE)]
    target = [_entry("flash_fwd_sm90_split", CHUNK, gpu="NVIDIA H200/sm_90")]
    groups = mod.missing(source, target)
    # the target has CHUNK's split entry; SDPA is measured beside any search; a varlen variant is
    # tuned on its length mix, not the padded problem; the second chunk is the first's bucket again
    # but another problem, so both are searched
    assert groups == {("flash_fwd_sm90", "bf16", 0.0): [CHUNK, Problem(1, 32, 500, 8000, 128, "bf16", "causal_br", 8)],
                      ("flash_decode", "fp16", 0.0): [STEP], ("flash_fwd_sm90", "bf16", 0.02): [WIDE]}
    lines = mod.search_lines(groups)
    assert lines[0] == "flash_decode --dtype fp16 --shape 32,32:8,1:8192,128,full"
    assert lines[2] == "flash_fwd_sm90 --dtype bf16 --max-error 0.02 --shape 1,8:8,512:4096,64,causal_br"
    # what each line's --shape arguments parse to is the problem the source's entry was tuned on
    shapes = [a for a in lines[1].split() if "," in a]
    assert [Problem.parse(s, "bf16") for s in shapes] == groups[("flash_fwd_sm90", "bf16", 0.0)]


def test_the_command_line_reads_two_lookup_files(tmp_path):
    src, dst = tmp_path / "h100.json", tmp_path / "h200.json"
    src.write_text(json.dumps({"entries": [_entry("flash_decode", STEP)]}))
    dst.write_text(json.dumps({"entries": [_entry("flash_decode", STEP, gpu="NVIDIA H200/sm_90")]}))
    run = lambda a, b: subprocess.run([sys.executable, str(ROOT / "benchmarks" / "missing_buckets.py"), "--from", str(a),
                                       "--to", str(b)], capture_output=True, text=True, check=True).stdout
    assert run(src, dst) == ""
    dst.write_text(json.dumps({"entries": []}))
    assert run(src, dst) == "flash_decode --dtype fp16 --shape 32,32:8,1:8192,128,full\n"
