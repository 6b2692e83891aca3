"""Build the engine a worker's settings ask for; heavy packages are imported only here."""

from __future__ import annotations

from lanes.workers.engines.base import ConfigError, Engine
from lanes.workers.engines.engine_config import validate
from lanes.workers.settings import WorkerSettings


def resolve_models(settings: WorkerSettings) -> WorkerSettings:
    """Fill in the shipped demo model (and its draft) when no model is given; ``ConfigError``
    for a model or draft that cannot be found (before anything heavy is imported)."""
    from lanes.workers.models.paths import check_model, resolve_draft, resolve_model

    model = resolve_model(settings.model)
    check_model(model)
    draft = settings.draft_model
    if settings.spec_method == "draft_model" or draft:
        draft = resolve_draft(settings.draft_model, settings.model)
        if draft:
            check_model(draft, "--draft-model / LANES_DRAFT_MODEL")
    return settings.model_copy(update={"model": model, "draft_model": draft})


def build_engine(settings: WorkerSettings) -> Engine:
    """Validate the settings (clear ``ConfigError`` on bad combinations) and build the engine."""
    if settings.spec_method == "draft_model" and not settings.draft_model and settings.engine != "sim":
        # The demo model's own draft, as documented (``resolve_draft``); it was refused here.
        from lanes.workers.models.paths import resolve_draft

        settings = settings.model_copy(update={"draft_model": resolve_draft("", settings.model)})
    validate(settings)
    if settings.engine == "sim":
        from lanes.scheduler.costmodel import get_profile
        from lanes.workers.engines.sim import SimEngine

        return SimEngine(get_profile(settings.sim_profile), max_num_seqs=settings.max_slots,
                         max_num_batched_tokens=settings.max_num_batched_tokens,
                         chunked_prefill=settings.sim_chunked_prefill, time_scale=settings.sim_time_scale)
    settings = resolve_models(settings)
    if settings.engine == "hf":
        check_torch_device(settings.device)
    if settings.engine == "vllm":
        from lanes.workers.engines.vllm import VllmEngine

        return VllmEngine(settings)
    if settings.engine == "trtllm":
        from lanes.workers.engines.trtllm import TrtllmEngine

        return TrtllmEngine(settings)
    if settings.spec_method != "none":
        from lanes.workers.engines.hf_spec import HFSpeculativeEngine

        return HFSpeculativeEngine.from_settings(settings)
    from lanes.workers.engines.hf import HFEngine

    return HFEngine(settings.model, max_slots=settings.max_slots, device=settings.torch_device,
                    max_model_len=settings.max_model_len)


def check_torch_device(device: str) -> None:
    """``ConfigError`` unless this torch can run on ``device`` (the ``hf`` engines)."""
    import torch

    kind = device.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(f"LANES_DEVICE={device}, but torch {torch.__version__} ({build}) sees no CUDA GPU: "
                          "install a CUDA build of torch on a machine with a GPU, or use --device cpu")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"LANES_DEVICE={device}, but this torch has no MPS (Apple GPU) backend: use --device cpu")
