import numpy as np
import pytest
import torch

from precision_lab import formats


def test_unit_roundoffs_are_powers_of_two_from_significand_bits():
    assert formats.unit_roundoff("float32") == 2.0 ** -24
    assert formats.unit_roundoff("float64") == 2.0 ** -53
    assert formats.unit_roundoff("tf32") == formats.unit_roundoff("float16") == 2.0 ** -11
    assert formats.unit_roundoff("bfloat16") == 2.0 ** -8
    with pytest.raises(ValueError, match="expected one of"):
        formats.unit_roundoff("float8")


def test_round_mantissa_ties_to_even():
    one = 1.0
    x = torch.tensor([one + 2.0 ** -11, one + 3 * 2.0 ** -11, one + 2.0 ** -12, -(one + 3 * 2.0 ** -11)], dtype=torch.float32)
    got = formats.round_mantissa(x, 10).tolist()
    # halfway cases go to the even neighbour; below halfway goes down
    assert got == [1.0, one + 2.0 ** -9, 1.0, -(one + 2.0 ** -9)]


def test_round_mantissa_seven_bits_matches_torch_bfloat16():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1), dtype=torch.float32) * 1e3
    tiny, big = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), big, -big, tiny, tiny / 3, -tiny / 7,
                             1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], dtype=torch.float32)
    x = torch.cat([x, specials])
    expected = x.to(torch.bfloat16).to(torch.float32)  # PyTorch's own round-to-nearest-even
    got = formats.round_mantissa(x, 7)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # bit for bit: signed zeros too
    with_nan = formats.round_mantissa(torch.tensor([float("nan"), 1.0 + 2.0 ** -9], dtype=torch.float32), 7)
    assert torch.isnan(with_nan[0]) and with_nan[1].item() == 1.0  # NaN stays NaN, the rest still rounds


def test_tf32_rounding_error_is_within_its_unit_roundoff():
    x = torch.rand(10_000, generator=torch.Generator().manual_seed(2), dtype=torch.float32) + 0.5
    rel = ((formats.round_to(x, "tf32") - x).abs() / x).max().item()
    assert 0 < rel <= formats.unit_roundoff("tf32")


def test_ulp_distance_counts_float32_spacings():
    b = np.array([1.0, 1.0, 0.75])
    a = np.array([1.0 + 2.0 ** -23, 1.0 + 4 * 2.0 ** -23, 0.75])
    assert formats.ulp_distance(a, b).tolist() == [1.0, 4.0, 0.0]


def _scaled_emulation(reference, fmt: str, scale: float):
    """A result whose error is `scale` × what emulated `fmt` operands make: the format's pattern at `scale` × its
    level (scale 1: the format itself)."""
    from precision_lab.compute import Result
    from precision_lab.doctors import emulate

    emulated = emulate(reference, fmt)

    def scaled(got, want):
        want = np.asarray(want, np.float64)
        return (want + scale * (np.asarray(got, np.float64) - want)).astype(np.float32)

    return Result(float(scaled(emulated.loss, reference.loss)),
                  {n: scaled(g, reference.grads[n]) for n, g in emulated.grads.items()},
                  scaled(emulated.output, reference.output), "float32", {"candidate": f"{fmt}×{scale:g}"})


def test_a_format_is_named_only_with_its_level_and_its_pattern_both(small_reference):
    """An error with bfloat16's pattern at 23× its level is no bfloat16 run (a divisor slip was named so on a probe
    whose own evidence said 'bfloat16 23×'); bfloat16 itself, at its level, is named."""
    from precision_lab.verdict import judge

    named = judge(_scaled_emulation(small_reference, "bfloat16", 1.0), small_reference, "float32", "bf16")
    assert named.verdict == "reduced-precision" and named.format == "bfloat16", named.to_text()
    off_level = judge(_scaled_emulation(small_reference, "bfloat16", 23.0), small_reference, "float32", "23x")
    assert off_level.verdict == "defect", off_level.to_text()
    assert not any(q.format for q in off_level.quantities.values()), off_level.to_text()
    rows = [row for row in off_level.fingerprint if row["format"] == "bfloat16" and row["correlation"] >= 0.95]
    assert rows and not any(row["conclusive"] for row in rows)  # the pattern is there; the level is not


def test_the_fingerprints_float32_runs_have_the_same_bits_whatever_the_labs_threads(small_problem):
    """A diagnosis lowers the lab's threads while a program runs; the null's members and the emulations must not
    change with it (PyTorch's CPU kernels split their sums by the thread count: 0.3735940754 against 0.3735940456 of
    Σ|∂L/∂conv1.weight| at 64², one thread against two, before they took one thread of their own)."""
    from precision_lab.doctors import formats as fingerprint
    from precision_lab.reference import reference

    ref = reference(small_problem)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            ref.meta.pop("null_members", None), ref.meta.pop("emulations", None)
            members = fingerprint._null_members(ref)
            emulated = fingerprint.emulate(ref, "bfloat16", "weight_grad")
            assert torch.get_num_threads() == threads  # the lab's count comes back after
            runs.append([member.grads for member in members.values()] + [emulated.grads])
    finally:
        torch.set_num_threads(before)
    for first, second in zip(*runs):
        for name in first:
            assert np.array_equal(first[name].view(np.int32), second[name].view(np.int32)), name
