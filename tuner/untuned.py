"""What serves a call that no tuned entry serves: each kernel family's default config where it runs the
call (flash_decode for a decode step, the split Hopper kernel where its query blocks leave SMs idle and
its keys split at a gain, else the plain Hopper kernel), as the dispatcher falls back to them
(Dispatcher.select, serving_entry) before torch's attention."""

from __future__ import annotations

from .problem import DECODE_QUERIES, Problem

# A call nothing tuned serves runs flash_fwd_sm90's default, not the split default, where the
# default's tiles make this many waves: its persistent schedule evens out the last wave, which
# splitting the keys would otherwise buy (B8-H4 1078 x 8849 keys at d=96, 288 tiles: 476 TFLOP/s
# against 446 split; at 160 tiles, 1.2 waves, B1-H16 1260 x 27529 read 540 split, 391 unsplit;
# PERF_NOTES "j3").
DEFAULT_WAVES = 2


def decode_default(problem: Problem, gpu) -> dict | None:
    """flash_decode's default config for a decode call nothing tuned serves (no entry of its bucket
    or a nearby one): untuned, it still reads each K/V head once for its query heads and splits the
    keys to fill the GPU, where a prefill config or SDPA would otherwise run it. The shipped lookups
    tune the common decode buckets (benchmarks/PERF_NOTES.md "d7")."""
    from .kernel_templates import FAMILIES

    fam = FAMILIES.get("flash_decode")
    if fam is None or fam.supports(gpu, problem):
        return None
    return {"family": fam.name, "params": fam.default(gpu, problem)}


def split_default(problem: Problem, gpu) -> dict | None:
    """flash_fwd_sm90_split's default config for a prefill call nothing tuned serves whose query
    blocks leave SMs idle (a few heads of a short prompt, a chunk of a tensor-parallel shard: no
    bucket within reach, and too few blocks to borrow one at any distance), where its occupancy
    splits the keys. Where it would run one split, or where flash_fwd_sm90's default (persistent)
    makes DEFAULT_WAVES waves of its tiles, that default serves (prefill_default)."""
    from .kernel_templates import FAMILIES
    from .kernel_templates.flash_fwd_sm90 import three_consumers_pay

    fam = FAMILIES.get("flash_fwd_sm90_split")
    if fam is None or problem.seqlen_q <= DECODE_QUERIES or fam.supports(gpu, problem):
        return None
    params = fam.default(gpu, problem)
    if fam.splits(params, problem, gpu) < 2:
        return None
    plain = prefill_default(problem, gpu)
    # where three_consumers_pay chose the default's 192-row tiles (at d = 72-96, by the waves they make
    # against 128-row ones), its waves are counted as two consumers' tiles, on which the rule was measured:
    # on three H200 calls that 192-row tiles would have split, the plain default read 1.06-1.08x the split
    if plain:
        rows = 128 if three_consumers_pay(gpu, problem) else 64 * plain["params"]["cwg"]
        if problem.query_blocks(rows) >= DEFAULT_WAVES * gpu.sm_count:
            return None
        # where the default takes three consumers, their tiles weighed against the split's own (PERF_NOTES "x3",
        # 30 random calls the split served on the H200, timed in turns against the plain default): the 9 where
        # the estimate favours three consumers plain read 0.995-1.46x the split, 1.27x geomean, the 6 where it
        # favours the split 0.74-0.94x; where the default takes two consumers (15 calls) plain read 0.75-1.09x,
        # 0.93x geomean, the estimate wrong both ways there: the split kept
        from .kernel_templates.flash_fwd_sm90_split import split_pays

        if plain["params"]["cwg"] == 3 and not split_pays(params, plain["params"], problem, gpu):
            return None
    return {"family": fam.name, "params": params}


def prefill_default(problem: Problem, gpu) -> dict | None:
    """flash_fwd_sm90's default config for a prefill call that no tuned bucket serves: one that fills
    the GPU with no bucket of its head dim, dtype, mask and error budget at any distance (tuner.nearest
    borrows only within them: a head dim nobody tuned, Phi-3's 96, Stable Diffusion's 80 and 160), or
    one of fewer query blocks than SMs with no bucket near whose keys split no gain
    (split_default). The default (the family's first valid seed) came within 1% of the best of every
    swept space (PERF_NOTES "The Hopper space swept"). SDPA served the second kind until PERF_NOTES
    "n1": on the H200, on eight such calls of 48-128 blocks of 128 rows, it read 1.14-2.8x SDPA's best
    backend and 1.02-2.5x the best of SDPA and FlashAttention-4 in the same turns (B2-H8/kv2 743 x 8133
    queries x keys: 546 TFLOP/s against cuDNN's 432; 32 heads of a 216 x 811 chunk: 251 against SDPA
    flash's 132), where p1's rule had been fitted to one 8-head shard (32 blocks, which its bucket's
    split entry serves, 0.97x SDPA flash)."""
    from .kernel_templates import FAMILIES

    fam = FAMILIES.get("flash_fwd_sm90")
    if fam is None or problem.seqlen_q <= DECODE_QUERIES or fam.supports(gpu, problem):
        return None
    return {"family": fam.name, "params": fam.default(gpu, problem)}


def one_consumer_default(problem: Problem, gpu) -> dict | None:
    """flash_fwd_sm90's default at one consumer (64-row blocks, no ping-pong, the registers all the
    consumer's) for a 16-bit prefill whose 64-row blocks make a wave of CTAs or less
    (flash_fwd_sm90.one_consumer_pays): there one CTA's rows x keys are the launch, and one consumer
    halves them on twice the CTAs. None elsewhere, or where that config does not run the call."""
    from .kernel_templates import FAMILIES
    from .kernel_templates.flash_fwd_sm90 import at_one_consumer, one_consumer_pays

    fam = FAMILIES.get("flash_fwd_sm90")
    if (fam is None or problem.dtype not in ("fp16", "bf16") or fam.supports(gpu, problem)
            or not one_consumer_pays(gpu, problem)):
        return None
    params = at_one_consumer(fam.default(gpu, problem))
    return None if fam.check(params, gpu, problem) is not None else {"family": fam.name, "params": params}
