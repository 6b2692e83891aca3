"""The refit's nearest-neighbour memory: the pure lookup, and a refit that keeps one, blended,
saved and loaded, with a real (tiny, fine-tuned here) encoder run by ONNX Runtime."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from lanes.scheduler.predictor import LengthPredictor, from_weights
from lanes.scheduler.predictor.encoder import EncoderError, load_encoder
from lanes.scheduler.predictor.memory import NeighbourMemory
from lanes.scheduler.predictor.train import (
    Observation,
    refit,
    refit_with_routing,
    train,
)


def test_the_memory_averages_its_nearest_neighbours_weighted_by_similarity() -> None:
    axes = np.eye(4, dtype=np.float32)
    memory = NeighbourMemory.build(np.vstack([axes * 3.0, axes[:1] + 0.1 * axes[1:2]]), np.log1p([10, 100, 1000, 5, 30]), k=2,
                                   power=1.0)
    # Raw embeddings are normalised: a query along the first axis finds rows 0 and 4 (cosine 1
    # and ~0.995) and averages their log lengths by those weights.
    cos = 1 / math.sqrt(1.01)
    expected = (math.log1p(10) + cos * math.log1p(30)) / (1 + cos)
    assert memory.score(np.array([2.0, 0, 0, 0])) == pytest.approx(expected, rel=1e-5)
    # Neighbours at cosine <= 0 weigh nothing; all of them at <= 0: the plain mean of the k nearest.
    assert NeighbourMemory.build(axes[:2], np.log1p([10, 100]), k=2).score(np.array([0, 0, 1.0, 0])) == pytest.approx(
        (math.log1p(10) + math.log1p(100)) / 2)
    # k beyond the memory's size reads every row.
    assert NeighbourMemory.build(axes[:1], np.log1p([7]), k=10).score(np.array([1.0, 1, 0, 0])) == pytest.approx(math.log1p(7))
    with pytest.raises(ValueError, match="3 dimensions, the memory holds 4"):
        memory.score(np.ones(3))
    with pytest.raises(ValueError, match="one target per embedding row"):
        NeighbourMemory(np.ones((2, 4)), np.ones(3))
    header, arrays = memory.to_arrays()
    assert arrays["memory_embeddings"].dtype == np.float16 and header["size"] == 5
    again = NeighbourMemory.from_arrays(header, arrays)
    assert again.k == 2 and again.score(np.array([2.0, 0, 0, 0])) == pytest.approx(expected, rel=1e-3)



def test_the_memory_searches_the_windows_principal_subspace() -> None:
    # Embeddings on an 8-dimensional affine subspace of 64 dimensions: projected onto their top 8
    # principal axes, the search finds the same neighbours, at the same (centred) cosines, as a
    # search in the subspace's own coordinates, and stores 8 columns instead of 64.
    rng = np.random.default_rng(0)
    axes = np.linalg.qr(rng.normal(size=(64, 8)))[0].T  # 8 orthonormal rows
    offset = rng.normal(size=64) * 5.0
    coords = rng.normal(size=(200, 8))
    targets = rng.uniform(1.0, 7.0, size=200)
    memory = NeighbourMemory.build(offset + coords @ axes, targets, dims=8)
    assert memory.embeddings.shape == (200, 8) and memory.dimensions == 64
    centred = coords - coords.mean(axis=0)
    plain = NeighbourMemory.build(centred, targets, dims=None)
    for query in rng.normal(size=(5, 8)):
        assert memory.score(offset + query @ axes) == pytest.approx(plain.score(query - coords.mean(axis=0)), rel=1e-4)
    with pytest.raises(ValueError, match="63 dimensions, the memory holds 64"):
        memory.score(np.ones(63))
    # Saved and loaded with its projection; fewer rows or dimensions than ``dims``: no projection.
    header, arrays = memory.to_arrays()
    assert header["projected_dims"] == 8 and arrays["memory_basis"].shape == (64, 8)
    again = NeighbourMemory.from_arrays(header, arrays)
    query = offset + rng.normal(size=8) @ axes
    assert again.score(query) == pytest.approx(memory.score(query), rel=1e-3)
    assert NeighbourMemory.build(coords[:5], targets[:5], dims=6).basis is None
    assert NeighbourMemory.build(coords, targets, dims=8).basis is None
    with pytest.raises(ValueError, match="need a mean and a basis"):
        NeighbourMemory(memory.embeddings, targets, mean=memory.mean)


SHORT = [f"Give me one word for {w}." for w in ("red", "big", "fast", "cold", "old", "new", "sad", "wet", "dry",
                                                  "hot", "soft", "loud")]
LONG = [f"Write a detailed multi-page report on {w}, with sections and examples." for w in
        ("rivers", "bridges", "trains", "markets", "forests", "engines", "cities", "oceans", "deserts", "ports",
         "farms", "mines")]


@pytest.fixture(scope="module")
def encoded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT fine-tuned on answer length and exported as the shipped encoder is: its folder."""
    pytest.importorskip("onnx")
    from lanes.scheduler.predictor.encoder_train import EncoderRecipe, fine_tune

    from tests.test_predictor_encoder import _tiny_base

    tmp = tmp_path_factory.mktemp("encoder")
    data = [Observation(p, 3, "a") for p in SHORT[:6]] + [Observation(p, 900, "a") for p in LONG[:6]]
    recipe = EncoderRecipe(num_layers=2, frozen_layers=1, max_tokens=24, epochs=10, batch_size=8, lr=1e-3,
                           head_lr=1e-2, warmup_steps=5)
    fine_tune(data, tmp / "out", level=4.0, recipe=recipe, base=str(_tiny_base(tmp / "base")))
    return tmp / "out"


def _base(folder: Path) -> LengthPredictor:
    data = [Observation(p, 3, "a") for p in SHORT[:6]] + [Observation(p, 900, "a") for p in LONG[:6]]
    return train(data, encoder=load_encoder(folder / "length_encoder.onnx"))


def test_an_exported_encoder_outputs_the_pooled_embedding_its_score_reads(encoded: Path) -> None:
    encoder = load_encoder(encoded / "length_encoder.onnx")
    assert encoder.has_embedding
    embedding = encoder.embed_text(SHORT[0])
    assert embedding.dtype == np.float32 and embedding.shape == (32,)  # the tiny base's hidden size
    assert encoder.score_text(SHORT[0]) == encoder._encode(SHORT[0], embed=True)[0]  # one run, both outputs


def test_a_refit_with_a_memory_recalls_the_lengths_of_similar_prompts(encoded: Path, tmp_path: Path) -> None:
    base = _base(encoded)
    # The deployment answers the held-back prompts with lengths no model of prompts could
    # guess: the long-looking ones briefly, the short-looking ones at length.
    window = [Observation(p, 2000, "d") for p in SHORT[6:]] + [Observation(p, 2, "d") for p in LONG[6:]]
    plain = refit(base, window)
    remembering = refit(base, window, memory_weight=0.5)
    assert plain.memory is None and remembering.kind == "lexical+encoder+memory"
    assert remembering.memory is not None and len(remembering.memory.targets) == len(window)
    # A prompt asked again is one entry, at its rows' mean log length.
    again = refit(base, [*window, Observation(SHORT[6], 0, "d")], memory_weight=0.5).memory
    assert again is not None and len(again.targets) == len(window)
    assert max(again.targets) == pytest.approx(math.log1p(2000))
    assert sorted(again.targets)[-6] == pytest.approx(math.log1p(2000) / 2)
    recalled = {p: remembering.memory.score(base.encoder.embed_text(p)) for p in SHORT[6:] + LONG[6:]}
    for prompt, score in recalled.items():
        assert remembering.score_text(prompt) == pytest.approx(0.5 * plain.score_text(prompt) + 0.5 * score)
    # The neighbours of a template's prompts are mostly its own: the memory ranks them as the
    # deployment answered them, and moves the blend that way.
    assert min(recalled[p] for p in SHORT[6:]) > max(recalled[p] for p in LONG[6:])
    moved = {p: remembering.score_text(p) - plain.score_text(p) for p in recalled}
    assert min(moved[p] for p in SHORT[6:]) > max(moved[p] for p in LONG[6:])
    # Saved and loaded (the refresh publishes bytes; the edges load them): the same scores.
    for name in ("length_encoder.onnx", "length_encoder_tokenizer.json"):  # found beside the weights
        (tmp_path / name).write_bytes((encoded / name).read_bytes())
    remembering.save(tmp_path / "w.npz")
    loaded = from_weights(tmp_path / "w.npz")
    assert loaded.kind == remembering.kind and loaded.memory_weight == 0.5
    for prompt in SHORT + LONG:
        assert loaded.score_text(prompt) == pytest.approx(remembering.score_text(prompt), abs=2e-3)
    # A refit with routing keeps the memory in the model it returns.
    assert refit_with_routing(base, window * 5, memory_weight=0.5).memory is not None


def test_a_memory_needs_an_encoder_that_outputs_its_embedding(encoded: Path, tmp_path: Path) -> None:
    import onnx

    graph = onnx.load(str(encoded / "length_encoder.onnx"))
    kept = [o for o in graph.graph.output if o.name == "score"]
    del graph.graph.output[:]
    graph.graph.output.extend(kept)
    old = tmp_path / "old"
    old.mkdir()
    onnx.save(graph, str(old / "length_encoder.onnx"))
    (old / "length_encoder_tokenizer.json").write_bytes((encoded / "length_encoder_tokenizer.json").read_bytes())
    base = _base(old)
    assert not base.encoder.has_embedding
    window = [Observation(p, 50, "d") for p in SHORT]
    with pytest.raises(EncoderError, match="no embedding output"):
        refit(base, window, memory_weight=0.5)
    with pytest.raises(ValueError, match="no encoder"):
        refit(train(window), window, memory_weight=0.5)
    # A memory beside an encoder without the output is refused (from_weights: WeightsError).
    remembering = refit(_base(encoded), window, memory_weight=0.5)
    with pytest.raises(ValueError, match="needs an encoder that outputs its embedding"):
        replace(remembering, encoder=base.encoder)


def test_the_scheduler_refuses_a_memory_its_encoder_cannot_give(monkeypatch: pytest.MonkeyPatch) -> None:
    import lanes.scheduler.predictor as predictor_module
    from lanes.cli.entrypoints import _check_memory_encoder
    from lanes.cli.failures import ConfigFailure

    _check_memory_encoder(0.5)  # the shipped graph outputs its embedding
    window = [Observation(p, 50, "d") for p in SHORT]
    monkeypatch.setattr(predictor_module, "load_default", lambda: train(window))  # a lexical model: no encoder
    with pytest.raises(ConfigFailure, match="LANES_PREDICTOR_MEMORY_WEIGHT=0.5 needs a length encoder") as failure:
        _check_memory_encoder(0.5)
    assert failure.value.exit_code == 2 and "LANES_PREDICTOR_MEMORY_WEIGHT=0" in str(failure.value)
