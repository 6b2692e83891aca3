"""The cost profiles reproduce the published tables and interpolate between their points."""

from __future__ import annotations

import pytest

from lanes.scheduler.costmodel import PROFILES, SpecDecoding, get_profile, interpolate

L70_H100_PREFILL = {512: 53.4, 1024: 77.9, 2048: 136.8, 4096: 390.3, 8192: 844.9}
L70_H100_DECODE = {1: 29.8, 8: 32.5, 16: 34.2, 32: 38.6, 64: 50.2}
L70_A100_PREFILL = {512: 127.0, 1024: 227.0, 2048: 403.0, 4096: 965.0, 8192: 2279.0}
L70_A100_DECODE = {1: 45.0, 8: 45.8, 16: 48.5, 32: 52.4, 64: 73.0}


@pytest.mark.parametrize(("name", "prefill", "decode"), [
    ("l70-h100", L70_H100_PREFILL, L70_H100_DECODE),
    ("l70-a100", L70_A100_PREFILL, L70_A100_DECODE),
])
def test_table_points_are_exact(name: str, prefill: dict[int, float], decode: dict[int, float]) -> None:
    profile = get_profile(name)
    for tokens, ms in prefill.items():
        assert profile.prefill_step_ms(tokens) == pytest.approx(ms)
    for batch, ms in decode.items():
        assert profile.decode_step_ms(batch) == pytest.approx(ms)


def test_linear_between_points_and_last_segment_extrapolated() -> None:
    p = get_profile("L70-H100")
    assert p.prefill_step_ms(768) == pytest.approx((53.4 + 77.9) / 2)
    assert p.decode_step_ms(48) == pytest.approx((38.6 + 50.2) / 2)
    slope = (844.9 - 390.3) / 4096
    assert p.prefill_step_ms(12288) == pytest.approx(844.9 + slope * 4096)
    assert p.decode_step_ms(128) == pytest.approx(50.2 + (50.2 - 38.6) / 32 * 64)
    assert p.decode_step_ms(0) == 0.0


def test_l7_a100_adds_attention_per_context_token() -> None:
    p = get_profile("l7-a100")
    assert p.prefill_step_ms(1024) == pytest.approx(68.3)
    assert p.prefill_step_ms(4096) == pytest.approx(260.0)
    assert p.decode_step_ms(64) == pytest.approx(9.8)
    assert p.decode_step_ms(64, 100_000) == pytest.approx(9.8 + 26.0)


def test_interpolate_never_negative_and_unknown_profile() -> None:
    assert interpolate(((10.0, 1.0), (20.0, 11.0)), 0.0) == 0.0
    assert set(PROFILES) == {"l70-h100", "l70-a100", "l7-a100"}
    with pytest.raises(KeyError, match="known"):
        get_profile("tpu")


def test_speculative_tokens_per_step() -> None:
    spec = SpecDecoding(acceptance_rate=0.8, num_draft_tokens=4, draft_cost_ratio=0.05)
    assert spec.tokens_per_step() == pytest.approx((1 - 0.8**5) / 0.2)
    assert SpecDecoding(0.0, 4).tokens_per_step() == 1.0
    assert spec.step_ms(40.0) == pytest.approx(48.0)
    with pytest.raises(ValueError):
        SpecDecoding(1.0, 4)


def test_chunked_step_costs_the_decode_plus_each_chunks_share_of_the_prefill_curve() -> None:
    """A prompt split into chunks costs what it costs in one piece, plus the fixed cost of the
    extra iterations that decode nothing; beside a decode step the chunk adds only its share."""
    profile = get_profile("l70-h100")
    whole = profile.chunked_step_ms([(0, 5000)], None)
    assert whole == pytest.approx(profile.prefill_step_ms(5000))
    pieces = [profile.chunked_step_ms([chunk], None) for chunk in ((0, 2048), (2048, 2048), (4096, 904))]
    assert sum(pieces) == pytest.approx(profile.prefill_step_ms(5000) + 2 * profile.prefill_step_ms(0))
    decode_ms = profile.decode_step_ms(8)
    mixed = profile.chunked_step_ms([(1000, 500), (0, 300)], decode_ms)
    assert mixed == pytest.approx(decode_ms + profile.prefill_step_ms(1500) - profile.prefill_step_ms(1000)
                                  + profile.prefill_step_ms(300) - profile.prefill_step_ms(0))
    assert profile.chunked_step_ms([], decode_ms) == decode_ms
