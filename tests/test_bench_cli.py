"""`lanes bench policy` as a user runs it: a trace file, a prompt file, JSON out."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_support import write_prompts, write_trace


def lanes(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lanes.cli.main", *args], capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "COLUMNS": "250"})


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    return write_trace(tmp_path / "trace.csv", 300, 0.2, 100, 4.5), write_prompts(tmp_path / "prompts.json")


def test_bench_policy_with_prompts_prints_the_json_shape(files: tuple[Path, Path]) -> None:
    trace, prompts = files
    out = lanes("bench", "policy", "--trace", str(trace), "--prompts", str(prompts), "--json",
                "--policy", "fcfs,lanes,priority,mlfq")
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    assert list(results) == ["fcfs", "lanes", "priority", "mlfq"]
    for name, r in results.items():
        assert r["throughput_rps"] > 0
        for group in ("short", "long"):
            for key in ("ttft_s_p50", "ttft_s_p99", "e2e_s_p50", "e2e_s_p99",
                        "ttft_within_1s", "ttft_within_5s", "ttft_within_30s"):
                assert isinstance(r[group][key], float), (name, group, key)
            assert 0.0 <= r[group]["ttft_within_1s"] <= r[group]["ttft_within_30s"] <= 1.0
    # Prompts are rank-paired with the rows, so the realised tau is the predictor's on this pool.
    assert -1.0 <= results["lanes"]["predictor_tau"] <= 1.0
    assert results["lanes"]["predictor_tau"] == results["priority"]["predictor_tau"]
    assert results["fcfs"]["predictor_tau"] is None and results["mlfq"]["predictor_tau"] is None
    # The lanes report the engine's prefill share and how often it made them step aside.
    assert 0.0 < results["lanes"]["prefill_share"] < 1.0
    assert 0.0 <= results["lanes"]["prefill_heavy_pop_share"] <= 1.0
    assert "prefill_share" not in results["fcfs"]


def test_bench_policy_table_and_bad_prompt_files(files: tuple[Path, Path], tmp_path: Path) -> None:
    trace, prompts = files
    out = lanes("bench", "policy", "--trace", str(trace), "--prompts", str(prompts), "--predictor", "random")
    assert out.returncode == 0, out.stderr
    assert "realised tau" in out.stdout and "lanes" in out.stdout
    assert "lanes stepped aside (FCFS) for" in out.stdout and "--fcfs-above-prefill-share 0.6" in out.stdout
    missing = lanes("bench", "policy", "--trace", str(trace), "--prompts", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "--prompts" in missing.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"text": "no prompt field"}]))
    malformed = lanes("bench", "policy", "--trace", str(trace), "--prompts", str(bad))
    assert malformed.returncode == 2 and "output_tokens" in malformed.stderr
    unknown = lanes("bench", "policy", "--trace", str(trace), "--predictor", "psychic")
    assert unknown.returncode == 2 and "--predictor" in unknown.stderr


def test_bench_policy_min_long_share_reaches_the_tuning_and_is_checked(files: tuple[Path, Path]) -> None:
    from lanes.cli.bench import _tuning

    assert _tuning(None, None, None, None, 0.2).min_long_share == 0.2
    assert _tuning(None, None, None, None).min_long_share == 0.1
    assert _tuning(None, None, None, None, max_wait_s=30).max_wait_ms == 30_000
    assert _tuning(None, None, None, None, max_wait_s=0).max_wait_ms == float("inf")
    assert _tuning(None, None, None, None, fcfs_above_prefill_share=1.0).fcfs_above_prefill_share == 1.0
    assert _tuning(None, None, None, None).fcfs_above_prefill_share == 0.6
    # The FCFS-below bound is the workers' default for the engine modelled, unless given.
    assert _tuning(None, None, None, None).fcfs_below_ms == 8000.0
    assert _tuning(None, None, None, None, chunked_prefill=True).fcfs_below_ms == 4000.0
    assert _tuning(None, 6.0, None, None, chunked_prefill=True).fcfs_below_ms == 6000.0
    assert _tuning(None, None, None, None, max_medium_long_share=1.0).max_medium_long_share == 1.0
    trace, prompts = files
    bad = lanes("bench", "policy", "--trace", str(trace), "--prompts", str(prompts), "--min-long-share", "2")
    assert bad.returncode == 2 and "--min-long-share" in bad.stderr and "[0, 1]" in bad.stderr


def test_bench_policy_refuses_what_it_cannot_run_in_one_line(files: tuple[Path, Path]) -> None:
    """Each of these ended in a traceback (a one-row slice; a lane no slot, share or wait bound
    could ever serve: "backlog can never be popped" mid-run), or ran on meaning something else
    (--max-wait-s nan: no bound)."""
    trace, prompts = files
    for args, hint in ((["--requests", "1"], "--requests"),
                       (["--max-medium-long-share", "0", "--max-wait-s", "0"], "could never run"),
                       (["--max-wait-s", "nan"], "--max-wait-s")):
        out = lanes("bench", "policy", "--trace", str(trace), "--prompts", str(prompts), *args)
        assert out.returncode == 2 and hint in out.stderr and "Traceback" not in out.stderr, (args, out.stderr[-2000:])


def test_bench_policy_with_a_fixed_predictor_time_repeats_exactly(files: tuple[Path, Path]) -> None:
    trace, prompts = files
    args = ("bench", "policy", "--trace", str(trace), "--prompts", str(prompts), "--json", "--policy", "fcfs,lanes",
            "--predictor-ms", "1.5")
    first, second = lanes(*args), lanes(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout) == json.loads(second.stdout)


def test_bench_policy_with_the_refresh_in_the_loop(files: tuple[Path, Path], tmp_path: Path) -> None:
    trace, _ = files
    # A data set with sources: the refresh learns the "chat" source's prompts; "other" is filtered out.
    prompts = tmp_path / "prompts.json"
    rows = [{"prompt": f"Write a detailed essay about topic {i}.", "output_tokens": 900, "source": "chat"}
            for i in range(40)]
    rows += [{"prompt": f"Say yes or no, case {i}.", "output_tokens": 3, "source": "chat"} for i in range(40)]
    rows += [{"prompt": "Say hi.", "output_tokens": 3, "source": "other"}]
    prompts.write_text(json.dumps(rows))
    base = ("bench", "policy", "--trace", str(trace), "--prompts", str(prompts), "--json", "--policy", "fcfs,lanes",
            "--refresh-every-s", "5", "--predictor-ms", "0.5")
    crossed = lanes(*base, "--prompt-source", "chat")
    assert crossed.returncode == 0, crossed.stderr
    crossed_info = json.loads(crossed.stdout)["lanes"]["predictor"]
    assert crossed_info["refresh_folds"] == 2 and crossed_info["refreshes"] >= 2, crossed_info
    assert crossed_info["seen_prompt_share"] == 0.0, "cross-fitted: no row is predicted by a model that saw its prompt"
    # One refit on the whole window (the live scheduler's), which recalls the reused prompts.
    out = lanes(*base, "--prompt-source", "chat", "--refresh-folds", "1")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)["lanes"]["predictor"]
    assert info["source"] == "shipped+refresh" and info["refreshes"] >= 4, info
    assert 0.0 < info["seen_prompt_share"] <= 1.0, "80 prompts over 300 rows: a refit has seen most of them"
    assert info["refresh_window"] == 10_000 and info["most_observations_per_refit"] > 60, info
    assert info["max_window_short_to_long"] == 0.025, info
    small = lanes(*base, "--prompt-source", "chat", "--refresh-folds", "1", "--refresh-window", "60",
                  "--max-window-short-to-long", "1")
    assert small.returncode == 0, small.stderr
    small_info = json.loads(small.stdout)["lanes"]["predictor"]
    assert small_info["most_observations_per_refit"] == 60 and small_info["max_window_short_to_long"] == 1.0
    two = lanes(*base, "--prompt-source", "other,chat", "--refresh-folds", "1")
    assert two.returncode == 0, two.stderr  # the first half of the rows gets "other"'s one prompt, the rest "chat"'s
    assert json.loads(two.stdout)["lanes"]["predictor"]["refreshes"] == info["refreshes"], "the same trace"
    blind = lanes("bench", "policy", "--trace", str(trace), "--prompts", str(prompts), "--prompt-source", "chat",
                  "--json", "--policy", "fcfs,lanes", "--refresh-every-s", "10", "--predictor", "random")
    assert blind.returncode == 0, blind.stderr
    assert json.loads(blind.stdout)["lanes"]["predictor"]["source"] == "random+refresh"
    for bad_args, hint in ((("--predictor", "noise", "--refresh-every-s", "10"), "--refresh-every-s"),
                           (("--prompt-source", "nope"), "--prompt-source"),
                           (("--weights", str(prompts)), "--weights"),
                           (("--refresh-every-s", "10", "--refresh-folds", "0"), "--refresh-folds")):
        bad = lanes("bench", "policy", "--trace", str(trace), "--prompts", str(prompts), *bad_args)
        assert bad.returncode == 2 and hint in bad.stderr, (bad_args, bad.stderr)


def test_prompt_sources_in_sequence_pair_each_part_of_the_trace_with_its_source(tmp_path: Path) -> None:
    import numpy as np
    from lanes.cli.bench import _pool_predictions
    from lanes.scheduler.predictor import load_default

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"prompt": f"a{i}", "output_tokens": i, "source": "a"} for i in range(1, 5)] +
                                  [{"prompt": f"b{i}", "output_tokens": i, "source": "b"} for i in range(1, 5)]))
    true = np.array([4, 1, 3, 2, 40, 10, 30, 20])
    predictions, row_prompts = _pool_predictions(prompts, true, load_default(), "a,b")
    assert row_prompts == ["a4", "a1", "a3", "a2", "b4", "b1", "b3", "b2"], "rank-paired within each half"
    assert len(predictions.tokens) == 8 and np.isfinite(predictions.latency_ms).all()


def test_bench_policy_reads_mooncake_and_burstgpt_traces_and_slices_them(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    rows = [(round(i * 150 + rng.integers(0, 100)), int(rng.integers(100, 4000)), int(rng.lognormal(4.5, 1.0)) + 1)
            for i in range(400)]
    mooncake = tmp_path / "conversation_trace.jsonl"
    mooncake.write_text("".join(json.dumps({"timestamp": t, "input_length": p, "output_length": o, "hash_ids": [0]})
                                + "\n" for t, p, o in rows))
    out = lanes("bench", "policy", "--trace", str(mooncake), "--start", "100", "--requests", "250",
                "--predictor", "noise", "--policy", "fcfs,lanes", "--json")
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    assert results["fcfs"]["all"]["num_requests"] == 250 and results["lanes"]["all"]["num_requests"] == 250
    burst = tmp_path / "BurstGPT_1.csv"
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "".join(
        f"{t / 1000},ChatGPT,{p},{0 if i % 50 == 0 else o},{p + o},Conversation log\n" for i, (t, p, o) in enumerate(rows)))
    out = lanes("bench", "policy", "--trace", str(burst), "--predictor", "noise", "--policy", "fcfs", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["fcfs"]["all"]["num_requests"] == 392
    assert "burstgpt trace, 8 failed requests (0 response tokens) left out" in out.stderr
    too_far = lanes("bench", "policy", "--trace", str(mooncake), "--start", "300", "--requests", "200")
    assert too_far.returncode == 2 and "the trace has 400 rows" in too_far.stderr, too_far.stderr
    tied = tmp_path / "tied.jsonl"  # whole-second timestamps, as most of Mooncake's
    tied.write_text("".join(json.dumps({"timestamp": t // 1000 * 1000, "input_length": p, "output_length": o})
                            + "\n" for t, p, o in rows))
    out = lanes("bench", "policy", "--trace", str(tied), "--predictor", "noise", "--policy", "fcfs", "--json",
                "--chunked-prefill-tokens", "2048")
    assert out.returncode == 0, out.stderr
    assert "340 requests shared their timestamp with an earlier one" in out.stderr, out.stderr
    small = lanes("bench", "policy", "--trace", str(tied), "--chunked-prefill-tokens", "64")
    assert small.returncode == 2 and "more than max_num_seqs (64)" in small.stderr, small.stderr


@pytest.mark.parametrize("chunked_tokens", [2048, 0])
def test_bench_live_gives_the_workers_the_simulators_engine(tmp_path: Path, chunked_tokens: int) -> None:
    """``lanes bench live`` configures the sim workers as the simulator beside them: chunked
    prefill at 2,048 tokens a step with the 4 s FCFS-below bound, or (0) v0's prefill-or-decode
    steps at 8,192 prompt tokens with 8 s; every time bound divided by the time scale."""
    from bench_support import PROMPTS
    from lanes.bench.live import engine_config, live_env, plan
    from lanes.scheduler.sim.trace import Trace

    rng = np.random.default_rng(0)
    trace = Trace(np.arange(200) * 0.3, rng.integers(50, 1500, 200).astype(float),
                  np.exp(rng.normal(4.0, 1.0, 200)).round().clip(1, 4000))
    pool = [p["prompt"] for p in PROMPTS]
    tokens = np.array([p["output_tokens"] for p in PROMPTS], float)

    def predict(messages: object, max_tokens: int) -> int:  # a fixed-rule predictor: prompt length
        return min(max_tokens, 10 * len(messages[0].content))  # type: ignore[index]

    p = plan(trace, pool, tokens, predict, engine=engine_config("l70-h100", 4, chunked_tokens), workers=2, load=0.9)
    assert p.engine.chunked_prefill_tokens == chunked_tokens
    _, _, worker = live_env(p, "lanes", time_scale=2.0)
    assert worker["LANES_SIM_CHUNKED_PREFILL"] == ("true" if chunked_tokens else "false")
    assert worker["LANES_MAX_NUM_BATCHED_TOKENS"] == str(chunked_tokens or 8192)
    assert float(worker["LANES_FCFS_BELOW_MS"]) == (4000.0 if chunked_tokens else 8000.0) / 2.0
    # A worker started with them takes them (it refuses slot counts that do not fit each other).
    from lanes.workers.settings import WorkerSettings

    WorkerSettings(_env_file=None, max_slots=p.engine.max_num_seqs,
                   **{name.removeprefix("LANES_").lower(): value for name, value in worker.items()})


def _strict(text: str) -> object:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in the JSON")

    return json.loads(text, parse_constant=refuse)


def test_live_benchmarks_write_json_without_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench live / overhead / fanout / ...`` JSON goes through ``cli.jsonout``: NaN -> null."""
    from lanes.bench.common import write_json

    result = {"sim_gap": float("nan"), "gain": {"live": np.float64("inf")}, "rows": [1.5, float("-inf")]}
    write_json(tmp_path / "out.json", result)
    assert _strict((tmp_path / "out.json").read_text()) == {"sim_gap": None, "gain": {"live": None},
                                                             "rows": [1.5, None]}
    write_json(None, result)
    assert _strict(capsys.readouterr().out)["sim_gap"] is None


def test_bench_live_metrics_give_an_empty_class_null_figures() -> None:
    """The two largest answers tie, so none is above the p90: the long class is empty (it raised
    IndexError), and gets the keys with None, as ``bench policy``'s classes do."""
    from lanes.bench.live import metrics, short_p99_gain
    from lanes.cli.bench import _ms

    tokens = np.array([1, 2, 3, 4, 5, 6, 7, 8, 100, 100], dtype=float)
    arrival = np.arange(10, dtype=float)
    out = metrics(arrival, arrival + 0.5, arrival + 2.0, tokens)
    assert out["long"] == {"num_requests": 0, "ttft_ms_p50": None, "ttft_ms_p99": None,
                           "throughput_rps": out["all"]["throughput_rps"], "e2e_ms_p99": None}
    assert out["short"]["num_requests"] == 5 and out["all"]["ttft_ms_p99"] == pytest.approx(500.0)
    assert math.isnan(short_p99_gain({"fcfs": out, "lanes": out}, "long"))
    assert short_p99_gain({"fcfs": out, "lanes": out}, "short") == pytest.approx(1.0)
    assert _ms(out["long"]["ttft_ms_p99"]) == "-"


def _live_checks(**changed: object) -> dict[str, object]:
    checks = {"num_requests": 40, "num_done": 40, "not_done": 0, "errors": {}, "gaps": 0, "wrong_length": 0,
              "lanes": {"short": 30, "long": 10}, "predictions_differing_from_sim": 0, "crashed": []}
    return {"checks": checks | changed}


def test_bench_live_fails_on_a_crash_or_a_wrong_length_and_warns_on_predictions() -> None:
    from lanes.bench.live import verdict

    names = ("fcfs", "lanes")
    assert verdict({"fcfs": _live_checks(), "lanes": _live_checks()}, names) == ([], [])
    failed, warned = verdict({"fcfs": _live_checks(crashed=["w0"]), "lanes": _live_checks(wrong_length=3)}, names)
    assert failed == ["fcfs: crashed: w0", "lanes: 3 answers of the wrong length"] and warned == []
    failed, _ = verdict({"fcfs": _live_checks(not_done=2, gaps=1), "lanes": _live_checks()}, names)
    assert failed == ["fcfs: 2 of 40 requests did not end with done", "fcfs: 1 gaps in the streams"]
    # The docs require done, gap-free, the row's length: differing predictions only warn.
    failed, warned = verdict({"fcfs": _live_checks(), "lanes": _live_checks(predictions_differing_from_sim=4)}, names)
    assert failed == [] and warned == ["lanes: 4 live predictions differ from the simulator's"]


def test_bench_live_checks_the_plot_path_before_the_runs(files: tuple[Path, Path], tmp_path: Path) -> None:
    trace, prompts = files
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    out = lanes("bench", "live", "--trace", str(trace), "--prompts", str(prompts), "--requests", "10",
                "--plot", str(not_a_dir / "live.png"))
    assert out.returncode == 2 and "--plot" in out.stderr and "slice rows" not in out.stderr, out.stderr


def test_bench_live_waits_for_the_last_answers_in_trace_time() -> None:
    """After the last arrival the replay waits 240 s of trace time (120 s wall at the default time
    scale 2): a slower replay (time scale 0.1) waits 2,400 s, not a fixed 120."""
    from lanes.bench.live import drain_wall_s

    assert drain_wall_s(2.0) == 120.0 and drain_wall_s(0.1) == pytest.approx(2400.0)
    assert drain_wall_s(200.0) == 120.0, "at least 120 s of wall time"


def test_bench_policy_names_its_prompt_pool_and_whether_the_weights_saw_it(tmp_path: Path) -> None:
    """The table and the JSON name the prompt file the predictions came from and how many of its
    prompts the weights were trained on (none for the default held-out pool; most for AlpacaEval
    answers, whose tau is then optimistic). Before, neither said which pool was used."""
    from lanes.scheduler.predictor.data import DEFAULT_DATASET_PATH, read_examples

    trace = write_trace(tmp_path / "trace.csv", 300, 0.2, 100, 4.5)
    base = ("bench", "policy", "--trace", str(trace), "--policy", "fcfs,lanes", "--refresh-every-s", "0")
    out = lanes(*base)
    assert out.returncode == 0, out.stderr
    assert "prompts " in out.stdout and "prompt_pool.json: 1,504 rows, 188 distinct prompts (alpaca_eval/oasst); " \
        "none of them in the shipped weights' training data" in out.stdout
    trained = [e for e in read_examples(DEFAULT_DATASET_PATH) if e.source == "code_alpaca"][:40]
    seen = tmp_path / "seen.json"
    seen.write_text(json.dumps([{"prompt": e.prompt, "output_tokens": e.output_tokens} for e in trained]))
    out = lanes(*base, "--prompts", str(seen), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)["lanes"]["predictor"]
    assert info["prompts"] == str(seen) and info["prompts_in_training_data"] == 40 and info["distinct_prompts"] == 40
    assert "so the predictor's tau here is optimistic" in info["prompts_description"]


def test_bench_tables_never_cut_a_figure_short() -> None:
    """``bench fanout``'s 12 columns printed "844…" for 84,452 tokens/s on an 80-column terminal
    (and in a pipe or a file, which Rich gives 80 columns): a table wider than the console is now
    printed turned, one line per column, every figure whole; one that fits is unchanged."""
    import io

    from lanes.bench.common import print_table
    from rich.console import Console

    columns = ["in flight", "tokens/s", "server CPU ms/1k", "edge", "workers", "redis", "client (load)", "gaps",
               "done", "not done", "clients closed", "crashed"]
    rows = [[16, 84452, 20.6, 4.3, 12.8, 3.4, 1.4, 0, 64, 0, 0, "-"], [256, 123456, 19.9, 4.1, 12.5, 3.3, 1.3, 0, 9, 0, 0, "-"]]
    narrow = io.StringIO()
    print_table("Token fan-out", columns, rows, Console(file=narrow, width=80))
    text = narrow.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert "84452" in text and "123456" in text and "server CPU ms/1k" in text and "clients closed" in text
    wide = io.StringIO()
    print_table("Token fan-out", columns, rows, Console(file=wide, width=250))
    header = next(line for line in wide.getvalue().splitlines() if "in flight" in line)
    assert "tokens/s" in header and "crashed" in header, "a table that fits keeps one line per row"
    # `bench background`'s table: its figures fit side by side in 80 columns once the headers
    # wrap (it printed "medium:…" before); it keeps one line per row.
    background = io.StringIO()
    print_table("Short TTFT (ms)", ["policy", "p50", "p99", "max", "done", "short lanes", "long lanes", "long running"],
                [["fcfs", 7792.6, 9603.6, 9641.5, "40/40", "medium:40", "medium:24", "8/6"],
                 ["lanes", 8.9, 13.4, 14.2, "40/40", "short:40", "long:24", "6/6"]], Console(file=background, width=80))
    text = background.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert any("fcfs" in line and "medium:40" in line and "medium:24" in line for line in text.splitlines())
    # `bench overhead`'s: its labels wrap so that its figures keep their room (it printed "21.…").
    overhead = io.StringIO()
    print_table("Added latency", ["ms", "sim p50", "sim p99", "hf p50", "hf p99"],
                [["baseline TTFT (engine in-process)", "1.21", "4.55", "9.78", "21.43"],
                 ["overhead, per-round paired (client - baseline)", "3.65", "9.45", "5.12", "20.77"]],
                Console(file=overhead, width=80))
    text = overhead.getvalue()
    assert "…" not in text and "21.43" in text and "20.77" in text and max(len(x) for x in text.splitlines()) <= 80


def test_bench_policy_table_says_what_its_classes_and_policies_are(files: tuple[Path, Path]) -> None:
    """The table's "short" and "long" are classes of the true answer length (the rows' median and
    p90), which neither the table nor --help said; --help now says what priority and mlfq are."""
    trace, prompts = files
    out = lanes("bench", "policy", "--trace", str(trace), "--prompts", str(prompts), "--refresh-every-s", "0",
                "--policy", "fcfs,lanes,priority,mlfq")
    assert out.returncode == 0, out.stderr
    true = np.loadtxt(trace, delimiter=",", skiprows=1, usecols=2)
    line = next(x for x in out.stdout.splitlines() if x.startswith("classes by true answer length"))
    assert f"short <= {np.percentile(true, 50):.0f} tokens" in line and f"long > {np.percentile(true, 90):.0f}" in line
    assert [x.split()[0] for x in out.stdout.splitlines()[-5:-1]] == ["fcfs", "lanes", "priority", "mlfq"]
    helped = " ".join(lanes("bench", "policy", "--help").stdout.replace("│", " ").split())
    assert "priority (shortest predicted first" in helped and "mlfq (FastServe's skip-join MLFQ" in helped
