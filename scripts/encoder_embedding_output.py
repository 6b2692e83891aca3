"""Give a length encoder exported before stop 32 its ``embedding`` output, scores unchanged.

The graph's mean pool (the node output ``/Div_output_0``, what the score's linear head reads)
becomes a second output through an Identity node, and the weights file beside it is re-pointed at
the new graph's SHA-256 (its lexical part untouched). ``lanes predictor train`` exports the
output itself since stop 32; this is how the shipped stop-27 graph got it (RESULTS, "Stop 32").

    .venv/bin/python scripts/encoder_embedding_output.py scheduler/predictor/weights

Needs ``onnx`` (the ``[train]`` extra).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import onnx
from lanes.scheduler.predictor import from_weights
from lanes.scheduler.predictor.encoder import ENCODER_FILE, load_encoder
from onnx import TensorProto, helper

POOLED = "/Div_output_0"


def main(folder: Path) -> None:
    graph_path, weights_path = folder / ENCODER_FILE, folder / "length_predictor_lexical.npz"
    probe = "Write a story about a dragon who learns to code."
    predictor = from_weights(weights_path)
    before = predictor.score_text(probe)
    graph = onnx.load(str(graph_path))
    if any(o.name == "embedding" for o in graph.graph.output):
        print(f"{graph_path} already outputs its embedding")
        return
    if not any(POOLED in node.output for node in graph.graph.node):
        raise SystemExit(f"{graph_path} has no {POOLED} (not a stop-27 export): retrain with lanes predictor train")
    graph.graph.node.append(helper.make_node("Identity", [POOLED], ["embedding"], name="embedding_identity"))
    graph.graph.output.append(helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", "hidden"]))
    onnx.save(graph, str(graph_path))
    # The same lexical part, naming the new graph (its SHA-256).
    replace(predictor, encoder=load_encoder(graph_path)).save(weights_path)
    after = from_weights(weights_path)
    assert after.encoder.has_embedding and after.score_text(probe) == before, "the score changed"
    print(f"{graph_path}: embedding output added ({after.encoder.embed_text(probe).shape[0]} dimensions), "
          f"score unchanged; {weights_path.name} re-pointed at SHA-256 {after.encoder.sha256[:12]}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
