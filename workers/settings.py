"""The worker process's settings (env prefix ``LANES_``, overridden by CLI flags)."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Literal

from lanes.queue.keys import DEFAULT_POOL
from lanes.queue.settings import RedisSettings
from lanes.scheduler.live_policy import (
    DECODE_TOKEN_COST,
    DEFAULT_PREEMPTION,
    MAX_NUM_BATCHED_TOKENS,
    MAX_WAIT_MS,
    PREFILL_HEAVY_SHARE,
    STARVE_AFTER_MS,
    fcfs_below_ms_for,
    lanes_slot_config,
    wait_bound_ms,
)
from lanes.scheduler.policy import SlotConfig
from lanes.scheduler.preemption import PreemptionConfig
from lanes.scheduler.workmix import MAX_KEY_SHARE as PREFILL_SHARE_MAX_KEY_SHARE
from pydantic import Field, field_validator, model_validator

EngineName = Literal["hf", "vllm", "trtllm", "sim"]
#: The engines whose adapters always turn chunked prefill on (``engines/engine_config.py``);
#: the ``sim`` engine models it unless ``sim_chunked_prefill`` is off.
CHUNKED_PREFILL_ENGINES = ("vllm", "trtllm")
#: The weights dtypes both GPU engines take (``engine_config.py`` passes the string on as it is).
DTYPES = ("auto", "float16", "bfloat16", "float32")
SpecMethod = Literal["none", "draft_model", "ngram", "prompt_lookup", "eagle", "eagle3", "mtp"]


class WorkerSettings(RedisSettings):
    #: The model pool this worker serves: it claims only that pool's lanes (``LANES_POOL``).
    pool: str = Field(DEFAULT_POOL, pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    #: Set by honcho for each process (``worker.3``); gives ``gpu_index`` (2) when unset.
    honcho_process_name: str = Field("", validation_alias="HONCHO_PROCESS_NAME")
    engine: EngineName = "hf"
    #: A local Hugging Face model directory or a hub id; empty = the shipped demo model.
    model: str = ""
    #: Draft model directory/id for ``spec_method=draft_model`` (and eagle heads).
    draft_model: str = ""
    spec_method: SpecMethod = "none"
    num_speculative_tokens: int = Field(4, ge=0)
    #: ``none``, ``awq`` (INT4 weights of a pre-quantized AWQ checkpoint) or ``fp8``. vLLM and
    #: TensorRT-LLM read an AWQ checkpoint's method from its config, so ``awq`` passes no
    #: argument to them (vLLM then picks its fast ``awq_marlin`` kernel where the GPU has it).
    quantization: Literal["none", "awq", "fp8"] = "none"
    #: Quantize the KV cache too; off by default (it raised memory use in the seeds' run).
    kv_cache_quantization: bool = False
    max_num_batched_tokens: int = Field(default=MAX_NUM_BATCHED_TOKENS, ge=1)
    #: Total concurrent requests (the engine's ``max_num_seqs``).
    max_slots: int = Field(default=8, ge=1)
    #: Slot reservation: long-lane requests may hold at most this many slots, medium + long
    #: at most ``max_medium_long_slots``; the rest stay free for shorter lanes. Unset: 75 % and
    #: 95 % of the slots (6 and 7 of 8, 48 and 60 of 64; ``live_policy.MAX_LONG_SHARE``, ``MAX_MEDIUM_LONG_SHARE``).
    max_long_slots: int | None = Field(default=None, ge=0)
    max_medium_long_slots: int | None = Field(default=None, ge=0)
    #: Anti-starvation: once a lane's oldest request waited ``starve_after_ms``, it may take
    #: up to this many slots ahead of shorter lanes (unless those waited ``protect_after_ms``).
    #: Unset: 10 % of the slots, at least one (``live_policy.MIN_LONG_SHARE``).
    min_long_slots: int | None = Field(default=None, ge=0)
    min_medium_slots: int = Field(default=0, ge=0)
    starve_after_ms: float = Field(STARVE_AFTER_MS, ge=0)
    #: ``inf`` (the default) = never; NaN is refused (``ge``), as for the other waits here.
    protect_after_ms: float = Field(math.inf, ge=0)
    #: Let long requests use reserved slots while the shorter lanes are empty (more
    #: throughput, but a short request arriving then waits for a slot).
    borrow_when_idle: bool = False
    #: Priority only under load: while the short lane's oldest request has waited less than
    #: this, lanes are popped oldest-first (``SlotConfig.fcfs_below_ms``; 0 = always by priority).
    #: Unset: 4 s on the engines that chunk prefill (``vllm``, ``trtllm``, ``sim``), 8 s on ``hf``
    #: (``live_policy.fcfs_below_ms_for``).
    fcfs_below_ms: float | None = Field(default=None, ge=0.0)
    #: Wait bound: a lane whose oldest request has waited this long is popped first, caps and
    #: priorities notwithstanding (``SlotConfig.max_wait_ms``; 0 = no bound).
    max_wait_ms: float = Field(default=MAX_WAIT_MS, ge=0.0)
    #: Priority only where answers are what requests cost: while prompts are at least this share
    #: of the engine's work over its last 1,000 finished requests (``scheduler/workmix.py``),
    #: lanes are popped oldest-first (``SlotConfig.fcfs_above_prefill_share``; 1 = never).
    fcfs_above_prefill_share: float = Field(default=PREFILL_HEAVY_SHARE, ge=0.0, allow_inf_nan=False)
    #: For that share: what one decoded token costs in prompt tokens' worth of prefill on this
    #: deployment's GPUs and model (``costmodel.CostProfile.decode_token_cost``; 12 = Llama-70B
    #: on H100s at a full batch, ~6 on A100s).
    decode_token_cost: float = Field(default=DECODE_TOKEN_COST, gt=0.0, allow_inf_nan=False)
    #: For that share: while the other API keys send at least 10 % of the window's requests, the key
    #: with the most work counts for at most this share of it, so one client's long prompts cannot
    #: switch the lanes off for everyone (``workmix.capped_top_weight``; 1 = no cap).
    prefill_share_max_key_share: float = Field(default=PREFILL_SHARE_MAX_KEY_SHARE, gt=0.0, le=1.0)
    #: Report each finished request's true length for the predictor's refresh (the prompt
    #: text goes to Redis, capped list; off keeps prompts out of it).
    report_observations: bool = True
    #: Preemption by hand-back (``scheduler/preemption.py``): when a lane's oldest request has
    #: waited this long and no free slot may take it, hand one long-lane run back (0 = never).
    preempt_after_ms: float = Field(20_000.0, ge=0, allow_inf_nan=False)
    #: A request is handed back at most this many times.
    max_preemptions: int = Field(1, ge=0)
    #: Hand back demoted runs too (claimed from a shorter lane, past its bound), not only
    #: long-lane ones (``PreemptionConfig.hand_back_demoted``; off: unsafe with a weak predictor).
    preempt_demoted: bool = DEFAULT_PREEMPTION.hand_back_demoted
    #: A run that (re)started less than this long ago is not handed back.
    preempt_min_run_ms: float = Field(DEFAULT_PREEMPTION.min_run_ms, ge=0, allow_inf_nan=False)
    #: Hand-backs' re-prefill budget (``PreemptionConfig.max_reprefill_share``): re-prefill
    #: tokens earned per token this worker generates, kept up to ``preempt_budget_tokens``.
    preempt_reprefill_share: float = Field(DEFAULT_PREEMPTION.max_reprefill_share, ge=0, allow_inf_nan=False)
    preempt_budget_tokens: int = Field(DEFAULT_PREEMPTION.reprefill_burst_tokens, ge=0)
    #: Cancel a running request whose edge channel has had no subscriber this long (its edge
    #: died and the client did not resume elsewhere), to free the slot and KV cache.
    orphan_grace_s: float = Field(15.0, ge=0, allow_inf_nan=False)
    #: On SIGTERM: stop claiming, let running requests finish this long, hand back the rest.
    drain_timeout_s: float = Field(5.0, ge=0, allow_inf_nan=False)
    #: Address the ``--metrics-port`` endpoint binds (0.0.0.0 for a Prometheus on another host).
    metrics_host: str = "127.0.0.1"
    #: Where the ``hf`` engines run: ``cpu``, ``cuda`` (the GPU ``gpu_index``), ``cuda:N`` or ``mps``.
    device: str = "cpu"
    #: Which GPU (vLLM / TensorRT-LLM see only it: CUDA_VISIBLE_DEVICES is set from it).
    gpu_index: int = Field(0, ge=0)
    #: Share of GPU memory the engine may take (weights + KV cache).
    gpu_memory_fraction: float = Field(0.9, gt=0, le=1)
    #: Weights dtype for vLLM and TensorRT-LLM (the ``hf`` engines run float32 whatever it says).
    dtype: str = "auto"
    #: vLLM: run without CUDA graphs / torch.compile. Starts in seconds instead of a minute
    #: or more (tests, GPU checks, quick restarts) at some decode speed.
    enforce_eager: bool = False
    #: Max tokens of prompt + output the engine accepts (0 = the model's own limit).
    max_model_len: int = Field(0, ge=0)
    #: Time scale for the ``sim`` engine (10 = ten times faster than real time).
    sim_time_scale: float = Field(1.0, gt=0, allow_inf_nan=False)
    sim_profile: str = "l70-h100"
    #: The ``sim`` engine models chunked prefill (vLLM V1, TensorRT-LLM, as the ``vllm`` and
    #: ``trtllm`` workers run them); off: vLLM v0's alternating prefill and decode iterations.
    sim_chunked_prefill: bool = True
    worker_id: str = ""

    @field_validator("pool")
    @classmethod
    def _not_auto(cls, pool: str) -> str:
        if pool == "auto":  # scheduler.router.rules.AUTO: a chat's "auto" asks the router, never a pool
            raise ValueError("'auto' is reserved: a chat's model 'auto' asks the router to choose a pool, "
                             "so no chat could reach a pool named so; pick another name")
        return pool

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", device):
            raise ValueError("use cpu, cuda (the GPU LANES_GPU_INDEX), cuda:N or mps")
        return device

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, dtype: str) -> str:
        # Passed as it is to vLLM and TensorRT-LLM, which refused a typo only once the model loaded.
        if dtype not in DTYPES:
            raise ValueError(f"use one of {', '.join(DTYPES)}")
        return dtype

    @field_validator("sim_profile")
    @classmethod
    def _known_profile(cls, name: str) -> str:
        from lanes.scheduler.costmodel import get_profile

        try:
            get_profile(name)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None
        return name

    @model_validator(mode="after")
    def _gpu_from_honcho(self) -> WorkerSettings:
        """``honcho start -c worker=N`` numbers its workers 1..N: worker n takes GPU n-1, so one
        Procfile line binds each worker to its own GPU without hand-editing."""
        found = re.fullmatch(r"worker[^.]*\.(\d+)", self.honcho_process_name)
        if "gpu_index" not in self.model_fields_set and found:
            self.gpu_index = int(found.group(1)) - 1
        return self

    @model_validator(mode="after")
    def _slot_counts_fit(self) -> WorkerSettings:
        """The slot counts set here must fit ``max_slots`` and each other. Before, a guarantee
        above the slots was cut down, and a cap above them, or a medium + long cap below the
        long one, was taken as set and could never bind, all without a word. Unset counts are
        the shares ``lanes_slot_config`` gives, which fit at every slot count."""
        shares = lanes_slot_config(self.max_slots)
        slots = f"LANES_MAX_SLOTS ({self.max_slots})"

        def shown(name: str, value: int | None, default: int) -> tuple[int, str]:
            if value is None:
                return default, f"LANES_{name.upper()} ({default}, its default at {self.max_slots} slots)"
            return value, f"LANES_{name.upper()} ({value})"

        max_long, max_long_text = shown("max_long_slots", self.max_long_slots, shares.max_long)
        max_medium_long, max_medium_long_text = shown("max_medium_long_slots", self.max_medium_long_slots,
                                                      shares.max_medium_long)
        min_long, min_long_text = shown("min_long_slots", self.min_long_slots, shares.min_long)
        for value, text in ((max_long, max_long_text), (max_medium_long, max_medium_long_text)):
            if value > self.max_slots:
                raise ValueError(f"{text} is above {slots}: set at most {self.max_slots} (that many lets those "
                                 "lanes take every slot)")
        if min_long > self.max_slots:
            raise ValueError(f"{min_long_text} is above {slots}: the long lane cannot be guaranteed more slots "
                             "than the worker has")
        if min_long + self.min_medium_slots > self.max_slots:
            raise ValueError(f"{min_long_text} + LANES_MIN_MEDIUM_SLOTS ({self.min_medium_slots}) is above {slots}: "
                             "the guarantees must fit in the slots together")
        # Only a long cap set here: one left unset under a lower medium + long cap set here is
        # that cap in effect, as meant.
        if self.max_long_slots is not None and max_medium_long < max_long:
            raise ValueError(f"{max_medium_long_text} is below {max_long_text}: long requests count toward the "
                             f"medium + long cap too, so at most {max_medium_long} could run; raise the first or "
                             "lower the second")
        return self

    @property
    def torch_device(self) -> str:
        """The ``hf`` engines' torch device: ``cuda`` is the GPU ``gpu_index`` (each worker of a
        ``honcho -c worker=N`` on its own GPU), anything else as set."""
        return f"cuda:{self.gpu_index}" if self.device == "cuda" else self.device

    @property
    def chunks_prefill(self) -> bool:
        """Whether this worker's engine runs chunked prefill (the ``hf`` engines do not)."""
        return self.engine in CHUNKED_PREFILL_ENGINES or (self.engine == "sim" and self.sim_chunked_prefill)

    def slots(self, engine_max_concurrency: int) -> SlotConfig:
        """How this worker's slots are shared among lanes: ``live_policy.lanes_slot_config`` (the
        simulator's config) for the slots the engine runs, with any count set here instead of a
        share (the guaranteed shares shrink with the slots, e.g. to the one slot of the
        speculative engine)."""
        max_slots = min(self.max_slots, engine_max_concurrency)
        fcfs_below_ms = self.fcfs_below_ms
        if fcfs_below_ms is None:  # unset: the default for this worker's engine
            fcfs_below_ms = fcfs_below_ms_for(self.chunks_prefill)
        config = lanes_slot_config(
            max_slots, starve_after_ms=self.starve_after_ms, protect_after_ms=self.protect_after_ms,
            borrow_when_idle=self.borrow_when_idle, fcfs_below_ms=fcfs_below_ms,
            max_wait_ms=wait_bound_ms(self.max_wait_ms), fcfs_above_prefill_share=self.fcfs_above_prefill_share)
        min_long = config.min_long if self.min_long_slots is None else min(self.min_long_slots, max_slots)
        return replace(
            config, min_long=min_long, min_medium=min(self.min_medium_slots, max_slots - min_long),
            max_long=config.max_long if self.max_long_slots is None else self.max_long_slots,
            max_medium_long=config.max_medium_long if self.max_medium_long_slots is None else self.max_medium_long_slots)

    def preemption(self) -> PreemptionConfig | None:
        return None if self.preempt_after_ms <= 0 else replace(
            DEFAULT_PREEMPTION, wait_bound_ms=self.preempt_after_ms, max_preemptions=self.max_preemptions,
            min_run_ms=self.preempt_min_run_ms, hand_back_demoted=self.preempt_demoted,
            max_reprefill_share=self.preempt_reprefill_share, reprefill_burst_tokens=self.preempt_budget_tokens)
