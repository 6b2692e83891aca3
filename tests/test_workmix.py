"""The prefill share of an engine's work (``scheduler/workmix.py``) and the lanes stepping aside
while prompts dominate (``policy.lanes_to_pop(..., prefill_share)``, ``policy.prefill_heavy``)."""

from __future__ import annotations

import math

import pytest

from lanes.queue.messages import Lane
from lanes.scheduler.costmodel import get_profile
from lanes.scheduler.live_policy import PREFILL_HEAVY_SHARE, lanes_slot_config
from lanes.scheduler.policy import SlotConfig, lanes_to_pop, prefill_heavy
from lanes.scheduler.workmix import MAX_KEY_SHARE, MIN_OTHERS_SHARE, WorkMix, capped_top_weight
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


def test_one_key_flooding_long_prompts_does_not_switch_the_lanes_off_for_everyone() -> None:
    k = 12.0
    mix = WorkMix()
    for i in range(1000):
        if i % 10 == 0:
            mix.observe(1020, 129, f"chat-{i // 10 % 4}")  # 10 % of requests: ordinary chat from four keys
        else:
            mix.observe(8000, 1, "flood")  # 90 %: long prompts, max_tokens 1, one key
    assert mix.num_keys == 5
    prompt = 900 * 8000 + 100 * 1020
    flood_alone = prompt / (prompt + k * (900 + 100 * 129))
    assert flood_alone > 0.9, "uncapped, the flood would decide"
    # Capped at a quarter of the work, the flood leaves the chat's share (~0.4) in charge.
    chat = 1020 / (1020 + k * 129)
    flood = 8000 / (8000 + k)
    assert mix.prefill_share(k) == pytest.approx(MAX_KEY_SHARE * flood + (1 - MAX_KEY_SHARE) * chat)
    assert mix.prefill_share(k) < PREFILL_HEAVY_SHARE
    # max_key_share=1 is the cap off: the share as before this rule.
    uncapped = WorkMix(max_key_share=1.0)
    for i in range(1000):
        uncapped.observe(*((1020, 129, "chat") if i % 10 == 0 else (8000, 1, "flood")))
    assert uncapped.prefill_share(k) == pytest.approx(flood_alone)


def test_prompt_heavy_traffic_across_keys_still_steps_aside_and_one_key_is_unchanged() -> None:
    k = 12.0
    spread, single = WorkMix(), WorkMix()
    for i in range(1000):
        spread.observe(1469, 13, f"key-{i % 7}")  # Azure code's medians from seven clients
        single.observe(1469, 13)  # the same without auth (one key, "")
    expected = 1469 / (1469 + k * 13)
    assert spread.prefill_share(k) == pytest.approx(expected) == single.prefill_share(k)
    assert spread.prefill_share(k) >= PREFILL_HEAVY_SHARE
    # The window forgets keys that left it.
    for _ in range(1000):
        spread.observe(1020, 129, "chat")
    assert spread.num_keys == 1
    assert spread.prefill_share(k) == pytest.approx(1020 / (1020 + k * 129))


def test_a_few_stray_requests_of_another_key_do_not_speak_for_the_window() -> None:
    """One tenant sending code completions, plus a health check under its own key: the stray key
    holds under MIN_OTHERS_SHARE of the requests, so the tenant's work counts in full."""
    k = 12.0
    mix = WorkMix()
    for i in range(1000):
        mix.observe(*((20, 100, "health") if i % 100 == 0 else (1469, 13, "tenant")))
    assert mix.num_keys == 2 and 10 < MIN_OTHERS_SHARE * 1000
    prompt = 990 * 1469 + 10 * 20
    assert mix.prefill_share(k) == pytest.approx(prompt / (prompt + k * (990 * 13 + 10 * 100)))
    assert mix.prefill_share(k) >= PREFILL_HEAVY_SHARE, "the prompt-heavy tenant still steps aside"


def test_two_keys_one_flooding_the_other_chatting() -> None:
    k = 12.0
    mix = WorkMix()
    for i in range(1000):
        mix.observe(*((1020, 129, "chat") if i % 5 == 0 else (8000, 1, "flood")))  # chat: 20 % of requests
    chat, flood = 1020 / (1020 + k * 129), 8000 / (8000 + k)
    assert mix.prefill_share(k) == pytest.approx(MAX_KEY_SHARE * flood + (1 - MAX_KEY_SHARE) * chat)
    assert mix.prefill_share(k) < PREFILL_HEAVY_SHARE


def test_capped_top_weight() -> None:
    assert capped_top_weight(90.0, 10.0, 0.25) == pytest.approx((10.0 / 3) / 90.0)  # 90 -> 3.33: a quarter of 13.33
    assert capped_top_weight(3.0, 10.0, 0.25) == 1.0, "already under a quarter"
    assert capped_top_weight(90.0, 10.0, 1.0) == 1.0 and capped_top_weight(0.0, 10.0, 0.25) == 1.0
    assert capped_top_weight(90.0, 0.0, 0.25) == 1.0, "no other work: nothing to weigh against"
    with pytest.raises(ValueError, match="max_key_share"):
        WorkMix(max_key_share=0.0)


def test_worker_setting_for_the_key_cap() -> None:
    assert WorkerSettings().prefill_share_max_key_share == MAX_KEY_SHARE == 0.25
    for bad in (0, 1.5, math.nan):
        with pytest.raises(ValueError, match="prefill_share_max_key_share"):
            WorkerSettings(prefill_share_max_key_share=bad)
