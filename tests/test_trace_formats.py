"""The simulator reads three public trace formats (Azure, BurstGPT, Mooncake) into the same requests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from lanes.scheduler.sim.trace import TRACE_FORMATS, load_trace, spread_ties

#: (seconds after the first request, prompt tokens, output tokens); two requests share 1.5 s
ROWS = [(0.0, 812, 130), (0.25, 40, 7), (1.5, 2048, 611), (1.5, 95, 1), (7.125, 300, 88)]
#: What the simulator gets: the second of the tied pair halfway to the next timestamp.
ARRIVALS = [0.0, 0.25, 1.5, 4.3125, 7.125]


def azure(path: Path) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{s:09.6f}0,{p},{o}" for s, p, o in ROWS]
    path.write_text("\n".join(lines) + "\n")
    return path


def burstgpt(path: Path) -> Path:
    """Newer BurstGPT releases carry more columns; a failed request (0 response tokens) and rows
    out of order are in the file too."""
    lines = ["Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    rows = [(3600 + s, p, o) for s, p, o in ROWS]
    rows.insert(2, (3600.5, 77, 0))
    rows[0], rows[1] = rows[1], rows[0]
    lines += [f"{s},,1.0,ChatGPT,{p},{o},{p + o},Conversation log" for s, p, o in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def mooncake(path: Path) -> Path:
    lines = [json.dumps({"timestamp": round(1000 * s) + 500, "input_length": p, "output_length": o,
                         "hash_ids": list(range(p // 512 + 1))}) for s, p, o in ROWS]
    path.write_text("\n".join(lines) + "\n\n")
    return path


@pytest.mark.parametrize("write,fmt,skipped", [(azure, "azure", 0), (burstgpt, "burstgpt", 1),
                                               (mooncake, "mooncake", 0)])
def test_each_format_gives_the_same_requests(tmp_path: Path, write, fmt: str, skipped: int) -> None:
    loaded = load_trace(write(tmp_path / "trace"))
    assert (loaded.format, loaded.skipped, loaded.spread) == (fmt, skipped, 1)
    trace = loaded.trace
    assert np.allclose(trace.arrival_s, ARRIVALS, atol=1e-6), "relative to the first, in order, ties spread"
    assert trace.prompt_tokens.tolist() == [p for _, p, _ in ROWS]
    assert trace.output_tokens.tolist() == [o for _, _, o in ROWS]


def test_requests_logged_at_the_same_instant_are_spread_to_the_next_timestamp() -> None:
    """Coarse timestamps (Mooncake's whole seconds) would make each second's requests one burst."""
    spread = spread_ties(np.array([0.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0]))
    assert np.allclose(spread, [0.0, 1 / 3, 2 / 3, 1.0, 3.0, 3.375, 3.75, 4.125])  # the last over the median gap, 1.5 s
    untouched = np.array([0.0, 0.1, 0.7, 2.0])
    assert spread_ties(untouched) is untouched, "traces without ties (Azure's) are left exactly as they are"
    assert spread_ties(np.array([4.0, 4.0])).tolist() == [4.0, 4.0], "one instant only: nothing to spread over"


#: BurstGPT's CSV header.
CSV = "Timestamp,Model,Request tokens,Response tokens\n"


def row(timestamp: object, input_length: object, output_length: object = None) -> str:
    """One line of a Mooncake trace, each value written as given (``output_length`` None: left out)."""
    fields = {"timestamp": timestamp, "input_length": input_length}
    if output_length is not None:
        fields["output_length"] = output_length
    return ", ".join(f'"{key}": {value}' for key, value in fields.items()).join("{}") + "\n"


def refused(path: Path, text: str, match: str) -> None:
    """``path`` holding ``text`` is refused with a ValueError whose message matches ``match``."""
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_trace(path)


def test_an_unknown_or_malformed_file_names_the_problem(tmp_path: Path) -> None:
    other = tmp_path / "other.csv"
    other.write_text("time,prompt,answer\n0,1,2\n")
    with pytest.raises(ValueError) as unknown:
        load_trace(other)
    assert "not a trace format lanes reads" in str(unknown.value)
    assert all(description in str(unknown.value) for description in TRACE_FORMATS.values())
    refused(tmp_path / "broken.jsonl", row(0, 5, 3) + row(9, 5), r"broken.jsonl, line 2: KeyError\('output_length'\)")
    refused(tmp_path / "bad.csv", CSV + "0,ChatGPT,12,x\n", "bad.csv, line 2")
    refused(tmp_path / "nan.jsonl", row(0, 5, 3) + row("NaN", 5, 3),
            "request 2 has a time that is not a number or a negative token count")
    refused(tmp_path / "failed.csv", CSV + "0,ChatGPT,12,0\n", r"no requests \(1 failed rows without an answer\)")
    # Every row at one time: no rate to scale to a load (the simulator looped forever on NaN
    # arrivals); a length beyond a float's range is a bad value, not a traceback.
    refused(tmp_path / "burst.jsonl", row(0, 5, 3) * 3, "all 3 request.s. arrive at one time")
    refused(tmp_path / "huge.csv", CSV + "0,ChatGPT,12,1e400\n1,ChatGPT,12,3\n", "huge.csv, line 2")


def test_a_fractional_token_count_is_refused_naming_its_line_not_cut(tmp_path: Path) -> None:
    """Mooncake's loader took ``int(812.9)``: 812, silently (the CSV readers cut the same way).
    A fraction means the file holds no token counts (averaged, rescaled, another column): the
    simulator would run another workload without a word. Whole numbers written as floats pass."""
    whole = tmp_path / "whole.jsonl"
    whole.write_text(row(0, "812.0", 130) + row(1000, 40, "7.0"))
    trace = load_trace(whole).trace
    assert (trace.prompt_tokens.tolist(), trace.output_tokens.tolist()) == ([812, 40], [130, 7])
    refused(tmp_path / "fractional.jsonl", row(0, 812, 130) + row(1000, 812.9, 130),
            r"^\S*fractional.jsonl, line 2: input_length 812.9 is not a whole number of tokens$")
    refused(tmp_path / "boolean.jsonl", row(0, 5, "true"),
            "boolean.jsonl, line 1: output_length True is not a number of tokens")
    refused(tmp_path / "cut.csv", CSV + "0,ChatGPT,12,3\n1,ChatGPT,12.5,3\n",
            "cut.csv, line 3: Request tokens '12.5' is not a whole number of tokens")
