"""`lanes bench ...` commands."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from lanes.cli import jsonout
from lanes.cli.failures import writable_file
from lanes.queue.messages import REFRESH_WINDOW
from lanes.scheduler.live_policy import MAX_NUM_BATCHED_TOKENS
from lanes.scheduler.policy import RoutingCalibration
from lanes.scheduler.predictor.train import MEMORY_WEIGHT

app = typer.Typer(help="bench commands", no_args_is_help=True)


@app.callback()
def _bench() -> None:
    from lanes.cli.cluster import stop_like_ctrl_c

    stop_like_ctrl_c()  # the live benchmarks start processes: SIGTERM must stop them too

DEFAULT_PLOT_LOADS = "0.5,0.73,0.88,0.95,1.1"
DEFAULT_POLICIES = "fcfs,lanes,priority,mlfq"
#: Prompts with known answer lengths that the shipped predictor was not trained on.
DEFAULT_PROMPT_POOL = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "prompt_pool.json"
#: The public data beside a checkout (``../shared/data``; its READMEs name the public sources).
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DEFAULT_TRACE = SHARED_DATA / "traces" / "AzureLLMInferenceTrace_conv.csv"
PREDICTORS = ("real", "noise", "random", "oracle")


def _loads(text: str) -> list[float]:
    """``--plot-loads``: comma-separated loads, each above 0."""
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated numbers, got {text!r}", param_hint="--plot-loads") from None
    if not loads or min(loads) <= 0:
        raise typer.BadParameter(f"expected loads above 0, got {text!r}", param_hint="--plot-loads")
    return loads


def _fallback_prompts() -> Path:
    return SHARED_DATA / "prompts" / "alpaca_eval_Mistral-7B-Instruct-v0.2.json"


def _prompt_pool_path(prompts: Path | None) -> Path:
    """``--prompts``, else the held-out pool, else the AlpacaEval answers beside the checkout
    (with a warning)."""
    path = prompts or DEFAULT_PROMPT_POOL
    if prompts is None and not path.is_file():
        path = _fallback_prompts()
        typer.echo(f"{DEFAULT_PROMPT_POOL} not found: using {path} (the shipped predictor was trained on these "
                   "prompts, so its tau here is optimistic); pass --prompts FILE", err=True)
    if not path.is_file():
        raise typer.BadParameter(f"prompt file {path} not found", param_hint="--prompts")
    return path


def _load_prompt_pool(prompts: Path | None) -> list[Any]:
    """The prompts with known answer lengths (``_prompt_pool_path``); clear errors for bad files."""
    from lanes.cli.predictor import read_observations

    return read_observations(_prompt_pool_path(prompts), "--prompts")


def prompts_seen_in_training(model: Any, prompts: list[str]) -> int | None:
    """How many of the distinct ``prompts`` the weights of ``model`` were trained on: those in
    the data set its ``info`` names (``data``, ``sources``) under one of its training sources;
    None where the weights do not say what they were trained on (or that data set is absent)."""
    from lanes.scheduler.predictor.data import DEFAULT_DATASET_PATH, read_examples

    info = getattr(model, "info", None) or {}
    sources = info.get("sources")
    if info.get("data") != DEFAULT_DATASET_PATH.name or not isinstance(sources, list) \
            or not DEFAULT_DATASET_PATH.is_file():
        return None
    trained = {e.prompt for e in read_examples(DEFAULT_DATASET_PATH) if e.source in set(sources)}
    return sum(prompt in trained for prompt in set(prompts))


def describe_prompts(path: Path, observations: list[Any], seen: int | None, label: str) -> str:
    """One line naming the prompt pool and whether the weights saw its prompts."""
    distinct = len({o.prompt for o in observations})
    sources = sorted({o.source for o in observations if o.source})
    where = f" ({', '.join(sources[:4])}{', ...' if len(sources) > 4 else ''})" if sources else ""
    if seen is None:
        trained = f"whether the {label} weights were trained on them is not recorded in the weights"
    elif seen == 0:
        trained = f"none of them in the {label} weights' training data"
    else:
        trained = (f"{seen:,} of them in the {label} weights' training data, so the predictor's tau here is "
                   "optimistic")
    return f"prompts {path}: {len(observations):,} rows, {distinct:,} distinct prompts{where}; {trained}"


def _load_trace(trace: Path, start: int = 0, requests: int = 0) -> Any:
    """The trace at ``trace`` (any of ``trace.TRACE_FORMATS``), rows ``[start, start + requests)``
    (``requests`` 0: to the end); a malformed file or slice is a usage error naming what is wrong."""
    from lanes.scheduler.sim.trace import Trace, load_trace

    try:
        loaded = load_trace(trace)
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--trace") from exc
    full = loaded.trace
    if start < 0 or requests < 0 or requests == 1 or start + max(requests, 2) > len(full):
        raise typer.BadParameter(f"the trace has {len(full)} rows; need --start + --requests <= {len(full)} "
                                 "and at least 2 rows", param_hint="--start / --requests")
    end = start + requests if requests else len(full)
    if loaded.skipped:
        typer.echo(f"{trace}: {loaded.format} trace, {loaded.skipped} failed requests (0 response tokens) left out",
                   err=True)
    if loaded.spread:
        typer.echo(f"{trace}: {loaded.spread} requests shared their timestamp with an earlier one (coarse "
                   "timestamps); spread evenly up to the next timestamp", err=True)
    if start == 0 and end == len(full):
        return full
    arrival = full.arrival_s[start:end]
    return Trace(arrival - arrival[0], full.prompt_tokens[start:end], full.output_tokens[start:end])


def _load_predictor(weights: Path | None) -> Any:
    """``--weights``, else the shipped predictor; an unreadable file is a usage error."""
    from lanes.scheduler.predictor import WeightsError, from_weights, load_default

    try:
        return load_default() if weights is None else from_weights(weights)
    except WeightsError as exc:
        raise typer.BadParameter(str(exc), param_hint="--weights") from None


def _pool_predictions(prompts: Path | None, true_tokens: np.ndarray, model: Any, source: str | None = None,
                      label: str = "shipped", pairing_seed: int | None = None) -> tuple[Any, list[str]]:
    """The predictor on each trace row's paired prompt (see ``sim.predictions``; ``pairing_seed``
    breaks ties between equal lengths at random), and the prompts.

    ``source`` ("A" or "A,B,..."): only those sources' prompts; with several, the trace is cut
    into as many consecutive parts, the k-th paired with the k-th source (traffic that changes).
    """
    from lanes.cli.predictor import _require_source
    from lanes.scheduler.sim.noise import kendall_tau
    from lanes.scheduler.sim.policies import SIM_MAX_TOKENS
    from lanes.scheduler.sim.predictions import Predictions, from_pool, pair_prompts, predict_prompts

    from lanes.cli.predictor import read_observations

    path = _prompt_pool_path(prompts)
    observations = read_observations(path, "--prompts")
    sources: list[str | None] = [x.strip() for x in source.split(",")] if source is not None else [None]
    for name in sources:
        if name is not None:
            _require_source(observations, name, path, "--prompt-source")
    used = [o for o in observations if source is None or o.source in sources]
    seen = prompts_seen_in_training(model, [o.prompt for o in used])
    info = {"prompts": str(path), "prompts_in_training_data": seen, "distinct_prompts": len({o.prompt for o in used}),
            "prompts_description": describe_prompts(path, used, seen, label)}
    tokens, latency_ms = np.empty(len(true_tokens)), np.empty(len(true_tokens))
    row_prompts = [""] * len(true_tokens)
    for rows, name in zip(np.array_split(np.arange(len(true_tokens)), len(sources)), sources, strict=True):
        pool = [o for o in observations if name is None or o.source == name]
        paired = pair_prompts(true_tokens[rows], np.array([o.output_tokens for o in pool], dtype=float), pairing_seed)
        part = from_pool(true_tokens[rows], paired, *predict_prompts(model.predict, [o.prompt for o in pool],
                                                                      SIM_MAX_TOKENS))
        tokens[rows], latency_ms[rows] = part.tokens, part.latency_ms
        for row, i in zip(rows, paired, strict=True):
            row_prompts[row] = pool[i].prompt
    return Predictions(tokens, latency_ms, label, kendall_tau(true_tokens, tokens), info=info), row_prompts


def _scheduler_refresh_s() -> float:
    """The live scheduler's refresh period (``LANES_PREDICTOR_REFRESH_MINUTES``' default), in s."""
    from lanes.scheduler.settings import SchedulerSettings

    return 60.0 * SchedulerSettings.model_fields["predictor_refresh_minutes"].default


def _with_refresh(predictions: Any, row_prompts: list[str], arrival_s: np.ndarray, true_tokens: np.ndarray,
                  model: Any, every_s: float, follow_routing: bool, max_short_to_long: float, window: int,
                  max_window_short_to_long: float, folds: int = 2, memory_weight: float = 0.0) -> Any:
    """``predictions`` (their measured latencies kept) with the scheduler's refresh in the loop."""
    from lanes.scheduler.sim.policies import SIM_MAX_TOKENS
    from lanes.scheduler.sim.refresh import RefreshConfig, refreshed_predictions

    config = RefreshConfig(every_s=every_s, follow_routing=follow_routing, window=window, folds=folds,
                           memory_weight=memory_weight,
                           calibration=RoutingCalibration(max_short_to_long=max_short_to_long,
                                                          max_window_short_to_long=max_window_short_to_long))
    refreshed = refreshed_predictions(arrival_s, true_tokens, row_prompts, model, config, SIM_MAX_TOKENS)
    fitted = [r["long_above_tokens"] for r in refreshed.refreshes if r["long_above_tokens"] is not None]
    info = {"refreshes": len(refreshed.refreshes), "refreshes_with_routing": len(fitted), "refresh_window": window,
            "refresh_folds": folds, "refresh_memory_weight": memory_weight,
            "max_window_short_to_long": max_window_short_to_long,
            "most_observations_per_refit": max((int(r["observations"]) for r in refreshed.refreshes), default=0),
            "long_above_tokens_median": float(np.median(fitted)) if fitted else None,
            "predictor_tau_unseen_prompts": refreshed.tau_unseen, "seen_prompt_share": refreshed.seen_share}
    return replace(predictions, tokens=refreshed.tokens, tau=refreshed.tau, routing=refreshed.routing,
                   source=f"{predictions.source}+refresh", info={**predictions.info, **info})


def _known_profile(name: str) -> str:
    from lanes.scheduler.costmodel import get_profile

    try:
        get_profile(name)
    except KeyError as exc:
        raise typer.BadParameter(exc.args[0]) from None
    return name


@app.command("policy")
def policy(
    trace: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="Trace (read in place): an Azure LLM "
                                        "inference CSV, a BurstGPT CSV or a Mooncake JSONL, gzipped or not.")],
    start: Annotated[int, typer.Option(min=0, help="First row of the trace simulated.")] = 0,
    requests: Annotated[int, typer.Option(min=0, help="Rows simulated from --start (0: to the end).")] = 0,
    prompts: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="Prompts with known answer lengths: JSON "
                       "[{prompt, output_tokens}] or AlpacaEval model_outputs.json. Default: "
                       "benchmarks/data/prompt_pool.json.")] = None,
    predictor: Annotated[str, typer.Option(help="real (the shipped predictor on paired prompts), noise "
                         "(true x lognormal at --tau), random (the real outputs shuffled), oracle.")] = "real",
    profile: Annotated[str, typer.Option(callback=_known_profile, help="Cost profile: l70-h100, l70-a100, l7-a100.")] = "l70-h100",
    load: Annotated[float, typer.Option(min=0.01, max=100.0, help="Offered load as a fraction of FCFS capacity.")] = 0.88,
    policy: Annotated[str, typer.Option(help="Comma-separated policies: fcfs, lanes, lanes-static (no demotion "
                                             "or hand-back), priority (shortest predicted first, as vLLM's priority "
                                             "scheduling), mlfq (FastServe's skip-join MLFQ, no predictor), and "
                                             "with true lengths lanes-oracle, oracle-2q, oracle-sjf.")] = DEFAULT_POLICIES,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object keyed by policy.")] = False,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of P99 TTFT vs load here.",
                                              callback=writable_file)] = None,
    plot_loads: Annotated[str, typer.Option(help="Loads swept for --plot.")] = DEFAULT_PLOT_LOADS,
    seed: Annotated[int, typer.Option(help="Seed of the noise / random predictor.")] = 0,
    pairing_seed: Annotated[int | None, typer.Option(help="--predictor real / random: break ties between trace "
                                                     "rows and prompts of equal length at random with this seed "
                                                     "(another pairing just as close; default: in file order).")] = None,
    workers: Annotated[int, typer.Option(min=1, help="Simulated worker instances.")] = 1,
    tau: Annotated[float, typer.Option(min=-1.0, max=1.0, help="--predictor noise: its Kendall tau.")] = 0.52,
    prefix_cache_share: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of a resumed request's prompt the "
                                                      "engine's prefix cache still holds.")] = 0.0,
    chunked_prefill_tokens: Annotated[int, typer.Option(min=0, help="Token budget per engine iteration "
                                                        "(max_num_batched_tokens): every iteration decodes all running "
                                                        "requests and fills the rest with prompt chunks, as vLLM V1 and "
                                                        "TensorRT-LLM's in-flight batching do; 0: prefill and decode "
                                                        "iterations alternate (vLLM v0, gone upstream; the model of "
                                                        "RESULTS.md before stop 33).")] = MAX_NUM_BATCHED_TOKENS,
    max_short_to_long: Annotated[float | None, typer.Option(min=0.0, max=1.0, help="lanes: short requests allowed in the "
                                                           "long lane (routing calibration).")] = None,
    fcfs_below_s: Annotated[float | None, typer.Option(min=0.0, help="lanes: FCFS across lanes while the short "
                                                       "lane has waited less than this (default: the workers' "
                                                       "default for the engine modelled: 4 with chunked prefill, "
                                                       "8 without).")] = None,
    fcfs_above_prefill_share: Annotated[float | None, typer.Option(min=0.0, help="lanes: step aside (FCFS, open "
                                                                   "slots) while the finished requests' estimated "
                                                                   "prefill share of the work is at least this "
                                                                   "(default 0.6; 1: never).")] = None,
    preempt_wait_s: Annotated[float | None, typer.Option(min=0.0, help="lanes: hand-back wait bound.")] = None,
    hand_back_demoted: Annotated[bool | None, typer.Option("--hand-back-demoted/--no-hand-back-demoted",
                                 help="lanes: hand back demoted runs too.")] = None,
    min_long_share: Annotated[float | None, typer.Option(help="lanes: share of the slots the long lane is "
                                                         "guaranteed once it starves (default 0.1).")] = None,
    max_wait_s: Annotated[float | None, typer.Option(help="lanes: a lane whose oldest request has waited this "
                                                     "long is popped first (default 600; 0: no bound).")] = None,
    max_medium_long_share: Annotated[float | None, typer.Option(
        min=0.0, max=1.0, help="lanes: share of the slots medium + long requests may hold; the rest is kept for "
        "the short lane (LANES_MAX_MEDIUM_LONG_SLOTS as a share).")] = None,
    predictor_ms: Annotated[float | None, typer.Option(min=0.0, help="Charge this many ms of predictor time per "
                                                       "request instead of the time measured for its prompt "
                                                       "(runs then repeat exactly).")] = None,
    weights: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="--predictor real/random: "
                                                 "these weights (.npz) instead of the shipped ones.")] = None,
    prompt_source: Annotated[str | None, typer.Option(help="Only this source's prompts of --prompts (a data set "
                                                      "from `lanes predictor build-data`); A,B: the first half "
                                                      "of the trace gets A's prompts, the second B's.")] = None,
    refresh_every_s: Annotated[float | None, typer.Option(min=0.0, help="--predictor real: run the scheduler's predictor "
                                                   "refresh in the loop every this many trace seconds (refit on "
                                                   "finished requests, lane thresholds shipped with it; the live "
                                                   "scheduler's default, LANES_PREDICTOR_REFRESH_MINUTES=5, is 300); "
                                                   "with --predictor random the prompts are dealt to the rows at "
                                                   "random, so the refits learn nothing; 0: off. Default: 300 (the "
                                                   "scheduler's) with --predictor real or random and no --plot, "
                                                   "else 0.")] = None,
    refresh_window: Annotated[int, typer.Option(min=50, help="--refresh-every-s: each refit reads the newest this "
                                                "many finished requests (LANES_PREDICTOR_MAX_OBSERVATIONS).")] = REFRESH_WINDOW,
    max_window_short_to_long: Annotated[float, typer.Option(
        min=0.0, max=1.0, help="--refresh-every-s: each refit's threshold also sends at most this share of the "
        "answers shorter than its whole window's median long (1: off, the rule before stop 23).")] = (
        RoutingCalibration().max_window_short_to_long),
    refresh_folds: Annotated[int, typer.Option(min=1, help="--refresh-every-s: cross-fit the refits by prompt in "
                             "this many folds, so no row is predicted by a model that saw its prompt (a pool smaller "
                             "than the trace is reused); 1: one refit on the whole window, which recalls reused "
                             "prompts' lengths (before stop 29).")] = 2,
    refresh_memory_weight: Annotated[float, typer.Option(
        min=0.0, max=1.0, help="--refresh-every-s: each refit keeps a nearest-neighbour memory of its window and "
        "blends it in with this share (LANES_PREDICTOR_MEMORY_WEIGHT; needs weights whose encoder outputs its "
        "embedding); 0: no memory.")] = MEMORY_WEIGHT,
    refresh_routing: Annotated[str, typer.Option(help="--refresh-every-s: follow (route by the thresholds each "
                                                 "refit ships, the edges' default) or pin (keep the edges' fixed "
                                                 "150 / 750).")] = "follow",
) -> None:
    """Simulate scheduling policies over a trace with a GPU cost model and a real predictor."""
    from lanes.scheduler.costmodel import get_profile
    from lanes.scheduler.sim import predictions as preds
    from lanes.scheduler.sim.engine import EngineConfig
    from lanes.scheduler.sim.policies import POLICY_NAMES
    from lanes.scheduler.sim.run import compare, fcfs_capacity_rps

    names = [n.strip() for n in policy.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown or not names:
        raise typer.BadParameter(f"unknown policies {unknown}; known: {', '.join(POLICY_NAMES)}" if unknown
                                 else f"name one policy at least: {', '.join(POLICY_NAMES)}", param_hint="--policy")
    loads = _loads(plot_loads) if plot is not None else []  # checked before the runs, not after
    if predictor not in PREDICTORS:
        raise typer.BadParameter(f"--predictor must be one of {', '.join(PREDICTORS)}, not {predictor!r}")
    if refresh_every_s is None:  # what the system runs: the scheduler refits every few minutes
        refresh_every_s = _scheduler_refresh_s() if predictor in ("real", "random") and plot is None else 0.0
    if refresh_every_s > 0 and (predictor not in ("real", "random") or plot is not None):
        raise typer.BadParameter("needs --predictor real or random and no --plot (the refresh's timing depends on "
                                 "the load)", param_hint="--refresh-every-s")
    if refresh_routing not in ("follow", "pin"):
        raise typer.BadParameter(f"must be follow or pin, not {refresh_routing!r}", param_hint="--refresh-routing")
    tuning = _tuning(max_short_to_long, fcfs_below_s, preempt_wait_s, hand_back_demoted, min_long_share, max_wait_s,
                     fcfs_above_prefill_share, max_medium_long_share, chunked_prefill=chunked_prefill_tokens > 0)
    try:
        engine = EngineConfig(get_profile(profile), prompt_cached_share=prefix_cache_share,
                              chunked_prefill_tokens=chunked_prefill_tokens)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--chunked-prefill-tokens") from None
    from lanes.scheduler.policy import lanes_never_served
    from lanes.scheduler.sim.policies import lanes_slots

    if never := lanes_never_served(lanes_slots(engine.max_num_seqs, tuning)):  # stopped mid-run before
        raise typer.BadParameter(f"the {' and '.join(lane.value for lane in never)} lane could never run: capped at 0 "
                                 "slots, with no guaranteed share and no wait bound; give it a share of the slots "
                                 "or a wait bound", param_hint="--max-medium-long-share / --max-wait-s")
    requests = _load_trace(trace, start, requests)
    true = requests.output_tokens
    capacity_rps = fcfs_capacity_rps(requests, engine, workers)
    if predictor == "noise":
        predictions = preds.noisy(true, tau, seed)
        if abs(predictions.tau - tau) > 0.05:  # multiplicative noise cannot rank worse than about 0.1
            typer.echo(f"note: the noise model reached tau {predictions.tau:.3f}, not the --tau {tau:g} asked for",
                       err=True)
    elif predictor == "oracle":
        predictions = preds.oracle(true)
    else:
        model = _load_predictor(weights)
        if refresh_every_s > 0 and refresh_memory_weight > 0 and model.encoder is None:
            raise typer.BadParameter(
                f"{weights} has no encoder, and the neighbour memory indexes the encoder's embeddings: set 0, or "
                "use weights trained with the encoder (lanes predictor train without --lexical)",
                param_hint="--refresh-memory-weight")
        predictions, row_prompts = _pool_predictions(prompts, true, model, prompt_source,
                                                     "shipped" if weights is None else weights.name, pairing_seed)
        if refresh_every_s > 0:
            if predictor == "random":  # prompts dealt to rows at random: nothing in a prompt tells its length
                row_prompts = [row_prompts[i] for i in np.random.default_rng(seed).permutation(len(row_prompts))]
                predictions = replace(predictions, source="random")
            arrival_s = requests.time_scaled(load * capacity_rps / requests.rate_rps).arrival_s
            predictions = _with_refresh(predictions, row_prompts, arrival_s, true, model, refresh_every_s,
                                        refresh_routing == "follow", tuning.max_short_to_long, refresh_window,
                                        max_window_short_to_long, refresh_folds, refresh_memory_weight)
        elif predictor == "random":
            predictions = preds.shuffled(predictions, true, seed)
    if predictor_ms is not None:
        predictions = replace(predictions, latency_ms=np.full(len(true), predictor_ms))
    kwargs: dict[str, Any] = dict(num_workers=workers, capacity_rps=capacity_rps, tuning=tuning)
    results = compare(requests, engine, load, names, predictions, **kwargs)
    if as_json:
        typer.echo(jsonout.dumps(results, indent=2))
    else:
        typer.echo(f"FCFS capacity {capacity_rps:.3f} req/s; offered {load:.2f} x = {load * capacity_rps:.3f} req/s; "
                   f"predictor {predictions.source}, realised tau {predictions.tau:.3f}"
                   + (f", refitted every {refresh_every_s:g} s as the scheduler does (--refresh-every-s 0: off)"
                      if refresh_every_s > 0 else ""))
        if "prompts_description" in predictions.info:
            typer.echo(predictions.info["prompts_description"])
        typer.echo(f"classes by true answer length: short <= {np.percentile(true, 50):.0f} tokens (the median "
                   f"of the rows run), long > {np.percentile(true, 90):.0f} (their p90); <=1/5/30 s: share of short requests "
                   "with TTFT within; --json: every figure for short, long and all")
        typer.echo(format_table(results))
        for name, r in results.items():
            if "prefill_share" in r:
                typer.echo(f"{name}: prefill {r['prefill_share']:.0%} of the work at the end; lanes stepped aside "
                           f"(FCFS) for {r['prefill_heavy_pop_share']:.0%} of pops (--fcfs-above-prefill-share "
                           f"{tuning.fcfs_above_prefill_share:g})")
    if plot is not None:
        sweep = {x: results if x == load else compare(requests, engine, x, names, predictions, **kwargs)
                 for x in sorted(set(loads) | {load})}
        title = f"{trace.name}, {profile}, {predictions.source} predictor (tau {predictions.tau:.2f})"
        write_plot(sweep, plot, title)


def _tuning(max_short_to_long: float | None, fcfs_below_s: float | None, preempt_wait_s: float | None,
            hand_back_demoted: bool | None, min_long_share: float | None = None,
            max_wait_s: float | None = None, fcfs_above_prefill_share: float | None = None,
            max_medium_long_share: float | None = None, *, chunked_prefill: bool = False) -> Any:
    """The lanes knobs as given, the rest the workers' defaults (``fcfs_below_ms`` the one for
    an engine that does or does not chunk prefill, as a worker of that engine takes it)."""
    from lanes.scheduler.live_policy import fcfs_below_ms_for, wait_bound_ms
    from lanes.scheduler.sim.policies import LanesTuning

    tuning = LanesTuning(fcfs_below_ms=fcfs_below_ms_for(chunked_prefill))
    if min_long_share is not None:
        if not 0.0 <= min_long_share <= 1.0:
            raise typer.BadParameter(f"must be in [0, 1], got {min_long_share}", param_hint="--min-long-share")
        tuning = replace(tuning, min_long_share=min_long_share)
    if max_wait_s is not None:
        if not max_wait_s >= 0:  # NaN too (it meant no bound, silently)
            raise typer.BadParameter(f"must be >= 0 (0: no bound), got {max_wait_s}", param_hint="--max-wait-s")
        tuning = replace(tuning, max_wait_ms=wait_bound_ms(max_wait_s * 1000.0))
    if max_medium_long_share is not None:
        tuning = replace(tuning, max_medium_long_share=max_medium_long_share)
    if max_short_to_long is not None:
        tuning = replace(tuning, max_short_to_long=max_short_to_long)
    if fcfs_below_s is not None:
        tuning = replace(tuning, fcfs_below_ms=fcfs_below_s * 1000.0)
    if fcfs_above_prefill_share is not None:
        tuning = replace(tuning, fcfs_above_prefill_share=fcfs_above_prefill_share)
    if preempt_wait_s is not None:
        tuning = replace(tuning, preemption=replace(tuning.preemption, wait_bound_ms=preempt_wait_s * 1000.0))
    if hand_back_demoted is not None:
        tuning = replace(tuning, preemption=replace(tuning.preemption, hand_back_demoted=hand_back_demoted))
    return tuning


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """A fixed-width table of the headline metrics, one row per policy."""
    head = (f"{'policy':<13} {'short TTFT p50/p99 s':>21} {'<=1/5/30 s':>14} {'short E2E p99':>13} "
            f"{'long E2E p99':>12} {'mean E2E':>8} {'req/s':>6} {'cap/s':>6} {'max wait':>8} {'starved':>7} "
            f"{'preempt':>7}")
    rows = [head]
    def num(value: float | None, spec: str) -> str:  # a class with no requests has no figures
        return "-" if value is None else format(value, spec)

    for name, r in results.items():
        s, lg, al = r["short"], r["long"], r["all"]
        within = "/".join(num(s[f"ttft_within_{b}s"], ".2f") for b in (1, 5, 30))
        p99_spec = ".2f" if (s["ttft_s_p99"] or 0) < 10 else ".1f"  # never "0.05 / 0.0"
        rows.append(f"{name:<13} {num(s['ttft_s_p50'], '.2f'):>10} / {num(s['ttft_s_p99'], p99_spec):<8} {within:>14} "
                    f"{num(s['e2e_s_p99'], '.1f'):>13} {num(lg['e2e_s_p99'], '.1f'):>12} {al['e2e_s_mean']:>8.1f} "
                    f"{r['throughput_rps']:>6.3f} {num(r.get('capacity_rps'), '.3f'):>6} {al['max_wait_s']:>8.0f} "
                    f"{r.get('num_starved_vs_fcfs', 0):>7} "
                    f"{r['num_preemptions']:>7}")
    return "\n".join(rows)


def write_plot(sweep: dict[float, dict[str, dict[str, Any]]], path: Path, title: str) -> None:
    """P99 TTFT (short and long requests) vs offered load, one line per policy."""
    from lanes.bench.common import figure

    loads = sorted(sweep)
    with figure(path, 2, width=10.0, sharey=True) as (fig, axes):
        for ax, group in zip(axes, ("short", "long"), strict=True):
            for name in sweep[loads[0]]:
                p99 = [sweep[x][name][group]["ttft_s_p99"] for x in loads]
                ax.plot(loads, [float("nan") if v is None else v for v in p99], marker="o", label=name)
            ax.set(title=f"{group} requests", xlabel="offered load (x FCFS capacity)", yscale="log")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("P99 TTFT (s)")
        axes[0].legend()
        fig.suptitle(title)


# -- the live system --------------------------------------------------------------------------

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")]
PlotOption = Annotated[Path | None, typer.Option(help="Write a PNG here.", callback=writable_file)]


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, not {text!r}", param_hint=option) from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"expected positive integers, not {text!r}", param_hint=option)
    return values


def _say_not_valid(failed: list[str], warned: list[str] | None = None) -> None:
    """The table's last lines: what makes the run not valid, then what only needs a warning."""
    for line in failed:
        typer.echo(f"NOT VALID: {line}")
    for line in warned or []:
        typer.echo(f"warning: {line}")


def _fail_if_not_valid(failed: list[str], warned: list[str] | None = None) -> None:
    """On stderr, the warnings and, for a run that is not valid, one line before exit 1."""
    for line in warned or []:
        typer.echo(f"warning: {line}", err=True)
    if failed:
        typer.echo(f"the run is not valid: {'; '.join(failed)}", err=True)
        raise typer.Exit(1)


def _emit(result: dict[str, Any], as_json: bool, table: Any) -> None:
    from lanes.bench.common import write_json

    if as_json:
        write_json(None, result)
    else:
        table()


@app.command("overhead")
def overhead(
    requests: Annotated[int, typer.Option(min=1, help="Timed rounds per engine.")] = 100,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed rounds first.")] = 5,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens per answer.")] = 8,
    engines: Annotated[str, typer.Option(help="sim (no model cost: the queue plane alone) and/or hf "
                                              "(the tiny transformers model).")] = "sim,hf",
    deadline_s: Annotated[float, typer.Option(min=1.0, help="Stop measuring after this long (s, from the "
                                                            "start of the processes).")] = 600.0,
    keep_logs: Annotated[bool, typer.Option(help="Keep the child processes' logs.")] = False,
    as_json: JsonOption = False,
    plot: PlotOption = None,
) -> None:
    """Latency lanes adds to time-to-first-token: each request through a real edge, Redis and
    worker, paired with the same request on the engine in this process."""
    from lanes.bench import overhead as bench
    from lanes.bench.common import print_table

    names = tuple(n.strip() for n in engines.split(",") if n.strip())
    try:
        options = bench.Options(requests, warmup, max_tokens, names, deadline_s)
        result = bench.run(options, keep_logs=keep_logs)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--engines") from None

    failed = bench.verdict(result)

    def table() -> None:
        rows = []
        for label, key in bench.ROWS:
            rows.append([label, *(_ms2(p[key][q]) for p in result["phases"] for q in ("p50", "p99"))])
        columns = ["ms", *(f"{p['engine']} {q}" for p in result["phases"] for q in ("p50", "p99"))]
        print_table(f"Added latency, {requests} requests per engine (load {result['machine']['loadavg_1m']})",
                    columns, rows)
        _say_not_valid(failed)

    _emit(result, as_json, table)
    if plot is not None:
        bench.write_plot(result, plot)
    _fail_if_not_valid(failed)


def _ms2(value: float) -> str:
    """A table cell in ms; "-" where there is no figure (no rounds)."""
    return f"{value:.2f}" if np.isfinite(value) else "-"


@app.command("fanout")
def fanout(
    concurrency: Annotated[str, typer.Option(help="Requests in flight, comma-separated: one run each.")] = "16,64,256",
    seconds: Annotated[float, typer.Option(min=0.5, help="Measured window per concurrency.")] = 8.0,
    warmup_s: Annotated[float, typer.Option(min=0.0, help="Untimed seconds before each window.")] = 2.0,
    workers: Annotated[int, typer.Option(min=1, help="Sim-engine workers.")] = 2,
    slots: Annotated[int, typer.Option(min=1, help="Slots per worker.")] = 128,
    time_scale: Annotated[float, typer.Option(min=1.0, help="Sim engine speed-up (high: tokens as fast as "
                                                             "the CPU allows).")] = 200.0,
    as_json: JsonOption = False,
    plot: PlotOption = None,
) -> None:
    """Tokens per second one edge and one Redis deliver, and the CPU each 1,000 tokens costs."""
    from lanes.bench import fanout as bench
    from lanes.bench.common import plot_lines, print_table

    levels = _ints(concurrency, "--concurrency")
    result = bench.run(levels, seconds, warmup_s, workers, slots, time_scale)
    failed = bench.verdict(result)

    def table() -> None:
        rows = []
        for r in result["runs"]:
            per = r["cpu_ms_per_1k_tokens"]
            rows.append([r["concurrency"], r["tokens_per_s"], r["server_cpu_ms_per_1k_tokens"], per["edge"],
                         per["workers"], per["redis"], per["client"], r["gaps"], r["completed"], r["not_done"],
                         len(r["clients_closed"]), ", ".join(r["crashed"]) or "-"])
        print_table(f"Token fan-out, {workers} sim workers (load {result['machine']['loadavg_1m']})",
                    ["in flight", "tokens/s", "server CPU ms/1k", "edge", "workers", "redis", "client (load)",
                     "gaps", "done", "not done", "clients closed", "crashed"], rows)
        _say_not_valid(failed)

    _emit(result, as_json, table)
    if plot is not None:
        xs = [float(r["concurrency"]) for r in result["runs"]]
        plot_lines(plot, "Tokens/s delivered by one edge", "requests in flight", "tokens/s",
                   {"tokens/s": (xs, [float(r["tokens_per_s"]) for r in result["runs"]])})
    _fail_if_not_valid(failed)


@app.command("connections")
def connections(
    connections: Annotated[int, typer.Option(min=1, help="Idle WebSocket connections to hold.")] = 10_000,
    batch: Annotated[int, typer.Option(min=1, help="Connections opened at once.")] = 200,
    probe_every: Annotated[int, typer.Option(min=1, help="One held connection in this many sends a chat.")] = 100,
    churn: Annotated[int, typer.Option(min=0, help="Then this many connections that each make one request and "
                                                   "close: the RSS each leaves behind.")] = 0,
    churn_warmup: Annotated[int, typer.Option(min=0, help="Finished connections before the churn's first "
                                                          "RSS reading.")] = 200,
    as_json: JsonOption = False,
    plot: PlotOption = None,
) -> None:
    """Idle connections one edge holds, its RSS per connection, and (--churn) what finished ones leave."""
    from lanes.bench import connections as bench
    from lanes.bench.common import print_table

    result = bench.run(bench.Options(connections, batch, probe_every, churn, churn_warmup))

    def table() -> None:
        rows = [["held", result["connections"], result["rss_mb_baseline"], result["rss_mb"],
                 f"{result['kib_per_connection']:.2f} KiB", f"{result['probes_done']}/"
                 f"{result['probes_done'] + result['probes_failed']}"]]
        if "churn" in result:
            c = result["churn"]
            rows.append(["churned", c["connections"], round(c["rss_kib_before"] / 1024, 1),
                         round(c["rss_kib_after"] / 1024, 1), f"{c['growth_bytes_per_connection']:.0f} B",
                         f"{c['done']}/{c['connections']}"])
        print_table(f"Connections on one edge (load {result['machine']['loadavg_1m']})",
                    ["", "connections", "edge RSS before MB", "edge RSS after MB", "per connection",
                     "chats done"], rows)

    _emit(result, as_json, table)
    if plot is not None:
        from lanes.bench.common import plot_lines

        xs, ys = zip(*result["rss_curve"], strict=True)
        plot_lines(plot, "Edge RSS while connections open (idle)", "connections open", "edge RSS (MB)",
                   {"edge RSS": (list(map(float, xs)), list(ys))})
    failed = result["probes_failed"] + result.get("churn", {}).get("failed", 0)
    if failed or result["connections"] < connections:
        typer.echo(f"{connections - result['connections']} connections dropped, {failed} chats failed", err=True)
        raise typer.Exit(1)


@app.command("live")
def live(
    trace: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="Trace (read in place): Azure CSV, BurstGPT CSV or Mooncake JSONL, gzipped or not.")] = DEFAULT_TRACE,
    prompts: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="Prompts with known answer lengths, as for `bench policy`. "
                       "Default: benchmarks/data/prompt_pool.json.")] = None,
    requests: Annotated[int, typer.Option("--requests", help="Rows of the trace replayed (the slice).")] = 400,
    start: Annotated[int, typer.Option(min=0, help="First row of the slice.")] = 0,
    load: Annotated[float, typer.Option(min=0.01, max=100.0, help="Offered load as a fraction of the slice's FCFS capacity "
                                             "on --workers.")] = 0.9,
    workers: Annotated[int, typer.Option(min=1, help="Sim-engine worker processes.")] = 2,
    slots: Annotated[int, typer.Option(min=1, help="Slots per worker (max_num_seqs, here and in the simulator).")] = 16,
    edges: Annotated[int, typer.Option(min=1, help="Edge processes (clients are spread over them).")] = 2,
    clients: Annotated[int, typer.Option(min=1, help="WebSocket client connections.")] = 32,
    time_scale: Annotated[float, typer.Option(min=0.1, help="Run this many times faster than the trace's time.")] = 2.0,
    profile: Annotated[str, typer.Option(callback=_known_profile, help="Cost profile: l70-h100, l70-a100, l7-a100.")] = "l70-h100",
    policy: Annotated[str, typer.Option(help="Policies run live (comma list of fcfs, lanes; sim_gap needs "
                                             "both).")] = "fcfs,lanes",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (or write --json-file).")] = False,
    json_file: Annotated[Path | None, typer.Option(help="Write the JSON here (implies --json).",
                                                   callback=writable_file)] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of TTFT p50/p99, live vs simulated.",
                                              callback=writable_file)] = None,
    chunked_prefill_tokens: Annotated[int, typer.Option(min=0, help="Token budget per engine step with chunked "
                                                        "prefill, in the sim workers and the simulator alike; 0: vLLM "
                                                        "v0's prefill-or-decode steps (the tables before stop 35).")] = MAX_NUM_BATCHED_TOKENS,
) -> None:
    """Replay a trace slice through real edges, Redis and sim workers, fcfs vs lanes, beside the simulator."""
    from lanes.bench import live as bench_live
    from lanes.bench.common import write_json
    from lanes.scheduler.predictor import load_default

    names = tuple(n.strip() for n in policy.split(",") if n.strip())
    if not names or set(names) - set(bench_live.POLICIES):
        raise typer.BadParameter(f"--policy takes {', '.join(bench_live.POLICIES)}", param_hint="--policy")
    if requests < 10:
        raise typer.BadParameter("need at least 10 rows", param_hint="--requests")
    sliced = _load_trace(trace, start, requests)
    observations = _load_prompt_pool(prompts)
    pool_tokens = np.array([o.output_tokens for o in observations], dtype=float)
    try:
        engine = bench_live.engine_config(profile, slots, chunked_prefill_tokens)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--chunked-prefill-tokens") from None
    plan = bench_live.plan(sliced, [o.prompt for o in observations], pool_tokens, load_default().predict,
                           engine=engine, workers=workers, load=load)
    typer.echo(f"slice rows {start}..{start + requests - 1}: FCFS capacity {plan.capacity_rps:.3f} req/s on {workers} x {slots} "
               f"slots; offered {plan.trace.rate_rps:.3f} req/s over {plan.trace.duration_s:.0f} s of trace time "
               f"(~{plan.trace.duration_s / time_scale:.0f} s wall per policy); predictor tau {plan.tau:.2f}, "
               f"long lane above {plan.routing_max_tokens} tokens ({plan.share_long_lane:.1%}; fitted on "
               + (f"{plan.num_calibration} pool prompts the slice does not use)" if plan.calibrated_on == "held-out"
                  else "the slice's first rows: the slice leaves too few of the pool's prompts unused)"), err=True)
    result = bench_live.run(plan, time_scale=time_scale, num_edges=edges, num_clients=clients, policies=names)
    failed, warned = bench_live.verdict(result, names)
    if as_json or json_file is not None:
        write_json(json_file, result)
    if json_file is not None or not as_json:
        print_live_table(result, names)
        _say_not_valid(failed, warned)
    if plot is not None:
        write_live_plot(result, names, plot)
    _fail_if_not_valid(failed, warned)


def print_live_table(result: dict[str, Any], names: tuple[str, ...]) -> None:
    from lanes.bench.common import print_table

    rows = []
    for name in names:
        for cls in ("short", "long", "all"):
            lv, sv = result[name].get(cls, {}), result["sim"][name][cls]
            rows.append((name, cls, _ms(lv.get("ttft_ms_p50")), _ms(sv["ttft_ms_p50"]),
                         _ms(lv.get("ttft_ms_p99")), _ms(sv["ttft_ms_p99"]),
                         f"{lv.get('throughput_rps', float('nan')):.3f}", f"{sv['throughput_rps']:.3f}"))
    gain = result["short_p99_gain"]
    cfg, machine = result["config"], result["machine"]["after"]
    print_table(f"lanes bench live: {cfg['requests']} requests, {cfg['workers']} workers x {cfg['slots']} slots, "
                f"load {cfg['load']}, time scale {cfg['time_scale']} (TTFT ms in trace time)",
                ("policy", "class", "live p50", "sim p50", "live p99", "sim p99", "live req/s", "sim req/s"), rows)
    cores = ", ".join(f"{n} {result[n]['cpu_cores_used_total']:.2f}" for n in names)
    typer.echo(f"short TTFT p99 gain (fcfs/lanes): live {gain['live']:.2f}, sim {gain['sim']:.2f}; "
               f"sim_gap {result['sim_gap']:+.1%} (goal within {result['sim_gap_goal']:.0%}); "
               f"cores used by the run: {cores}; load average {machine['loadavg_1m']} on {machine['cores']} cores")


def _ms(value: float | None) -> str:
    return "-" if value is None or not np.isfinite(value) else f"{value:,.0f}"


def _s(ms: float | None) -> float:
    """Milliseconds to seconds for a plot: a class with no requests (None) plots no bar."""
    return np.nan if ms is None else ms / 1000


def write_live_plot(result: dict[str, Any], names: tuple[str, ...], path: Path) -> None:
    """Bars of TTFT p50 and p99 per policy and class, live beside simulated."""
    from lanes.bench.common import figure

    labels = [f"{n}\n{c}" for n in names for c in ("short", "long")]
    x = np.arange(len(labels))
    with figure(path, 2, width=10.0) as (fig, axes):
        for ax, q in zip(axes, ("p50", "p99"), strict=True):
            live_v = [_s(result[n].get(c, {}).get(f"ttft_ms_{q}")) for n in names for c in ("short", "long")]
            sim_v = [_s(result["sim"][n][c][f"ttft_ms_{q}"]) for n in names for c in ("short", "long")]
            ax.bar(x - 0.2, live_v, 0.4, label="live")
            ax.bar(x + 0.2, sim_v, 0.4, label="simulated")
            ax.set(xticks=x, xticklabels=labels, title=f"TTFT {q} (s, trace time)")
            ax.grid(True, axis="y", alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"lanes bench live: sim_gap {result['sim_gap']:+.1%}")


@app.command("background")
def background(
    long: Annotated[int, typer.Option(min=1, help="Long chats holding the worker.")] = 24,
    long_tokens: Annotated[int, typer.Option(min=1, help="Tokens per long answer.")] = 1000,
    short: Annotated[int, typer.Option(min=1, help="Short chats measured.")] = 40,
    interval_ms: Annotated[float, typer.Option(min=0.0, help="Between two short chats.")] = 100.0,
    time_scale: Annotated[float, typer.Option(min=0.1, help="Sim engine speed-up over the L70-H100 cost "
                                                           "model.")] = 10.0,
    as_json: JsonOption = False,
    plot: PlotOption = None,
) -> None:
    """Short requests' TTFT while long answers hold the worker: one lane (LANES_POLICY=fcfs) vs lanes."""
    from lanes.bench import background as bench
    from lanes.bench.common import print_table

    options = bench.Options(long, long_tokens, short, 16, interval_ms, time_scale)
    result = bench.run(options)
    failed = bench.verdict(result, options)

    def table() -> None:
        rows = [[policy, r["short_ttft_ms_p50"], r["short_ttft_ms_p99"], r["short_ttft_ms_max"],
                 f"{r['short_done']}/{short}", " ".join(f"{k}:{v}" for k, v in r["short_lanes"].items()),
                 " ".join(f"{k}:{v}" for k, v in r["long_lanes"].items()),
                 f"{r['long_running_when_shorts_sent']}/{r['long_running_expected']}"]
                for policy in bench.POLICIES for r in [result[policy]]]
        print_table(f"Short TTFT (ms) with {long} long chats in the background, time scale {time_scale:g} "
                    f"(load {result['machine']['loadavg_1m']})",
                    ["policy", "p50", "p99", "max", "done", "short lanes", "long lanes", "long running"], rows)
        _say_not_valid(failed)

    _emit(result, as_json, table)
    if plot is not None:
        from lanes.bench.common import plot_lines

        series = {}
        for policy in bench.POLICIES:
            ttft = sorted(result[policy]["short_ttft_ms"])
            series[policy] = ([100 * (i + 0.5) / len(ttft) for i in range(len(ttft))], ttft)
        plot_lines(plot, f"Short chats' TTFT with {long} long chats in the background", "percentile",
                   "TTFT (ms)", series, logy=True)
    _fail_if_not_valid(failed)
