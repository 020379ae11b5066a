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
