"""Pure translation from our settings and requests to vLLM / TensorRT-LLM arguments.

Everything here is plain data in, plain data out: no vllm, tensorrt_llm or torch import, so
the whole mapping is unit-tested on a CPU machine. The adapters (``vllm.py``, ``trtllm.py``)
turn the data into real objects at start-up and drop arguments the installed version lacks
(``filter_supported``), so one settings object works across engine releases.

Bad settings raise ``ConfigError`` (defined in ``base.py``, re-exported here).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lanes.queue.messages import FinishReason
from lanes.workers.engines.base import ConfigError, EngineRequest, RequestRejected
from lanes.workers.settings import WorkerSettings

#: Requests the engine may hold beyond ``max_slots``: the worker feeds only free slots, so the
#: engine queue stays short and the backlog stays in Redis where we can reorder it.
ENGINE_QUEUE_MARGIN = 2
#: Longest n-gram vLLM's prompt lookup matches (``prompt_lookup_max``).
NGRAM_LOOKUP_MAX = 4
#: Longest n-gram TRT-LLM's NGram drafter matches (``max_matching_ngram_size``).
NGRAM_MATCH_MAX = 2

_PACKAGES = {"vllm": ("vllm", ".[vllm]"), "trtllm": ("tensorrt_llm", ".[trtllm]")}
_NEEDS_DRAFT = ("draft_model", "eagle", "eagle3")
#: Draft-model speculation in vLLM V1 lives here (vllm-project/vllm PR #24322). Releases
#: without it (0.10 to at least 0.13) raise NotImplementedError for ``method=draft_model``
#: deep inside engine start-up, so ``validate`` asks for this module instead.
VLLM_DRAFT_MODEL_MODULE = "vllm.v1.spec_decode.draft_model"


@dataclass(frozen=True)
class ClassSpec:
    """A config object as data: the class name in ``tensorrt_llm.llmapi`` and its kwargs.

    ``fallbacks`` name older classes to try, in order, when ``class_name`` is missing.
    """

    class_name: str
    kwargs: Mapping[str, Any]
    fallbacks: tuple[str, ...] = ()
    #: Build nothing (rather than fail) when the installed version has none of the classes.
    optional: bool = False


def _module_available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing or not a package
        return False


def spec_enabled(settings: WorkerSettings) -> bool:
    return settings.spec_method != "none"


def _package_version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "?"


def validate(
    settings: WorkerSettings, *, is_installed: Callable[[str], bool] = _module_available,
    package_version: Callable[[str], str] = _package_version,
) -> None:
    """Raise ``ConfigError`` naming the fix for settings that cannot work.

    ``is_installed`` answers whether a module can be imported and ``package_version`` gives
    an installed distribution's version (both injected by tests).
    """
    method, engine = settings.spec_method, settings.engine
    if engine in _PACKAGES:
        module, extra = _PACKAGES[engine]
        if not is_installed(module):
            raise ConfigError(
                f"engine={engine} needs the {module} package, which is not installed: "
                f"pip install -e '{extra}' in the lanes checkout (on a machine with an NVIDIA GPU)"
            )
    if engine == "vllm" and method == "draft_model" and not is_installed(VLLM_DRAFT_MODEL_MODULE):
        raise ConfigError(
            f"vLLM {package_version('vllm')} cannot run spec_method=draft_model (it raises "
            "NotImplementedError; draft models came back to vLLM V1 in a later release): use "
            "--spec-method ngram, eagle, eagle3 or mtp, upgrade vLLM, or use --engine trtllm"
        )
    if method in _NEEDS_DRAFT and not settings.draft_model:
        raise ConfigError(f"spec_method={method} needs a draft model: set LANES_DRAFT_MODEL")
    if method != "none" and settings.num_speculative_tokens < 1:
        raise ConfigError("num_speculative_tokens must be >= 1 when speculation is on")
    if engine == "hf" and method in ("eagle", "eagle3", "mtp"):
        raise ConfigError(
            f"the hf engine cannot run spec_method={method}; use draft_model or "
            "prompt_lookup, or the vllm/trtllm engine"
        )
    if engine == "trtllm" and method == "eagle":
        raise ConfigError(
            "TensorRT-LLM's PyTorch backend runs EAGLE-3 draft heads only (its EagleDecodingConfig "
            "selects an EAGLE3 mode, llmapi/llm_args.py): use --spec-method eagle3 with an EAGLE-3 "
            "head, or engine=vllm for an EAGLE-1 head"
        )
    if engine == "hf" and settings.quantization != "none":
        raise ConfigError(
            f"the hf engine does not load {settings.quantization} checkpoints here; "
            "use engine=vllm or engine=trtllm"
        )
    if settings.chunks_prefill and settings.max_num_batched_tokens < settings.max_slots:
        raise ConfigError(
            f"max_num_batched_tokens ({settings.max_num_batched_tokens}) must be >= max_slots ({settings.max_slots}): "
            "with chunked prefill every running request decodes a token in each step; raise "
            "LANES_MAX_NUM_BATCHED_TOKENS (default 2048) or lower LANES_MAX_SLOTS"
        )


#: Files where a checkpoint may declare a quantized KV cache: ``config.json``'s
#: ``quantization_config`` and ModelOpt's ``hf_quant_config.json`` (``quantization``).
_QUANT_FILES = (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization"))


def _kv_scheme_name(value: object) -> str | None:
    """A declared KV-cache quantization as a name (``FP8``, ``float8``...), None when none."""
    if isinstance(value, Mapping) and value:  # compressed-tensors / ModelOpt ``kv_cache_scheme``
        return f"{value.get('type', '?')}{value.get('num_bits', '?')}"
    if isinstance(value, str) and value.strip() and value.strip().lower() not in ("none", "auto"):
        return value.strip()
    return None


def checkpoint_kv_cache_quant(files: Mapping[str, Mapping[str, Any] | None]) -> tuple[str, str] | None:
    """The KV-cache quantization a checkpoint declares, with where it says so
    (``hf_quant_config.json: quantization.kv_cache_quant_algo``), from its parsed JSON files by
    name; None when it declares none.

    Both engines adopt it when given ``kv_cache_dtype="auto"``: vLLM
    (``vllm/utils/torch_utils.py``, ``get_kv_cache_quant_algo_string`` via
    ``resolve_kv_cache_dtype_string``, which reads ``kv_cache_scheme`` or
    ``kv_cache_quant_algo`` in ``quantization_config`` or in its nested ``quantization``) and
    TensorRT-LLM (``llmapi/llm_utils.py``, ``ModelLoader._update_from_hf_quant_config``, which
    lets no other dtype override it). Every one of those places is read here, whatever the
    ``quant_method``: a declared KV-cache scheme is refused rather than guessed about."""
    for name, section in _QUANT_FILES:
        quant = (files.get(name) or {}).get(section)
        if not isinstance(quant, Mapping):
            continue
        nested = quant.get("quantization")
        places = [(f"{section}.quantization", nested)] if isinstance(nested, Mapping) else []
        for where, block in [*places, (section, quant)]:
            for key in ("kv_cache_scheme", "kv_cache_quant_algo"):
                if (algo := _kv_scheme_name(block.get(key))) is not None:
                    return algo, f"{name}: {where}.{key}"
    return None


def refuse_kv_cache_quant(settings: WorkerSettings, files: Mapping[str, Mapping[str, Any] | None]) -> None:
    """``ConfigError`` when the checkpoint quantizes the KV cache and the settings do not ask for
    it: lanes quantizes weights only unless told (``LANES_KV_CACHE_QUANTIZATION``), and neither
    engine can be told to keep such a checkpoint's cache unquantized."""
    if settings.kv_cache_quantization or (found := checkpoint_kv_cache_quant(files)) is None:
        return
    algo, where = found
    raise ConfigError(
        f"the checkpoint {settings.model} quantizes the KV cache ({where}={algo}), "
        "which the engine would adopt; lanes quantizes weights only unless asked: set "
        "LANES_KV_CACHE_QUANTIZATION=true to run it so, or use a checkpoint without a quantized KV cache"
    )


def checkpoint_weight_quant(files: Mapping[str, Mapping[str, Any] | None]) -> str | None:
    """How a checkpoint's weights are quantized, as ``awq`` (any 4-bit weights the engines run
    as they find them, what ``LANES_QUANTIZATION=awq`` asks for: AutoAWQ, GPTQ, compressed-tensors
    int4, bitsandbytes 4-bit, ModelOpt ``W4A16_AWQ`` / ``W4A8_AWQ`` / ``NVFP4``), ``fp8``, another
    method's name, or ``""`` for none; None when its ``config.json`` could not be read."""
    modelopt = (files.get("hf_quant_config.json") or {}).get("quantization")
    config = files.get("config.json")
    quant = _quantization_config(config)
    algos = [block.get("quant_algo") for block in (modelopt, quant, (quant or {}).get("quantization"))
             if isinstance(block, Mapping)]
    algo = next((a for a in algos if isinstance(a, str) and a.strip()), None)
    if algo is not None:  # ModelOpt: W4A16_AWQ, W4A8_AWQ, FP8, NVFP4...
        upper = algo.upper()
        return "awq" if upper.startswith(("W4", "NVFP4")) or "AWQ" in upper else \
            "fp8" if upper.startswith("FP8") else algo.lower()
    if not isinstance(quant, Mapping):
        return None if config is None else ""
    method = str(quant.get("quant_method", "")).lower()
    if method in ("awq", "awq_marlin") or (method in ("gptq", "gptq_marlin") and str(quant.get("bits", 4)) == "4"):
        return "awq"
    if method == "bitsandbytes" and quant.get("load_in_4bit"):
        return "awq"
    if method in ("fp8", "fbgemm_fp8"):
        return "fp8"
    if method == "compressed-tensors":  # llm-compressor's output, its AWQ and FP8 recipes included
        groups = quant.get("config_groups")
        weights = [g.get("weights") for g in groups.values() if isinstance(g, Mapping)] if isinstance(groups, Mapping) else []
        kinds = {(w.get("type"), w.get("num_bits")) for w in weights if isinstance(w, Mapping)}
        if ("int", 4) in kinds:
            return "awq"
        if ("float", 8) in kinds:
            return "fp8"
    return method or "unknown"


def _quantization_config(config: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``config.json``'s quantization section (``compression_config``: its older name, which
    vLLM still reads as the checkpoint's method)."""
    if not isinstance(config, Mapping):
        return None
    quant = config.get("quantization_config") or config.get("compression_config")
    return quant if isinstance(quant, Mapping) else None


#: Checkpoint quantization TensorRT-LLM's PyTorch backend reads (``ModelConfig.load_hf_quant_config``:
#: ModelOpt's hf_quant_config.json, or these ``quant_method``s in config.json); it loads any other
#: (GPTQ, AutoAWQ, bitsandbytes) with no quantization at all.
TRTLLM_QUANT_METHODS = ("modelopt", "compressed-tensors", "fp8", "mxfp4", "mxfp8", "nvfp4")


def _trtllm_reads(files: Mapping[str, Mapping[str, Any] | None]) -> bool:
    if isinstance((files.get("hf_quant_config.json") or {}).get("quantization"), Mapping):
        return True
    quant = _quantization_config(files.get("config.json"))
    return quant is not None and str(quant.get("quant_method", "")).lower() in TRTLLM_QUANT_METHODS


def refuse_weight_quant_mismatch(settings: WorkerSettings, files: Mapping[str, Mapping[str, Any] | None], *,
                                 engine: str, found: str | None = None) -> None:
    """``ConfigError`` when ``LANES_QUANTIZATION`` asks for weights the checkpoint does not hold,
    or holds in a format ``engine`` does not read: neither engine quantizes to 4 bits at load,
    TensorRT-LLM's PyTorch backend does not to FP8 either (vLLM does) and reads ModelOpt and
    compressed-tensors checkpoints only, so the setting alone would run the checkpoint as it
    is, unquantized, with no word."""
    wanted = settings.quantization
    if found is None:
        found = checkpoint_weight_quant(files)
    if wanted == "none" or found is None:
        return
    if found == wanted and (engine != "trtllm" or _trtllm_reads(files)):
        return
    if wanted == "fp8" and engine == "vllm" and found == "":
        return  # vLLM quantizes a 16-bit checkpoint to FP8 as it loads it
    if found == wanted:  # the right bits in a format TensorRT-LLM loads unquantized
        raise ConfigError(
            f"LANES_QUANTIZATION={wanted}: the checkpoint {settings.model} holds them as "
            f"{str((_quantization_config(files.get('config.json')) or {}).get('quant_method', '?'))}, which "
            "TensorRT-LLM's PyTorch backend loads unquantized: use a ModelOpt or compressed-tensors checkpoint "
            "(or engine=vllm)")
    held = ("4-bit weights" if found == "awq" else f"{found} weights") if found else "unquantized weights"
    how = {"awq": "4-bit weights (AutoAWQ, GPTQ, llm-compressor's W4A16 recipes, or ModelOpt W4A16_AWQ)",
           "fp8": "FP8 (llm-compressor or ModelOpt)"}[wanted]
    raise ConfigError(
        f"LANES_QUANTIZATION={wanted}, but the checkpoint {settings.model} holds {held} "
        f"(its config.json / hf_quant_config.json): the engine would run it as it is. Use a checkpoint "
        f"quantized to {how}, or set LANES_QUANTIZATION to match this one (none runs any checkpoint as it is)"
    )


def check_checkpoint_quant(settings: WorkerSettings, *, engine: str) -> str | None:
    """Both checks above on ``settings.model``'s files (read from its directory or the hub);
    returns ``checkpoint_weight_quant`` of them (for ``vllm_engine_kwargs``)."""
    files = read_checkpoint_files(settings.model)
    refuse_kv_cache_quant(settings, files)
    found = checkpoint_weight_quant(files)
    refuse_weight_quant_mismatch(settings, files, engine=engine, found=found)
    return found


def read_checkpoint_files(model: str) -> dict[str, dict[str, Any] | None]:
    """The checkpoint's files the checks above read: from a local directory, else
    from the Hugging Face hub (which the engine downloads from anyway); None where absent."""
    import json
    from pathlib import Path

    found: dict[str, dict[str, Any] | None] = {}
    if not model:  # the demo model
        return found
    for name, _ in _QUANT_FILES:
        path: Path | None = Path(model) / name
        if not Path(model).is_dir():
            try:
                from huggingface_hub import hf_hub_download

                path = Path(hf_hub_download(model, name))
            except Exception:  # noqa: BLE001 - absent, offline, gated: the engine reports those itself
                path = None
        try:
            loaded = json.loads(path.read_text()) if path is not None and path.is_file() else None
        except (OSError, ValueError):
            loaded = None
        found[name] = loaded if isinstance(loaded, dict) else None
    return found


def vllm_speculative_config(settings: WorkerSettings) -> dict[str, Any] | None:
    """``speculative_config`` for ``AsyncEngineArgs`` (keys of ``vllm/config/speculative.py``)."""
    method, k = settings.spec_method, settings.num_speculative_tokens
    if method == "none":
        return None
    if method in ("ngram", "prompt_lookup"):
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_max": NGRAM_LOOKUP_MAX, "prompt_lookup_min": 1}
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if settings.draft_model:  # mtp reads the target's own MTP layers unless given weights
        config["model"] = settings.draft_model
    return config


def vllm_engine_kwargs(settings: WorkerSettings, checkpoint_quant: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``vllm.engine.arg_utils.AsyncEngineArgs``; ``checkpoint_quant`` is
    what ``checkpoint_weight_quant`` found in the checkpoint (None: not known)."""
    kwargs: dict[str, Any] = {
        "model": settings.model,
        "dtype": settings.dtype,
        "max_num_seqs": settings.max_slots,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "enable_chunked_prefill": True,
        "scheduling_policy": "priority",
        # Counts waiting + running; only in newer releases (dropped elsewhere at start-up).
        "max_num_queued_reqs": settings.max_slots + ENGINE_QUEUE_MARGIN,
        "kv_cache_dtype": "fp8" if settings.kv_cache_quantization else "auto",
        "gpu_memory_utilization": settings.gpu_memory_fraction,
        "disable_log_stats": False,  # our stat logger reads running/waiting/kv/spec counters
        "enforce_eager": settings.enforce_eager,
    }
    if settings.max_model_len:
        kwargs["max_model_len"] = settings.max_model_len
    # An explicit quantization="awq" makes vLLM (0.11 and every release since, up to
    # ``AWQMarlinConfig.override_quantization_method`` today) keep the slow AWQ kernel; left
    # unset, vLLM reads ``awq`` from the checkpoint and upgrades it to ``awq_marlin``.
    # fp8 is asked of vLLM only for a 16-bit checkpoint (it quantizes as it loads). A checkpoint
    # already in FP8 (compressed-tensors, fbgemm_fp8, ModelOpt) names its own method, which vLLM
    # detects; an explicit "fp8" beside it is refused at start ("does not match").
    if settings.quantization == "fp8" and checkpoint_quant in ("", None):
        kwargs["quantization"] = "fp8"
    speculative = vllm_speculative_config(settings)
    if speculative is not None:
        kwargs["speculative_config"] = speculative
    return kwargs


def trtllm_speculative_config(settings: WorkerSettings) -> ClassSpec | None:
    """The TRT-LLM ``speculative_config`` as data (classes of ``llmapi/llm_args.py``)."""
    method, k, draft = settings.spec_method, settings.num_speculative_tokens, settings.draft_model
    if method == "none":
        return None
    if method in ("ngram", "prompt_lookup"):
        return ClassSpec("NGramDecodingConfig", {
            "max_draft_len": k, "max_matching_ngram_size": NGRAM_MATCH_MAX,
            "is_public_pool": False})  # a per-request pool: chats share little text
    if method == "draft_model":
        return ClassSpec("DraftTargetDecodingConfig",
                         {"max_draft_len": k, "speculative_model": draft})
    if method == "eagle3":  # "eagle" (EAGLE-1 heads) is refused by ``validate``: no PyTorch-backend mode
        return ClassSpec("Eagle3DecodingConfig", {"max_draft_len": k, "speculative_model": draft},
                         fallbacks=("EagleDecodingConfig",))
    assert method == "mtp", method
    return ClassSpec("MTPDecodingConfig", {"num_nextn_predict_layers": k})


def trtllm_llm_kwargs(settings: WorkerSettings) -> dict[str, Any]:
    """Keyword arguments for ``tensorrt_llm.LLM`` (PyTorch backend); ``ClassSpec`` values are
    built into ``tensorrt_llm.llmapi`` objects by the adapter.

    AWQ / FP8 weights come from a pre-quantized checkpoint whose method the PyTorch backend
    detects, so ``quantization`` adds no argument; the KV cache stays unquantized unless asked.
    """
    kwargs: dict[str, Any] = {
        "model": settings.model,
        "dtype": settings.dtype,
        "max_batch_size": settings.max_slots,
        "max_num_tokens": settings.max_num_batched_tokens,
        "enable_chunked_prefill": True,
        "kv_cache_config": ClassSpec("KvCacheConfig", {
            "dtype": "fp8" if settings.kv_cache_quantization else "auto",
            "free_gpu_memory_fraction": settings.gpu_memory_fraction,
            "enable_block_reuse": True}),
        # Priority queueing exists only in newer releases; elsewhere FCFS (Redis orders anyway).
        "scheduler_config": ClassSpec("SchedulerConfig", {"waiting_queue_policy": "priority"},
                                      optional=True),
    }
    if settings.max_model_len:
        kwargs["max_seq_len"] = settings.max_model_len
    speculative = trtllm_speculative_config(settings)
    if speculative is not None:
        kwargs["speculative_config"] = speculative
    return kwargs


def max_sequence_tokens(*candidates: int | None) -> int | None:
    """The first positive limit among ``candidates`` (our setting, the engine's resolved
    value, the model config's ``max_position_embeddings``); None when none is known."""
    return next((int(c) for c in candidates if c), None)


def fit_max_tokens(num_prompt_tokens: int, max_tokens: int, max_seq_len: int | None) -> int:
    """``max_tokens`` cut so that prompt + output fit in ``max_seq_len`` (the answer then
    ends with ``length``, as on the hf engine); raises ``RequestRejected`` for a prompt that
    leaves no room at all. TensorRT-LLM skips this check itself when chunked prefill is on
    (``BaseLLM._check_arguments``), and the request would fail later as a ``RequestError``.
    """
    if max_seq_len is None:
        return max_tokens
    if num_prompt_tokens >= max_seq_len:
        raise RequestRejected("prompt_too_long", f"prompt has {num_prompt_tokens} tokens; the "
                              f"engine takes {max_seq_len} (prompt + answer)")
    return min(max_tokens, max_seq_len - num_prompt_tokens)


def remaining_tokens(request: EngineRequest) -> int:
    """Tokens still to generate: a resumed request already streamed ``resume_token_ids``."""
    return max(0, request.max_tokens - len(request.resume_token_ids))


def vllm_sampling_kwargs(request: EngineRequest) -> dict[str, Any]:
    """``SamplingParams`` kwargs except ``output_kind`` (an enum the adapter adds).

    No ``stop``: the adapter cuts stop strings itself (``StopMatcher``). vLLM's detokenizer holds
    back the last ``max(len(stop)) - 1`` characters of every delta while it streams the tokens
    behind them (``vllm/v1/engine/detokenizer.py``, ``stop_buffer_length``), so an attempt handed
    back mid-answer would lose that text: the next attempt starts after those tokens."""
    return {"max_tokens": remaining_tokens(request), "temperature": request.temperature,
            "top_p": request.top_p, "seed": request.seed}


def trtllm_sampling_kwargs(request: EngineRequest, max_tokens: int | None = None) -> dict[str, Any]:
    """``tensorrt_llm.SamplingParams`` kwargs; greedy is ``top_k=1`` (no temperature 0).
    ``max_tokens`` overrides the request's (``fit_max_tokens``).

    No ``stop`` and no detokenizing: the adapter does both (``trtllm.StreamCursor``). TensorRT-LLM
    matches stop strings as token ids (``_handle_sequence``, ``FinishReason.STOP_WORDS``), then cuts
    their ids from ``token_ids`` after the first ones' text was streamed; its detokenizer starts
    a resumed attempt without the tokens before it."""
    tokens = remaining_tokens(request) if max_tokens is None else max_tokens
    kwargs: dict[str, Any] = {"max_tokens": tokens, "top_p": request.top_p, "seed": request.seed,
                              "detokenize": False}
    if request.temperature <= 0.0:
        kwargs["top_k"] = 1
    else:
        kwargs["temperature"] = request.temperature
    return kwargs


_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": FinishReason.STOP,            # eos or stop string (vLLM, TRT-LLM)
    "repetition": FinishReason.STOP,      # vLLM's repetition detector ended the text
    "length": FinishReason.LENGTH,
    "abort": FinishReason.CANCELLED,      # vLLM
    "cancelled": FinishReason.CANCELLED,  # TRT-LLM
    "error": FinishReason.ERROR,
    "timeout": FinishReason.ERROR,        # TRT-LLM per-request timeout
}


def map_finish_reason(raw: str | None) -> FinishReason | None:
    """An engine's finish-reason string as ours; None while running, ERROR if unknown."""
    if raw is None:
        return None
    return _FINISH_REASONS.get(str(raw).lower(), FinishReason.ERROR)


def supported_names(target: Any) -> frozenset[str]:
    """Field / parameter names a class or callable accepts (dataclass, pydantic, signature)."""
    import dataclasses
    import inspect

    if dataclasses.is_dataclass(target):
        return frozenset(f.name for f in dataclasses.fields(target))
    model_fields = getattr(target, "model_fields", None)
    if isinstance(model_fields, Mapping):
        names = set(model_fields)
        names.update(f.alias for f in model_fields.values() if getattr(f, "alias", None))
        return frozenset(names)
    return frozenset(inspect.signature(target).parameters)


def filter_supported(
    kwargs: Mapping[str, Any], names: Iterable[str]
) -> tuple[dict[str, Any], list[str]]:
    """Split ``kwargs`` into (those ``names`` accepts, the names dropped)."""
    allowed = set(names)
    kept = {k: v for k, v in kwargs.items() if k in allowed}
    return kept, sorted(set(kwargs) - allowed)


@dataclass
class SpecCounters:
    """Cumulative speculative-decoding counters, named like vLLM's ``spec_decode_*`` metrics."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def observe(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += num_drafts
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    def as_dict(self) -> dict[str, float]:
        """Counters plus acceptance rate (accepted / drafted) and mean acceptance length
        (tokens per verify step: 1 + accepted / drafts, vLLM's definition)."""
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        length = 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_acceptance_rate": rate, "spec_mean_acceptance_length": length, **self.extra}
