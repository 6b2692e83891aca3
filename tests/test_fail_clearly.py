"""Every expected failure of a lanes process ends in one line that names the cause and the fix,
with exit status 2 for a configuration error, and no traceback unless ``--debug`` /
``LANES_DEBUG=1`` asks for one. Real processes, real sockets, a real (unreachable) Redis URL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from lanes.cli.failures import safe_url
from lanes.scheduler.predictor import DEFAULT_WEIGHTS_PATH

REFUSED_REDIS = "redis://:hunter2@127.0.0.1:1/0"


def lanes(*args: str, timeout_s: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lanes.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def no_traceback(out: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_edge_on_a_taken_port_exits_2_naming_the_port(redis_url: str, taken_port: int) -> None:
    out = lanes("edge", "--port", str(taken_port), LANES_REDIS_URL=redis_url)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"configuration error: port {taken_port} on 127.0.0.1 is already in use (--port / LANES_PORT): "
        "stop what listens there or choose another port")
    no_traceback(out)


@pytest.mark.parametrize("command", [["edge", "--port", "0"], ["worker", "--engine", "sim"], ["scheduler"]])
def test_unreachable_redis_is_one_line_naming_the_setting_and_address(command: list[str]) -> None:
    """A Redis that refuses may be down for a while: exit 1, which a supervisor restarts (it was
    2, and under ``lanes up`` a worker restarted during a Redis outage then stopped everything).
    A host that does not exist is a mistake to fix: exit 2."""
    out = lanes(*command, LANES_REDIS_URL=REFUSED_REDIS)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "error: cannot reach Redis at redis://:***@127.0.0.1:1/0 (LANES_REDIS_URL): connection "
        "refused. Start Redis there or point LANES_REDIS_URL at yours (`lanes up` without LANES_REDIS_URL "
        "starts its own)")
    assert "hunter2" not in out.stderr + out.stdout
    no_traceback(out)
    out = lanes(*command, LANES_REDIS_URL="redis://no-such-host.invalid:6379/0")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(
        "configuration error: cannot reach Redis at redis://no-such-host.invalid:6379/0 (LANES_REDIS_URL): unknown host.")
    no_traceback(out)


def test_a_missing_model_directory_exits_2_before_loading(redis_url: str) -> None:
    out = lanes("worker", "--model", "/nonexistent/model", LANES_REDIS_URL=redis_url)
    assert out.returncode == 2
    assert "configuration error: model directory /nonexistent/model does not exist (--model / LANES_MODEL)" \
        in out.stderr
    no_traceback(out)


def test_a_hub_id_missing_from_the_offline_cache_exits_2(redis_url: str, tmp_path) -> None:
    out = lanes("worker", "--model", "example-org/not-cached-model", LANES_REDIS_URL=redis_url,
                HF_HUB_CACHE=str(tmp_path), HF_HOME=str(tmp_path))
    assert out.returncode == 2
    assert "model example-org/not-cached-model is not in the Hugging Face cache" in out.stderr
    assert "HF_HUB_OFFLINE=1 forbids downloading it (--model / LANES_MODEL)" in out.stderr
    no_traceback(out)


def test_a_directory_that_is_not_a_model_exits_2_naming_it(redis_url: str, tmp_path) -> None:
    out = lanes("worker", "--model", str(tmp_path), LANES_REDIS_URL=redis_url)
    assert out.returncode == 2
    assert f"configuration error: {tmp_path} is not a Hugging Face model directory: it has no config.json " \
           "(--model / LANES_MODEL)" in out.stderr
    no_traceback(out)
    (tmp_path / "weights.bin").write_bytes(b"x")
    out = lanes("worker", "--model", str(tmp_path / "weights.bin"), LANES_REDIS_URL=redis_url)
    assert out.returncode == 2 and "weights.bin is a file, not a model directory" in out.stderr
    no_traceback(out)


def test_debug_keeps_the_configuration_exit_status(redis_url: str) -> None:
    """With ``--debug`` a configuration error still exits 2 (after its traceback): ``lanes up``
    stops on 2, and restarted its child forever on the 1 a re-raised exception gave."""
    out = lanes("--debug", "worker", "--model", "/nonexistent/model", LANES_REDIS_URL=redis_url)
    assert out.returncode == 2 and "Traceback" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("configuration error: model directory /nonexistent/model")


def test_an_address_the_edge_cannot_listen_on_is_one_line(redis_url: str) -> None:
    out = lanes("edge", "--host", "192.0.2.1", "--port", "8000", LANES_REDIS_URL=redis_url)  # TEST-NET-1: never ours
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        "configuration error: cannot listen on 192.0.2.1:8000 (--host / LANES_HOST, --port / LANES_PORT)")
    no_traceback(out)


def test_a_device_this_torch_cannot_use_is_one_line(redis_url: str) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    out = lanes("worker", "--device", "cuda", LANES_REDIS_URL=redis_url)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "LANES_DEVICE=cuda, but torch" in out.stderr and "--device cpu" in out.stderr
    no_traceback(out)


def test_chat_to_a_closed_port_is_one_line() -> None:
    with socket.socket() as sock:  # bound, not listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        url = f"ws://127.0.0.1:{sock.getsockname()[1]}/v1/chat"
        out = lanes("chat", "--url", url, "hello")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: cannot connect to {url}: connection refused; is `lanes up` (or `lanes edge`) running there? (--url)"]
    no_traceback(out)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(how: str) -> None:
    args = ["--debug"] if how == "flag" else []
    env = {"LANES_DEBUG": "1"} if how == "env" else {}
    out = lanes(*args, "chat", "--url", "ws://127.0.0.1:1/v1/chat", "hello", **env)
    assert out.returncode != 0 and "Traceback" in out.stderr
    assert "cannot connect to ws://127.0.0.1:1/v1/chat" in out.stderr


def test_safe_url_hides_only_the_password() -> None:
    assert safe_url("redis://:s3cret@10.0.0.5:6380/2") == "redis://:***@10.0.0.5:6380/2"
    assert safe_url("rediss://user:s3cret@h:1/0") == "rediss://user:***@h:1/0"
    assert safe_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert safe_url("unix:///run/redis.sock") == "unix:///run/redis.sock"


@pytest.mark.parametrize("setting", ["LANES_ROUTING_FILE", "LANES_FIXED_ANSWERS_FILE"])
def test_an_unusable_routing_file_stops_the_edge_with_one_line_naming_the_setting(
        redis_url: str, tmp_path, setting: str) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("this is = = not toml\n")
    for path in (broken, tmp_path / "missing.toml"):
        out = lanes("edge", "--port", "0", LANES_REDIS_URL=redis_url, **{setting: str(path)})
        assert out.returncode == 2
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("configuration error: ") and setting in last and str(path) in last, last
        no_traceback(out)


def test_bad_input_files_of_the_tools_are_usage_errors_naming_the_flag(tmp_path) -> None:
    """Offline tools (bench, predictor, router) answer a missing or malformed file with the flag, the
    file and what it should hold (exit 2), not a traceback."""
    bad_csv = tmp_path / "trace.csv"
    bad_csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,abc,10\n")
    bad_json = tmp_path / "data.json"
    bad_json.write_text("{not json")
    wrong_shape = tmp_path / "shape.json"
    wrong_shape.write_text('[{"text": "hi"}]')
    good = tmp_path / "good.json"
    good.write_text('[{"prompt": "hi", "output_tokens": 3}]')
    cases = [
        (("bench", "policy", "--trace", str(tmp_path / "nope.csv")), "--trace", "does not exist"),
        (("bench", "policy", "--trace", str(bad_csv)), "--trace", "line 2"),
        (("predictor", "eval", "--data", str(bad_json)), "--data", "JSONDecodeError"),
        (("predictor", "eval", "--data", str(wrong_shape)), "--data", "output_tokens"),
        (("predictor", "cv", "--data", str(bad_json)), "--data", "JSONDecodeError"),
        (("predictor", "eval", "--data", str(good), "--source", "nope"), "--source", "has no source 'nope'"),
        (("router", "eval", "--shared-data", str(tmp_path)), "--shared-data", "FileNotFoundError"),
    ]
    for args, flag, detail in cases:
        out = lanes(*args)
        assert out.returncode == 2, (args, out.stderr[-2000:])
        text = " ".join(out.stderr.replace("│", " ").split())  # rich boxes wrap the message
        assert flag in text and detail in text, (args, text)
        no_traceback(out)


@pytest.mark.parametrize("command,env,named", [
    (["worker", "--engine", "sim"], {"LANES_MAX_SLOTS": "abc"}, "LANES_MAX_SLOTS='abc': Input should be a valid integer"),
    (["worker", "--engine", "sim"], {"LANES_MAX_LONG_SLOTS": "-1"}, "LANES_MAX_LONG_SLOTS='-1'"),
    (["edge", "--port", "0"], {"LANES_POLICY": "bogus"}, "LANES_POLICY='bogus': Input should be 'lanes' or 'fcfs'"),
    (["scheduler"], {"LANES_REDIS_URL": "http://:hunter2@127.0.0.1:1"}, "LANES_REDIS_URL='http://:***@127.0.0.1:1'"),
    (["worker", "--engine", "sim"], {"LANES_MAX_SLOTS": "0"}, "LANES_MAX_SLOTS='0': Input should be greater than"),
    (["edge"], {"LANES_PORT": "70000"}, "LANES_PORT='70000': Input should be less than or equal to 65535"),
    (["scheduler"], {"LANES_PREDICTOR_MAX_OBSERVATIONS": "30000"},
     "LANES_PREDICTOR_MAX_OBSERVATIONS='30000': Input should be less than or equal to 20000"),
    (["scheduler"], {"LANES_LOG_LEVEL": "verbose"}, "LANES_LOG_LEVEL='verbose': Value error, use one of DEBUG, INFO"),
    (["scheduler"], {"LANES_OTEL_EXPORTER": "bogus"}, "LANES_OTEL_EXPORTER='bogus': Input should be 'none', 'console'"),
    (["scheduler"], {"LANES_REDIS_URL": "redis://127.0.0.1:6379/abc"},
     "the database after the host must be a number (redis://host:port/0), not 'abc'"),  # redis-py: db 0, silently
    (["worker", "--engine", "sim"], {"LANES_POOL": "auto"}, "'auto' is reserved"),  # was served, unreachable
    (["scheduler"], {"LANES_REDIS_URL": "redis+cluster://127.0.0.1:6379/5"},
     "a Redis Cluster has only database 0"),  # was a traceback and exit 1 (a crash under `lanes up`)
    (["scheduler"], {"LANES_REDIS_URL": "redis://127.0.0.1:99999/0"}, "the port must be a number in 1-65535"),
    (["scheduler"], {"LANES_REDIS_URL": "redis://127.0.0.1:0/0"}, "the port must be a number in 1-65535"),  # was 6379
    (["scheduler"], {"LANES_HEARTBEAT_S": "0"}, "LANES_HEARTBEAT_S='0': Input should be greater than 0"),
    (["scheduler"], {"LANES_HEARTBEAT_S": "3"}, "LANES_HEARTBEAT_S (3 s) must be shorter than LANES_LEASE_MS"),
    (["worker", "--engine", "sim"], {"LANES_DEVICE": "tpu"}, "LANES_DEVICE='tpu': Value error, use cpu, cuda"),
    (["edge"], {"LANES_API_KEY_HASHES": "lanes_pastedthekey"},
     "each entry must be a SHA-256 hex digest (64 hex digits) of a key, not the key itself"),
    # Negative numbers these took without a word (a negative drain, GPU -1 hidden from vLLM):
    (["worker", "--engine", "sim"], {"LANES_DRAIN_TIMEOUT_S": "-1"},
     "LANES_DRAIN_TIMEOUT_S='-1': Input should be greater than or equal to 0"),
    (["worker", "--engine", "sim"], {"LANES_GPU_INDEX": "-1"}, "LANES_GPU_INDEX='-1': Input should be greater"),
    (["worker", "--engine", "sim"], {"LANES_MAX_MODEL_LEN": "-1"}, "LANES_MAX_MODEL_LEN='-1'"),
    (["worker", "--engine", "sim"], {"LANES_PREEMPT_AFTER_MS": "-5"}, "LANES_PREEMPT_AFTER_MS='-5'"),
    (["worker", "--engine", "sim"], {"LANES_NUM_SPECULATIVE_TOKENS": "-2"}, "LANES_NUM_SPECULATIVE_TOKENS='-2'"),
    (["scheduler"], {"LANES_PREDICTOR_MIN_OBSERVATIONS": "0"},
     "LANES_PREDICTOR_MIN_OBSERVATIONS='0': Input should be greater than or equal to 1"),
])
def test_a_setting_that_does_not_validate_is_one_line_naming_it(command: list[str], env: dict[str, str],
                                                                named: str) -> None:
    out = lanes(*command, **env)
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("configuration error: ") and named in last, last
    assert "hunter2" not in out.stderr + out.stdout
    no_traceback(out)


def test_a_value_from_a_flag_is_named_by_the_flag() -> None:
    """``lanes worker --engine foo`` was reported as ``LANES_ENGINE='foo'``, a variable the user
    never set; the same value from the environment is still named by its variable."""
    out = lanes("worker", "--engine", "foo")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        "configuration error: WorkerSettings refused: --engine='foo': Input should be 'hf', 'vllm', 'trtllm' or 'sim'")
    no_traceback(out)
    from pydantic import ValidationError

    from lanes.cli.failures import settings_error
    from lanes.ws_server.settings import EdgeSettings

    with pytest.raises(ValidationError) as refused:
        EdgeSettings(_env_file=None, port=70000, max_messages=0)
    assert settings_error(refused.value, flags={"port"}).startswith(
        "EdgeSettings refused: --port=70000: Input should be less than or equal to 65535; LANES_MAX_MESSAGES=0: ")


def test_keys_without_redis_and_redis_on_a_taken_port_are_one_line(taken_port: int) -> None:
    out = lanes("keys", "list", LANES_REDIS_URL=REFUSED_REDIS)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: cannot reach Redis at redis://:***@127.0.0.1:1/0 (LANES_REDIS_URL)")
    no_traceback(out)
    out = lanes("redis", "--port", str(taken_port))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"configuration error: port {taken_port} on 127.0.0.1 is already in use (--port / --host)")
    no_traceback(out)


def test_bench_arguments_out_of_range_are_usage_errors(tmp_path) -> None:
    """Numbers the simulator cannot run with are refused before any run (load 0 used to hang;
    workers 0, an unknown profile or a bad --plot-loads ended in a traceback)."""
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,10\n"
                     "2023-11-16 18:15:47.0000000,100,20\n")
    base = ("bench", "policy", "--trace", str(trace), "--policy", "fcfs")
    for extra, flag in ((("--load", "0"), "--load"), (("--workers", "0"), "--workers"),
                        (("--predictor", "noise", "--tau", "2"), "--tau"), (("--profile", "nope"), "--profile"),
                        (("--plot", str(tmp_path / "p.png"), "--plot-loads", "0.5,abc"), "--plot-loads"),
                        (("--prefix-cache-share", "2"), "--prefix-cache-share")):
        out = lanes(*base, *extra, timeout_s=60)
        assert out.returncode == 2 and flag in out.stderr, (extra, out.stderr[-1500:])
        no_traceback(out)
    out = lanes("worker", "--engine", "sim", "--sim-profile", "nope")
    assert out.returncode == 2 and "--sim-profile='nope'" in out.stderr  # the flag, not LANES_SIM_PROFILE
    no_traceback(out)


def test_a_lanes_variable_no_process_reads_is_named_with_the_closest_setting() -> None:
    from lanes.cli.failures import known_variables, unknown_variables

    environ = {"LANES_AUTH_REQURED": "true", "LANES_ROUTING_FLIE": "x", "LANES_FOO": "1", "LANES_MAX_SLOTS": "4",
               "LANES_BIN": "lanes", "PATH": "/bin"}
    assert unknown_variables(environ) == [
        "LANES_AUTH_REQURED is not a lanes setting and is ignored; did you mean LANES_AUTH_REQUIRED?",
        "LANES_FOO is not a lanes setting and is ignored",
        "LANES_ROUTING_FLIE is not a lanes setting and is ignored; did you mean LANES_ROUTING_FILE?"]
    assert {"LANES_REDIS_URL", "LANES_MAX_SLOTS", "LANES_PORT", "LANES_DEBUG", "LANES_POOLS"} <= known_variables()


def test_more_connections_than_the_open_files_limit_is_one_line() -> None:
    """``lanes bench connections`` first lifts its soft open-files limit to the hard one (the edge
    inherits it; ``lanes edge`` does the same), and past the hard limit says so in one line:
    at the common soft limit of 1,024 it died with a traceback (EMFILE) after 6 s."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1500))

    out = subprocess.run([sys.executable, "-m", "lanes.cli.main", "bench", "connections", "--connections", "2000"],
                         capture_output=True, text=True, timeout=60, preexec_fn=limit, check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    no_traceback(out)
    assert "needs about 2456 open files, but this system allows 1500" in out.stderr


def _corrupt_copy(source, dest):
    """A copy of a model directory whose weights file is cut to 4 bytes."""
    import shutil

    shutil.copytree(source, dest)
    weights = next(dest.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:4])
    return dest


@pytest.mark.parametrize("spec_method", ["none", "prompt_lookup"])
def test_a_corrupt_weights_file_exits_2_in_one_line(redis_url: str, tiny_model, tmp_path, spec_method: str) -> None:
    """A truncated ``model.safetensors`` (an interrupted copy or download) raised safetensors'
    own error, which the loader did not catch: a ~200-line traceback and exit 1, which ``lanes
    up`` restarted forever. Restarting never helps: one line, exit 2. The speculative engine
    (``hf_spec``) handed ``load_failure`` a Path, whose TypeError made that a crash again."""
    model = _corrupt_copy(tiny_model.target, tmp_path / "model")
    out = lanes("worker", "--model", str(model), LANES_REDIS_URL=redis_url, LANES_SPEC_METHOD=spec_method)
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"configuration error: cannot load the model {model} (--model / LANES_MODEL): "), last
    assert "SafetensorError" in last, last
    no_traceback(out)


def test_a_corrupt_draft_model_is_named_not_the_target(redis_url: str, tiny_model, tmp_path) -> None:
    """A draft that does not load was reported as the target model, whose directory is fine."""
    draft = _corrupt_copy(tiny_model.draft, tmp_path / "draft")
    out = lanes("worker", "--model", str(tiny_model.target), "--draft-model", str(draft),
                "--spec-method", "draft_model", LANES_REDIS_URL=redis_url)
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"configuration error: cannot load the model {draft} (--draft-model / "
                           "LANES_DRAFT_MODEL): "), last
    no_traceback(out)


@pytest.mark.parametrize(("command", "env", "named"), [
    (("edge",), {"LANES_DEFAULT_MAX_TOKENS": "99999"}, "LANES_DEFAULT_MAX_TOKENS (99999) is above LANES_MAX_TOKENS_LIMIT"),
    (("edge",), {"LANES_MAX_TOKENS_LIMIT": "0"}, "LANES_MAX_TOKENS_LIMIT"),
    (("edge",), {"LANES_MAX_FRAME_BYTES": "-1"}, "LANES_MAX_FRAME_BYTES"),
    (("worker", "--engine", "sim"), {"LANES_SIM_TIME_SCALE": "0"}, "LANES_SIM_TIME_SCALE"),
    (("worker", "--engine", "sim"), {"LANES_MAX_PREEMPTIONS": "-1"}, "LANES_MAX_PREEMPTIONS"),
    (("worker", "--engine", "sim"), {"LANES_STARVE_AFTER_MS": "-5"}, "LANES_STARVE_AFTER_MS"),
    # Once silently off (the refresh ran only when > 0), and an empty key prefix taken as given.
    (("scheduler",), {"LANES_PREDICTOR_REFRESH_MINUTES": "-1"}, "LANES_PREDICTOR_REFRESH_MINUTES='-1'"),
    (("edge",), {"LANES_KEY_PREFIX": ""}, "LANES_KEY_PREFIX='': String should have at least 1 character"),
])
def test_settings_that_could_never_work_exit_2_at_start(redis_url: str, command: tuple[str, ...],
                                                        env: dict[str, str], named: str) -> None:
    """Before, these passed validation: an edge then refused every chat, blaming the client
    ("field 'max_tokens' must be ... in [1, 4096]" for a chat that sent none), and a worker
    crashed later with a traceback and exit 1 (restarted forever by ``lanes up``)."""
    out = lanes(*command, LANES_REDIS_URL=redis_url, **env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert named in out.stderr.strip().splitlines()[-1], out.stderr[-1000:]
    no_traceback(out)


def test_tool_mistakes_are_one_line(redis_url: str, tmp_path) -> None:
    """Each of these printed a traceback (and some only after the work was done)."""
    rules = tmp_path / "routing.toml"
    rules.write_bytes('pools = ["small"]'.encode("utf-16"))  # Notepad's "Unicode"
    garbage = tmp_path / "weights.npz"
    garbage.write_text("not weights")
    negative, null_prompt, ok = tmp_path / "negative.json", tmp_path / "null.json", tmp_path / "ok.json"
    negative.write_text('[{"prompt": "hi", "output_tokens": -5}]')
    null_prompt.write_text('[{"prompt": null, "output_tokens": 5}]')
    ok.write_text('[{"prompt": "hi", "output_tokens": 3, "source": "a"}, {"prompt": "yo", "output_tokens": 9, "source": "b"}]')
    burst = tmp_path / "burst.jsonl"
    burst.write_text('{"timestamp": 0, "input_length": 5, "output_length": 3}\n' * 3)
    cases = [
        # Accepted before (a tau of -1 for a negative length) or a traceback (a null prompt).
        (("predictor", "eval", "--data", str(negative)), {}, "not -5)"),
        (("predictor", "eval", "--data", str(null_prompt)), {}, "'prompt' must be a string"),
        (("predictor", "eval", "--data", str(ok), "--short-max-tokens", "800", "--medium-max-tokens", "100"), {},
         "is below --short-max-tokens"),
        # After the whole cross-validation, a traceback; the taus were lost.
        (("predictor", "cv", "--data", str(ok), "--scores", "/proc/nope/oof.json"), {}, "cannot create the directory"),
        (("predictor", "cv", "--data", str(ok), "--folds", "1"), {}, "--folds"),
        (("predictor", "train", "--lexical", "--data", str(ok), "--out", "/proc/nope/w"), {},
         "cannot create the directory /proc/nope/w"),
        (("bench", "policy", "--trace", str(burst)), {}, "arrive at one time"),  # looped forever
        (("edge",), {"LANES_ROUTING_FILE": str(rules)}, "not UTF-8 text"),
        (("predictor", "eval", "--weights", str(garbage), "--data", str(tmp_path / "none.json")), {}, None),
        (("bench", "policy", "--plot", "/proc/no/such.png"), {}, "cannot create the directory /proc/no"),
        (("model", "tiny", "/proc/nope"), {}, "cannot create the directory /proc/nope"),
        (("scheduler",), {"LANES_REDIS_URL": redis_url.rsplit("/", 1)[0] + "/99"}, "has no such database"),
    ]
    for args, env, words in cases:
        out = lanes(*args, **{"LANES_REDIS_URL": redis_url, **env})
        assert out.returncode == 2, (args, out.stderr[-1500:])
        no_traceback(out)
        if words is not None:
            assert words in out.stderr, (args, out.stderr[-1500:])
    data = tmp_path / "data.json"
    data.write_text('[{"prompt": "hi", "output_tokens": 3}, {"prompt": "a poem", "output_tokens": 90}]')
    out = lanes("predictor", "eval", "--weights", str(garbage), "--data", str(data))
    assert out.returncode == 2 and "not a predictor weights file" in out.stderr, out.stderr[-1500:]
    assert "allow_pickle" not in out.stderr, "numpy's advice to load untrusted pickles is not passed on"
    no_traceback(out)
    # A truncated archive (zipfile's BadZipFile was a traceback) and a JSON file (numpy called it
    # "pickled data"): one line each.
    truncated, as_json = tmp_path / "truncated.npz", tmp_path / "weights.json"
    truncated.write_bytes(DEFAULT_WEIGHTS_PATH.read_bytes()[:300_000])
    as_json.write_text('{"weights": [1, 2]}')
    for weights, words in ((truncated, "File is not a zip file"), (as_json, "not an .npz archive")):
        out = lanes("predictor", "eval", "--weights", str(weights), "--data", str(data))
        assert out.returncode == 2 and words in out.stderr and "pickled" not in out.stderr, out.stderr[-1500:]
        no_traceback(out)


@pytest.mark.parametrize(("query", "words"), [
    ("socket_timeout=abc", "Invalid value for 'socket_timeout'"),
    ("sockettimeout=2", "unexpected keyword argument 'sockettimeout'"),
    ("ssl_cert_reqs=none", "ssl_* options need rediss://"),
])
def test_a_redis_url_option_redis_py_refuses_is_one_line(redis_url: str, query: str, words: str) -> None:
    """These failed at the first connection with a traceback and exit 1 (honcho then stopped
    every process); the URL is checked with the other settings now."""
    out = lanes("scheduler", LANES_REDIS_URL=f"{redis_url}?{query}")
    assert out.returncode == 2 and words in out.stderr, out.stderr[-1500:]
    no_traceback(out)


def test_lanes_up_reads_lanes_port_and_lanes_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--port`` and ``--engine`` were always passed on, so LANES_PORT and LANES_ENGINE were
    ignored (the edge came up on 8000 with the hf engine); flags still win."""
    from typer.testing import CliRunner

    from lanes.cli import main, up

    started: list[tuple[int, list[str]]] = []
    monkeypatch.setattr(up, "up", lambda port, workers, worker_args, host, **kw: started.append((port, worker_args)) or 0)
    monkeypatch.setenv("LANES_PORT", "18123")
    monkeypatch.setenv("LANES_ENGINE", "sim")
    assert CliRunner().invoke(main.app, ["up"]).exit_code == 0
    assert CliRunner().invoke(main.app, ["up", "--port", "9001", "--engine", "hf"]).exit_code == 0
    assert started == [(18123, ["--engine", "sim"]), (9001, ["--engine", "hf"])]


@pytest.mark.parametrize("command", [["worker", "--engine", "sim"], ["edge", "--port", "0"],
                                     ["keys", "create", "someone"], ["keys", "revoke", "someone"]])
def test_a_read_only_replica_is_one_line_naming_the_primary(redis_server, command: list[str]) -> None:
    """A replica answered the start-up check; then the worker died of ReadOnlyError (285 lines,
    restarted forever under `lanes up`), `keys create` printed 207 lines, and the edge told every
    client "unavailable; retry shortly"."""
    from lanes.queue.embedded import EmbeddedRedis

    host, port = redis_server.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    replica = EmbeddedRedis(extra_args=("--replicaof", host, port)).start()
    try:
        out = lanes(*command, LANES_REDIS_URL=replica.url, timeout_s=60)
        assert out.returncode == 2, out.stderr[-2000:]
        assert out.stderr.strip().splitlines()[-1] == (
            f"configuration error: Redis at {replica.url} is a read-only replica (LANES_REDIS_URL): point it "
            "at the primary")
        no_traceback(out)
    finally:
        replica.stop()


def test_keys_list_reads_a_replica(redis_server) -> None:
    """``lanes keys list`` only reads, so a replica serves it (it was refused like the commands
    that write): a key created on the primary is listed from its replica."""
    from lanes.queue.embedded import EmbeddedRedis

    host, port = redis_server.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    prefix = f"replica-{uuid.uuid4().hex[:6]}"
    created = lanes("keys", "create", "on-primary", LANES_REDIS_URL=redis_server.url, LANES_KEY_PREFIX=prefix)
    assert created.returncode == 0, created.stderr[-2000:]
    replica = EmbeddedRedis(extra_args=("--replicaof", host, port)).start()
    try:
        deadline = time.monotonic() + 30
        while True:  # the first full sync takes a moment
            out = lanes("keys", "list", LANES_REDIS_URL=replica.url, LANES_KEY_PREFIX=prefix, timeout_s=60)
            if "on-primary" in out.stdout or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert out.returncode == 0 and "on-primary" in out.stdout, out.stdout + out.stderr[-2000:]
        no_traceback(out)
    finally:
        replica.stop()


def test_the_hubs_log_lines_come_out_once(tmp_path) -> None:
    """huggingface_hub's own stderr handler printed each of its lines a second time (a download
    retry a second while the hub is unreachable: 45 lines for a missing model)."""
    script = ("import logging\nfrom lanes.telemetry.logs import setup_logging\nsetup_logging('INFO', 'worker')\n"
              "logging.getLogger('huggingface_hub.utils._http').warning('retry 1 of 5')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stderr.count("retry 1 of 5") == 1, out.stderr


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc and /sys")
def test_an_output_file_is_checked_by_writing_not_by_os_access(tmp_path) -> None:
    """``os.access`` says yes to root for ``/sys`` and ``/proc``: ``lanes bench policy --plot
    /sys/x.png`` passed the check and failed after the whole run with a traceback. The check now
    creates and removes a file there, and leaves nothing behind where it may write."""
    from pathlib import Path

    import typer

    from lanes.cli.failures import creatable_dir, writable_dir, writable_file

    for unwritable in (Path("/sys/x.png"), Path("/proc/x.png")):
        with pytest.raises(typer.BadParameter, match=f"cannot write into {unwritable.parent}"):
            writable_file(unwritable)
    with pytest.raises(typer.BadParameter, match="cannot write into /sys"):
        writable_dir(Path("/sys"))
    with pytest.raises(typer.BadParameter, match="cannot create the directory /sys/new"):
        creatable_dir(Path("/sys/new"))
    kept = tmp_path / "kept.png"
    kept.write_bytes(b"old plot")
    assert writable_file(kept) == kept and writable_file(tmp_path / "new.png") == tmp_path / "new.png"
    assert creatable_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert [p.name for p in tmp_path.iterdir()] == ["kept.png"] and kept.read_bytes() == b"old plot"


def test_a_redis_that_refuses_writes_is_named_not_just_unavailable() -> None:
    """Out of memory (maxmemory, noeviction) Redis still answers PING, so ``/healthz`` passes,
    and every chat was refused "queue unavailable; retry shortly" with the cause only in the
    logs. The refusal names it now (``refusal_cause``); an outage stays plain "unavailable"."""
    import redis
    from redis.exceptions import ConnectionError as RedisConnectionError

    from lanes.queue.embedded import EmbeddedRedis
    from lanes.queue.errors import refusal_cause

    server = EmbeddedRedis(extra_args=("--maxmemory", "1", "--maxmemory-policy", "noeviction")).start()
    try:
        client = redis.Redis.from_url(server.url)
        with pytest.raises(redis.exceptions.RedisError) as refused:
            client.set("k", "v" * 1000)
        assert refusal_cause(refused.value) == "Redis is out of memory (maxmemory reached) and refuses writes"
        # The plane's writes are Lua scripts: there the refusal is a plain ResponseError's text.
        with pytest.raises(redis.exceptions.RedisError) as in_script:
            client.eval("return redis.call('SET', KEYS[1], ARGV[1])", 1, "k", "v" * 1000)
        assert refusal_cause(in_script.value) == "Redis is out of memory (maxmemory reached) and refuses writes"
        client.close()
    finally:
        server.stop()
    assert refusal_cause(RedisConnectionError("Connection refused")) is None


def test_a_write_the_disk_or_a_permission_refuses_is_one_line(tmp_path) -> None:
    """A full disk (or a read-only file system, a quota, a permission) met after the output
    checks passed, while ``lanes model tiny`` wrote its weights: a page of traceback before."""
    target = tmp_path / "tiny" / "model.safetensors"
    script = ("import errno, sys\nimport lanes.workers.models.tiny as tiny\n"
              "def full(*args, **kwargs):\n"
              f"    raise OSError(errno.ENOSPC, 'No space left on device', {str(target)!r})\n"
              "tiny.build_tiny = full\nfrom lanes.cli.main import main\n"
              f"sys.argv = ['lanes', 'model', 'tiny', {str(tmp_path / 'tiny')!r}]\nmain()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [f"error: cannot write {target}: No space left on device"], out.stderr
    no_traceback(out)


def test_a_write_refused_in_a_running_edge_exits_1_to_be_restarted(redis_url: str, tmp_path) -> None:
    """A full disk met by a long-running process (here the edge, writing a published predictor
    to a temporary file) exited 2 like ``lanes model tiny``, and ``lanes up`` takes 2 for a
    configuration error: it stopped every process instead of restarting the edge. One line
    still, but exit 1, which ``lanes up`` (and systemd, Kubernetes) restarts with backoff."""
    target = tmp_path / "weights.npz"
    script = ("import errno, sys\nimport lanes.ws_server.edge as edge\n"
              "async def full(plane, known_version):\n"
              f"    raise OSError(errno.ENOSPC, 'No space left on device', {str(target)!r})\n"
              "edge.load_published = full\nfrom lanes.cli.main import main\n"
              "sys.argv = ['lanes', 'edge', '--port', '0']\nmain()\n")
    env = {**os.environ, "LANES_REDIS_URL": redis_url, "LANES_KEY_PREFIX": f"wf{uuid.uuid4().hex[:6]}"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                         check=False)
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == f"error: cannot write {target}: No space left on device"
    no_traceback(out)


def test_a_refused_write_is_a_configuration_error_only_for_one_shot_commands() -> None:
    import errno

    from lanes.cli.failures import EXIT_CONFIG, EXIT_FAILURE, exit_code_for

    full = OSError(errno.ENOSPC, "No space left on device", "/var/log/x")
    assert exit_code_for(full) == EXIT_CONFIG
    assert exit_code_for(full, long_running=True) == EXIT_FAILURE
    quota = OSError(errno.EDQUOT, "Disk quota exceeded", "/var/log/x")
    assert exit_code_for(quota, long_running=True) == EXIT_FAILURE
    # What restarting cannot mend stops a long-running process with 2 all the same: a
    # read-only file system or a refused permission does not clear by itself.
    for number in (errno.EROFS, errno.EACCES):
        refused = OSError(number, os.strerror(number), "/var/lib/lanes/f")
        assert exit_code_for(refused) == EXIT_CONFIG
        assert exit_code_for(refused, long_running=True) == EXIT_CONFIG
    from lanes.cli.failures import ConfigFailure

    assert exit_code_for(ConfigFailure("port taken"), long_running=True) == EXIT_CONFIG


def test_which_os_errors_are_writes_the_user_must_make_room_for(tmp_path) -> None:
    import errno

    from safetensors import SafetensorError

    from lanes.cli.failures import exit_code_for, write_error

    assert write_error(OSError(errno.EROFS, "Read-only file system", "/mnt/x.png")) == \
        "cannot write /mnt/x.png: Read-only file system"
    assert write_error(OSError(errno.EDQUOT, "Disk quota exceeded")) == "cannot write: Disk quota exceeded"
    # A permission may have been refused on a read, an exec or a listing: "access" (re-review).
    assert write_error(PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "new"))) == \
        f"cannot access {tmp_path / 'new'}: Permission denied"
    assert write_error(OSError(errno.EROFS, "Read-only file system", 3)) == "cannot write 3: Read-only file system"
    saved = SafetensorError("Error while serializing: No space left on device (os error 28)")
    assert write_error(saved) == "cannot write the weights (safetensors): No space left on device"
    assert exit_code_for(saved) == 2
    # Not writes: a port below 1024 (EACCES, no file), a file that is missing, any other error.
    for other in (PermissionError(errno.EACCES, "Permission denied"), FileNotFoundError(errno.ENOENT, "x", "/x"),
                  SafetensorError("invalid header"), ValueError("No space left on device")):
        assert write_error(other) is None and exit_code_for(other) is None


def test_redis_on_an_address_not_of_this_machine_says_so() -> None:
    """``lanes redis --host 8.8.8.8`` advised to "stop what listens there": nothing does."""
    out = lanes("redis", "--host", "192.0.2.1", "--port", "7417", timeout_s=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "configuration error: 192.0.2.1 is not an address of this machine (--host): 127.0.0.1, 0.0.0.0 "
        "(every interface) or one of its interfaces' addresses"], out.stderr


def test_a_gzipped_trace_is_read_and_a_broken_one_is_named(tmp_path) -> None:
    """A ``.csv.gz`` trace (as the public ones ship) was refused with "'utf-8' codec can't decode
    byte 0x8b in position 1", naming neither the file nor gzip; a binary file the same way. A
    gzipped trace is read now, and a cut one or a binary one is one line naming the file."""
    import gzip

    from lanes.scheduler.sim.trace import load_trace

    rows = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{40 + i:02d}.0000000,{100 + i},{10 + i}\n" for i in range(12))
    plain, zipped, cut, binary = (tmp_path / name for name in ("t.csv", "t.csv.gz", "cut.csv.gz", "bin.csv"))
    plain.write_text(rows)
    zipped.write_bytes(gzip.compress(rows.encode()))
    cut.write_bytes(zipped.read_bytes()[:40])
    binary.write_bytes(b"\xff\xfe\x00 not text\n")
    assert load_trace(zipped).trace.output_tokens.tolist() == load_trace(plain).trace.output_tokens.tolist()
    for path, words in ((cut, "the gzip data is damaged or cut short"),
                        (binary, "not UTF-8 text (byte 0xff: invalid start byte)")):
        out = lanes("bench", "policy", "--trace", str(path), "--policy", "fcfs", COLUMNS="300")
        assert out.returncode == 2, out.stderr[-1500:]
        text = " ".join(out.stderr.replace("│", " ").split())
        assert f"Invalid value for --trace: {path}: {words}" in text, text
        no_traceback(out)


def test_a_chat_prompt_that_is_not_utf8_is_named_before_sending() -> None:
    """Bytes that are not UTF-8 in the prompt argument (a Latin-1 terminal) went out as lone
    surrogates, and the edge answered "invalid_json: frame is not valid JSON", blaming a frame
    the user never wrote. The CLI refuses them itself now (no edge needed: nothing is sent)."""
    out = subprocess.run([sys.executable, "-m", "lanes.cli.main", "chat", "--url", "ws://127.0.0.1:1/v1/chat",
                          b"caf\xe9"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-1500:]
    assert out.stderr.strip().splitlines() == [
        "configuration error: the prompt is not UTF-8 text (byte 0xe9 at character 3): pass UTF-8 text (a "
        "terminal in a UTF-8 locale, such as LANG=C.UTF-8, sends it)"]


def test_chat_mistakes_in_the_url_exit_2() -> None:
    """A URL that is not a WebSocket's, or whose host does not exist, is the user's to fix: exit 2
    (it was 1, the status of an edge that is not up yet, which a retry may get past)."""
    for url, words in (("http://127.0.0.1:1/v1/chat", "is not a WebSocket URL (--url): use ws://HOST:PORT/v1/chat"),
                       ("ws://no-such-host.invalid:1/v1/chat", "unknown host (--url)")):
        out = lanes("chat", "--url", url, "hello")
        assert out.returncode == 2, out.stderr[-1500:]
        assert out.stderr.strip().splitlines() == [f"configuration error: {url} {words}" if "WebSocket" in words
                                                   else f"configuration error: cannot connect to {url}: {words}"]
        no_traceback(out)


def test_a_hub_id_with_the_hub_out_of_reach_is_one_line_at_once(redis_url: str, tmp_path) -> None:
    """Online (HF_HUB_OFFLINE=0) with the hub out of reach, a model not in the cache took ~50 s
    of huggingface_hub's retries (22 warning lines), then the loader's "check your internet
    connection". Now one request to the hub, and one line that says it cannot be reached and
    what to do. (A refused port stands in for a machine without network: deterministic.)"""
    started = time.monotonic()
    out = lanes("worker", "--model", "example-org/not-cached-model", LANES_REDIS_URL=redis_url,
                HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:1", HF_HUB_CACHE=str(tmp_path), HF_HOME=str(tmp_path))
    assert out.returncode == 2, out.stderr[-2000:]
    assert time.monotonic() - started < 30
    assert out.stderr.strip().splitlines() == [
        f"configuration error: model example-org/not-cached-model is not in the Hugging Face cache ({tmp_path}) "
        "and the hub at http://127.0.0.1:1 cannot be reached ([Errno 111] Connection refused) (--model / "
        "LANES_MODEL): download it where the hub is reachable (`hf download example-org/not-cached-model`) and "
        "copy the cache to this machine, point HF_ENDPOINT at a mirror you can reach, or give a local model "
        "directory"], out.stderr[-2000:]


def test_a_tls_url_to_a_redis_without_tls_is_named_as_such(redis_url: str) -> None:
    """``rediss://`` to a plain Redis waited 5 s and said "no answer", which now exits 1 as an
    outage would (restarted for good). A plain PING at the same address tells them apart: a
    configuration error (2) that says to use redis://."""
    url = redis_url.replace("redis://", "rediss://", 1)
    out = lanes("scheduler", LANES_REDIS_URL=url)
    assert out.returncode == 2, out.stderr[-1500:]
    assert out.stderr.strip().splitlines() == [
        f"configuration error: Redis at {url} does not speak TLS: it answered a plain PING (LANES_REDIS_URL): "
        "use redis://, or turn TLS on in that Redis (tls-port)"]
