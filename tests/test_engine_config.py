"""Settings → vLLM / TensorRT-LLM arguments, and the validation that fails fast on bad combos.

Pure: no engine package needed. Where ``vllm`` / ``tensorrt_llm`` are importable, the kwargs are
also checked against the real classes' signatures.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest

from lanes.queue.messages import ChatMessage, FinishReason
from lanes.workers.engines.base import EngineRequest
from lanes.workers.engines.engine_config import (
    ENGINE_QUEUE_MARGIN, ClassSpec, ConfigError, SpecCounters, filter_supported,
    map_finish_reason, remaining_tokens, supported_names, trtllm_llm_kwargs,
    trtllm_sampling_kwargs, validate, vllm_engine_kwargs, vllm_sampling_kwargs,
)
from lanes.workers.settings import WorkerSettings


def settings(**kw: Any) -> WorkerSettings:
    return WorkerSettings(_env_file=None, **{"model": "/models/m", **kw})


def installed(_: str) -> bool:
    return True


def missing(_: str) -> bool:
    return False


def request(**kw: Any) -> EngineRequest:
    return EngineRequest(id="r", messages=(ChatMessage("user", "hi"),), max_tokens=100, **kw)


@pytest.mark.parametrize("kw, fragment", [
    ({"engine": "vllm", "spec_method": "draft_model"}, "needs a draft model"),
    ({"engine": "trtllm", "spec_method": "eagle3"}, "needs a draft model"),
    ({"engine": "hf", "spec_method": "eagle", "draft_model": "d"}, "cannot run spec_method=eagle"),
    ({"engine": "trtllm", "spec_method": "eagle", "draft_model": "d"}, "EAGLE-3 draft heads only"),
    ({"engine": "hf", "spec_method": "mtp"}, "cannot run spec_method=mtp"),
    ({"engine": "hf", "quantization": "awq"}, "does not load awq"),
    ({"engine": "vllm", "spec_method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
    ({"engine": "vllm", "max_num_batched_tokens": 4, "max_slots": 8}, ">= max_slots"),
    ({"engine": "sim", "max_num_batched_tokens": 4, "max_slots": 8}, ">= max_slots"),
])
def test_validate_rejects_bad_combinations(kw: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        validate(settings(**kw), is_installed=installed)


@pytest.mark.parametrize("engine", ["vllm", "trtllm"])
def test_validate_names_the_extra_to_install(engine: str) -> None:
    """In the checkout (PyPI's ``lanes`` is an unrelated package: ``pip install 'lanes[vllm]'``
    outside this checkout's venv would fetch it)."""
    with pytest.raises(ConfigError) as refused:
        validate(settings(engine=engine), is_installed=missing)
    assert f"pip install -e '.[{engine}]' in the lanes checkout" in str(refused.value)


@pytest.mark.parametrize("kw", [
    {"engine": "hf"}, {"engine": "hf", "spec_method": "prompt_lookup"},
    {"engine": "hf", "spec_method": "draft_model", "draft_model": "d"},
    {"engine": "vllm", "spec_method": "mtp"}, {"engine": "vllm", "quantization": "awq"},
    {"engine": "trtllm", "spec_method": "eagle3", "draft_model": "e", "quantization": "awq"},
])
def test_validate_accepts_good_combinations(kw: dict[str, Any]) -> None:
    validate(settings(**kw), is_installed=installed)


def test_vllm_defaults_priority_chunked_prefill_and_capped_queue() -> None:
    kw = vllm_engine_kwargs(settings(engine="vllm", max_slots=12))
    assert kw["scheduling_policy"] == "priority" and kw["enable_chunked_prefill"] is True
    assert kw["max_num_seqs"] == 12 and kw["max_num_batched_tokens"] == 2048
    assert kw["max_num_queued_reqs"] == 12 + ENGINE_QUEUE_MARGIN
    assert kw["kv_cache_dtype"] == "auto" and kw["gpu_memory_utilization"] == 0.9
    assert "quantization" not in kw and "speculative_config" not in kw
    assert "max_model_len" not in kw


def test_vllm_quantization_and_kv_cache() -> None:
    kw = vllm_engine_kwargs(settings(quantization="awq", kv_cache_quantization=True,
                                     max_model_len=4096))
    # An explicit "awq" would force vLLM's slow AWQ kernel: the checkpoint says awq itself.
    assert "quantization" not in kw and kw["kv_cache_dtype"] == "fp8"
    assert kw["max_model_len"] == 4096
    assert vllm_engine_kwargs(settings(quantization="fp8"))["quantization"] == "fp8"
    assert vllm_engine_kwargs(settings(quantization="fp8"), "")["quantization"] == "fp8", "16-bit: vLLM quantizes"
    # Already FP8 (compressed-tensors, fbgemm_fp8, ModelOpt): vLLM reads the checkpoint's own
    # method, and refuses an explicit "fp8" beside compressed-tensors ("does not match").
    assert "quantization" not in vllm_engine_kwargs(settings(quantization="fp8"), "fp8")


def test_vllm_enforce_eager_is_passed_through() -> None:
    assert vllm_engine_kwargs(settings())["enforce_eager"] is False
    assert vllm_engine_kwargs(settings(enforce_eager=True))["enforce_eager"] is True


def test_fit_max_tokens_clamps_to_the_sequence_limit_and_rejects_what_cannot_fit() -> None:
    from lanes.workers.engines.base import RequestRejected
    from lanes.workers.engines.engine_config import fit_max_tokens, max_sequence_tokens

    assert fit_max_tokens(100, 50, None) == 50
    assert fit_max_tokens(100, 50, 1024) == 50
    assert fit_max_tokens(1000, 50, 1024) == 24
    with pytest.raises(RequestRejected, match="prompt has 1024 tokens"):
        fit_max_tokens(1024, 50, 1024)
    assert max_sequence_tokens(0, None, 2048) == 2048 and max_sequence_tokens(512, 4096, 2048) == 512
    assert max_sequence_tokens(0, None, None) is None


@pytest.mark.parametrize("kw, expected", [
    ({"spec_method": "ngram"}, {"method": "ngram", "num_speculative_tokens": 4,
                                "prompt_lookup_max": 4, "prompt_lookup_min": 1}),
    ({"spec_method": "prompt_lookup", "num_speculative_tokens": 3},
     {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
      "prompt_lookup_min": 1}),
    ({"spec_method": "draft_model", "draft_model": "/d"},
     {"method": "draft_model", "num_speculative_tokens": 4, "model": "/d"}),
    ({"spec_method": "eagle3", "draft_model": "/e"},
     {"method": "eagle3", "num_speculative_tokens": 4, "model": "/e"}),
    ({"spec_method": "mtp", "num_speculative_tokens": 1},
     {"method": "mtp", "num_speculative_tokens": 1}),
])
def test_vllm_speculative_config(kw: dict[str, Any], expected: dict[str, Any]) -> None:
    assert vllm_engine_kwargs(settings(**kw))["speculative_config"] == expected


def test_trtllm_kwargs_as_data() -> None:
    kw = trtllm_llm_kwargs(settings(engine="trtllm", max_slots=6, max_num_batched_tokens=1024))
    assert kw["max_batch_size"] == 6 and kw["max_num_tokens"] == 1024
    assert kw["kv_cache_config"] == ClassSpec("KvCacheConfig", {
        "dtype": "auto", "free_gpu_memory_fraction": 0.9, "enable_block_reuse": True})
    assert kw["scheduler_config"].optional and "speculative_config" not in kw
    fp8 = trtllm_llm_kwargs(settings(kv_cache_quantization=True, quantization="awq"))
    assert fp8["kv_cache_config"].kwargs["dtype"] == "fp8" and "quantization" not in fp8


@pytest.mark.parametrize("kw, class_name, fields", [
    ({"spec_method": "draft_model", "draft_model": "/d"}, "DraftTargetDecodingConfig",
     {"max_draft_len": 4, "speculative_model": "/d"}),
    ({"spec_method": "eagle3", "draft_model": "/e"}, "Eagle3DecodingConfig",
     {"max_draft_len": 4, "speculative_model": "/e"}),
    ({"spec_method": "ngram"}, "NGramDecodingConfig",
     {"max_draft_len": 4, "max_matching_ngram_size": 2, "is_public_pool": False}),
    ({"spec_method": "mtp", "num_speculative_tokens": 2}, "MTPDecodingConfig",
     {"num_nextn_predict_layers": 2}),
])
def test_trtllm_speculative_config(kw: dict[str, Any], class_name: str,
                                   fields: dict[str, Any]) -> None:
    spec = trtllm_llm_kwargs(settings(**kw))["speculative_config"]
    assert (spec.class_name, dict(spec.kwargs)) == (class_name, fields)


def test_sampling_kwargs_subtract_resumed_tokens() -> None:
    req = request(temperature=0.0, stop=("\n\n",), seed=3, resume_token_ids=(1, 2, 3))
    assert remaining_tokens(req) == 97
    assert vllm_sampling_kwargs(req) == {"max_tokens": 97, "temperature": 0.0, "top_p": 1.0,
                                         "seed": 3}, "stop strings are cut by the adapter"
    trt = trtllm_sampling_kwargs(req)
    assert trt["top_k"] == 1 and "temperature" not in trt and trt["max_tokens"] == 97
    assert "stop" not in trt and trt["detokenize"] is False, "the adapter cuts stop strings and detokenizes"
    assert trtllm_sampling_kwargs(request(temperature=0.7))["temperature"] == 0.7
    assert remaining_tokens(request(resume_token_ids=tuple(range(150)))) == 0


@pytest.mark.parametrize("raw, ours", [
    (None, None), ("stop", FinishReason.STOP), ("length", FinishReason.LENGTH),
    ("abort", FinishReason.CANCELLED), ("cancelled", FinishReason.CANCELLED),
    ("error", FinishReason.ERROR), ("timeout", FinishReason.ERROR),
    ("repetition", FinishReason.STOP), ("something-new", FinishReason.ERROR),
])
def test_finish_reason_mapping(raw: str | None, ours: FinishReason | None) -> None:
    assert map_finish_reason(raw) == ours


def test_filter_supported_by_dataclass_and_signature() -> None:
    @dataclasses.dataclass
    class Args:
        model: str = ""
        max_num_seqs: int = 1

    def func(model: str, dtype: str = "auto") -> None: ...

    kept, dropped = filter_supported({"model": "m", "max_num_queued_reqs": 3},
                                     supported_names(Args))
    assert kept == {"model": "m"} and dropped == ["max_num_queued_reqs"]
    assert supported_names(func) == {"model", "dtype"}


def test_spec_counters_rates() -> None:
    counters = SpecCounters()
    assert counters.as_dict()["spec_acceptance_rate"] == 0.0
    counters.observe(2, 8, 6)
    out = counters.as_dict()
    assert out["spec_acceptance_rate"] == 0.75 and out["spec_mean_acceptance_length"] == 4.0


# ---- against the real classes, where installed -------------------------------------------

has_vllm = importlib.util.find_spec("vllm") is not None
has_trtllm = importlib.util.find_spec("tensorrt_llm") is not None
#: Engine args that only newer releases have; the adapter drops them elsewhere.
VERSION_DEPENDENT = {"max_num_queued_reqs"}


@pytest.mark.skipif(not has_vllm, reason="vllm not installed")
def test_vllm_kwargs_match_real_signatures() -> None:
    from vllm import SamplingParams
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kw = vllm_engine_kwargs(settings(spec_method="draft_model", draft_model="/d",
                                     quantization="awq", max_model_len=4096))
    assert set(kw) - VERSION_DEPENDENT <= supported_names(AsyncEngineArgs)
    assert set(kw["speculative_config"]) <= supported_names(SpeculativeConfig)
    ngram = vllm_engine_kwargs(settings(spec_method="ngram"))["speculative_config"]
    assert set(ngram) <= supported_names(SpeculativeConfig)
    SamplingParams(**vllm_sampling_kwargs(request(temperature=0.5)))


@pytest.mark.skipif(not has_trtllm, reason="tensorrt_llm not installed")
def test_trtllm_kwargs_match_real_classes() -> None:
    import tensorrt_llm
    from tensorrt_llm import llmapi

    from lanes.workers.engines.trtllm import build_llm_kwargs

    for kw in ({"spec_method": "draft_model", "draft_model": "/d"}, {"spec_method": "ngram"},
               {"spec_method": "mtp"}, {"spec_method": "eagle3", "draft_model": "/e"}):
        built = build_llm_kwargs(trtllm_llm_kwargs(settings(**kw)), llmapi)
        assert built["kv_cache_config"].dtype == "auto"
        assert built["speculative_config"] is not None
    names = supported_names(tensorrt_llm.SamplingParams)
    kept, _ = filter_supported(trtllm_sampling_kwargs(request(temperature=0.0)), names)
    tensorrt_llm.SamplingParams(**kept)


def test_a_checkpoint_that_quantizes_the_kv_cache_is_refused_unless_asked(tmp_path) -> None:
    """Weights only by default: a ModelOpt checkpoint declaring an FP8 KV cache would get one
    from either engine (both adopt it at kv_cache_dtype "auto"), so it needs the setting."""
    import json

    from lanes.workers.engines.engine_config import (
        checkpoint_kv_cache_quant, read_checkpoint_files, refuse_kv_cache_quant,
    )

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    files = read_checkpoint_files(str(tmp_path))
    assert checkpoint_kv_cache_quant(files) == ("FP8", "hf_quant_config.json: quantization.kv_cache_quant_algo")
    settings = WorkerSettings(_env_file=None, engine="hf", model=str(tmp_path))
    with pytest.raises(ConfigError, match="LANES_KV_CACHE_QUANTIZATION=true"):
        refuse_kv_cache_quant(settings, files)
    refuse_kv_cache_quant(settings.model_copy(update={"kv_cache_quantization": True}), files)
    weights_only = {"config.json": {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                                                            "kv_cache_quant_algo": None}}}
    assert checkpoint_kv_cache_quant(weights_only) is None
    assert checkpoint_kv_cache_quant({"config.json": {"quantization_config": {"quant_method": "awq"}}}) is None
    assert checkpoint_kv_cache_quant(read_checkpoint_files("")) is None, "the demo model"


@pytest.mark.parametrize("quantization_config, where", [
    # What vLLM's get_kv_cache_quant_algo_string reads (vllm/utils/torch_utils.py): a scheme as
    # ModelOpt and llm-compressor write it into config.json, flat or under "quantization".
    ({"quant_method": "modelopt", "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}},
     "quantization_config.kv_cache_scheme"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}},
     "quantization_config.quantization.kv_cache_quant_algo"),
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
     "quantization_config.kv_cache_scheme"),
])
def test_every_place_a_checkpoint_declares_a_quantized_kv_cache_is_read(quantization_config, where) -> None:
    """Only the flat ``kv_cache_quant_algo`` and hf_quant_config.json were read: a checkpoint
    declaring its FP8 cache as a ``kv_cache_scheme`` got one from vLLM at "auto", unasked."""
    from lanes.workers.engines.engine_config import checkpoint_kv_cache_quant

    found = checkpoint_kv_cache_quant({"config.json": {"quantization_config": quantization_config}})
    assert found is not None and found[1] == f"config.json: {where}"


@pytest.mark.parametrize("files, found", [
    ({"config.json": {"model_type": "llama"}}, ""),
    ({"config.json": {"quantization_config": {"quant_method": "awq", "bits": 4}}}, "awq"),
    ({"config.json": {"quantization_config": {"quant_method": "fp8"}}}, "fp8"),
    ({"config.json": {"quantization_config": {"quant_method": "gptq", "bits": 4}}}, "awq"),  # any 4-bit weights
    ({"config.json": {"quantization_config": {"quant_method": "gptq", "bits": 8}}}, "gptq"),
    ({"config.json": {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}}, "awq"),
    ({"config.json": {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}}, "awq"),
    ({"config.json": {"quantization_config": {"quant_method": "fbgemm_fp8"}}}, "fp8"),
    ({"config.json": {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "int"}}}}}}, "awq"),
    ({"config.json": {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float"}}}}}}, "fp8"),
    ({"config.json": {"model_type": "llama"}, "hf_quant_config.json": {"quantization": {"quant_algo": "W4A16_AWQ"}}},
     "awq"),
    ({"config.json": {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}}, "fp8"),
    ({"config.json": None}, None),
])
def test_the_weights_a_checkpoint_declares(files, found) -> None:
    from lanes.workers.engines.engine_config import checkpoint_weight_quant

    assert checkpoint_weight_quant(files) == found


def test_a_quantization_the_checkpoint_does_not_hold_is_refused() -> None:
    """LANES_QUANTIZATION=awq on a 16-bit checkpoint ran it unquantized, with no word, on both
    engines (and fp8 on TensorRT-LLM, whose PyTorch backend does not quantize at load)."""
    from lanes.workers.engines.engine_config import refuse_weight_quant_mismatch

    plain = {"config.json": {"model_type": "llama"}}
    awq = {"config.json": {"quantization_config": {"quant_method": "awq"}}}
    fp8 = {"config.json": {"quantization_config": {"quant_method": "fp8"}}}

    def check(quantization: str, files: dict, itself: bool) -> None:
        settings = WorkerSettings(_env_file=None, engine="vllm", model="m", quantization=quantization)
        refuse_weight_quant_mismatch(settings, files, engine="vllm" if itself else "trtllm")

    awq = {"config.json": {"quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A16_AWQ"}}}
    gptq = {"config.json": {"quantization_config": {"quant_method": "gptq", "bits": "4"}}}
    check("awq", gptq, True)  # vLLM runs GPTQ as gptq_marlin
    with pytest.raises(ConfigError, match="TensorRT-LLM's PyTorch backend loads unquantized"):
        check("awq", gptq, False)  # TensorRT-LLM reads ModelOpt and compressed-tensors only
    legacy = {"config.json": {"compression_config": {"quant_method": "compressed-tensors", "config_groups": {
        "g": {"weights": {"num_bits": 8, "type": "float"}}}}}}
    check("fp8", legacy, False)  # the older key of the same section
    for itself in (True, False):
        with pytest.raises(ConfigError, match="LANES_QUANTIZATION=awq, but the checkpoint m holds unquantized"):
            check("awq", plain, itself)
        with pytest.raises(ConfigError, match="holds fp8 weights"):
            check("awq", fp8, itself)
        check("awq", awq, itself)
        check("fp8", fp8, itself)
        check("none", awq, itself)  # none runs any checkpoint as it is
        check("awq", {"config.json": None}, itself)  # unreadable: nothing to go on, the engine says
    check("fp8", plain, True)  # vLLM quantizes to FP8 as it loads
    with pytest.raises(ConfigError, match="LANES_QUANTIZATION=fp8, but the checkpoint m holds unquantized"):
        check("fp8", plain, False)


def test_a_dtype_neither_gpu_engine_takes_is_refused_at_start() -> None:
    """``LANES_DTYPE=float13`` was passed on as it was: vLLM and TensorRT-LLM refused it only
    once the model loaded, and the ``hf`` engine never read it."""
    from pydantic import ValidationError

    from lanes.cli.failures import settings_error

    with pytest.raises(ValidationError) as refused:
        settings(dtype="float13")
    assert "LANES_DTYPE='float13': Value error, use one of auto, float16, bfloat16, float32" in (
        settings_error(refused.value) or "")
    assert [settings(dtype=d).dtype for d in ("auto", "float16", "bfloat16", "float32")] == [
        "auto", "float16", "bfloat16", "float32"]


def test_the_engine_extras_stop_before_the_release_line_nobody_checked() -> None:
    """``vllm>=0.11`` and ``tensorrt-llm>=1.0`` took any later release, unpublished ones too,
    while the adapters were checked against stand-ins of vLLM 0.11 and a 2026 main (0.33 the
    newest release then) and of TensorRT-LLM 1.x only. README states the same bounds."""
    import tomllib
    from pathlib import Path

    from fake_vllm import V0_11
    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    vllm, trtllm = Requirement(extras["vllm"][0]), Requirement(extras["trtllm"][0])
    assert V0_11 in vllm.specifier and "0.11.0" in vllm.specifier
    assert "0.29.0" in vllm.specifier and "0.33.1" in vllm.specifier
    assert "0.34.0" not in vllm.specifier and "1.0.0" not in vllm.specifier
    assert "1.0.0" in trtllm.specifier and "1.2.1" in trtllm.specifier and "2.0.0" not in trtllm.specifier
    readme = (root / "README.md").read_text()
    assert f"`{extras['vllm'][0]}`" in readme and f"`{extras['trtllm'][0]}`" in readme
