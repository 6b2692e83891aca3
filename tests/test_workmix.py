"""The prefill share of an engine's work (``scheduler/workmix.py``) and the lanes stepping aside
while prompts dominate (``policy.lanes_to_pop(..., prefill_share)``, ``policy.prefill_heavy``)."""

from __future__ import annotations

import math

import pytest

from lanes.queue.messages import Lane
from lanes.scheduler.costmodel import get_profile
from lanes.scheduler.live_policy import PREFILL_HEAVY_SHARE, lanes_slot_config
from lanes.scheduler.policy import SlotConfig, lanes_to_pop, prefill_heavy
from lanes.scheduler.workmix import WorkMix
from lanes.workers.settings import WorkerSettings


def test_share_is_prompt_over_prompt_plus_weighted_output_over_the_window() -> None:
    mix = WorkMix(window=4, min_requests=2)
    mix.observe(1000, 10)
    assert mix.prefill_share(12.0) == 0.0, "says nothing before min_requests"
    mix.observe(3000, 30)
    assert mix.prefill_share(12.0) == pytest.approx(4000 / (4000 + 12 * 40))
    for _ in range(4):
        mix.observe(100, 100)  # the first two fall out of the window
    assert len(mix) == 4
    assert mix.prefill_share(12.0) == pytest.approx(400 / (400 + 12 * 400))
    mix.observe(-5, -7)  # a broken report counts as nothing, not as negative work
    assert mix.prefill_share(12.0) == pytest.approx(300 / (300 + 12 * 300))


def test_empty_work_and_bad_windows() -> None:
    mix = WorkMix(window=2, min_requests=1)
    mix.observe(0, 0)
    assert mix.prefill_share(12.0) == 0.0
    for window, least in ((0, 1), (5, 0), (5, 6)):
        with pytest.raises(ValueError, match="min_requests"):
            WorkMix(window, least)


def test_decode_token_cost_from_the_cost_profile() -> None:
    # A decode step of 64 requests (50.2 ms) per request over a 2,048-token prefill (136.8 ms) per token.
    assert get_profile("l70-h100").decode_token_cost(64) == pytest.approx((50.2 / 64) / (136.8 / 2048))
    assert get_profile("l70-a100").decode_token_cost(64) < get_profile("l70-h100").decode_token_cost(64)


def test_conv_like_traffic_keeps_the_lanes_and_prompt_heavy_traffic_does_not() -> None:
    k = get_profile("l70-h100").decode_token_cost(64)
    chat, code = WorkMix(), WorkMix()
    for _ in range(200):
        chat.observe(1020, 129)  # Azure conv's medians
        code.observe(1469, 13)  # Azure code's medians
    config = lanes_slot_config(64)
    assert chat.prefill_share(k) < 0.5 < PREFILL_HEAVY_SHARE < code.prefill_share(k)
    assert not prefill_heavy(chat.prefill_share(k), config) and prefill_heavy(code.prefill_share(k), config)


def test_prefill_heavy_lanes_pop_oldest_first_with_open_slots() -> None:
    config = SlotConfig(max_slots=8, max_long=1, max_medium_long=2, fcfs_above_prefill_share=0.6)
    running = {Lane.LONG: 1, Lane.MEDIUM: 1}  # the long and medium caps are both reached
    ages = {Lane.SHORT: 20_000.0, Lane.LONG: 90_000.0, Lane.MEDIUM: 50_000.0}
    assert lanes_to_pop(running, ages, config, prefill_share=0.5) == (Lane.SHORT,)
    assert lanes_to_pop(running, ages, config, prefill_share=0.6) == (Lane.LONG, Lane.MEDIUM, Lane.SHORT)
    assert lanes_to_pop({Lane.LONG: 8}, ages, config, prefill_share=0.9) == (), "full is full"
    # The default SlotConfig never steps aside; a negative bound is refused.
    assert lanes_to_pop(running, ages, SlotConfig(max_slots=8, max_long=1, max_medium_long=2), 1.0) == (Lane.SHORT,)
    with pytest.raises(ValueError, match="fcfs_above_prefill_share"):
        SlotConfig(fcfs_above_prefill_share=-0.1)
    with pytest.raises(ValueError, match="fcfs_above_prefill_share"):
        SlotConfig(fcfs_above_prefill_share=math.nan)


def test_worker_settings_reach_the_slot_config() -> None:
    assert WorkerSettings(max_slots=8).slots(8).fcfs_above_prefill_share == PREFILL_HEAVY_SHARE
    assert WorkerSettings(max_slots=8, fcfs_above_prefill_share=1.0).slots(8).fcfs_above_prefill_share == 1.0
    for bad in (0, math.inf, math.nan):  # inf would silently mean "never step aside"
        with pytest.raises(ValueError, match="decode_token_cost"):
            WorkerSettings(decode_token_cost=bad)
    with pytest.raises(ValueError, match="fcfs_above_prefill_share"):
        WorkerSettings(fcfs_above_prefill_share=math.inf)
