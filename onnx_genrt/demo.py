"""The bundled demo model and the ``onnx-genrt demo`` job.

The demo model is one decoder block in standard ONNX (opset 23 Attention, RMSNormalization
and RotaryEmbedding) over a fixed-size KV cache: token ids, position ids, a cache and a
mask in, logits and the argmax token out. The job runs it the way a speculative decoder
would: M=1 steps in slot PRIMARY interleaved with M=k+1 steps in slot VERIFY, through
persistent bindings, and checks every replayed step against an eager run.
"""

from __future__ import annotations

import argparse
import time
from importlib import resources
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_genrt.core.graph_slots import DeviceGraphSlot

VOCAB, HIDDEN, HEADS, KV_HEADS, CACHE = 256, 64, 4, 2, 32
HEAD_DIM = HIDDEN // HEADS
MODEL_FILE = "demo_decoder.onnx"


def build_demo_model(seed: int = 0) -> onnx.ModelProto:
    """One attention block plus a tied LM head, with seeded random weights."""
    rng = np.random.default_rng(seed)

    def weight(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    inits = {
        "embed": weight(VOCAB, HIDDEN, scale=0.5),
        "wq": weight(HIDDEN, HIDDEN),
        "wo": weight(HIDDEN, HIDDEN),
        "norm1": np.ones(HIDDEN, np.float32),
        "norm2": np.ones(HIDDEN, np.float32),
        "cos": np.cos(
            np.outer(np.arange(CACHE), 10000.0 ** (-np.arange(HEAD_DIM // 2) / (HEAD_DIM // 2)))
        ).astype(np.float32),
        "sin": np.sin(
            np.outer(np.arange(CACHE), 10000.0 ** (-np.arange(HEAD_DIM // 2) / (HEAD_DIM // 2)))
        ).astype(np.float32),
        "perm": np.array([1, 0], np.int64),
    }
    n = helper.make_node
    nodes = [
        n("Gather", ["embed", "tokens"], ["h0"], name="embed_tokens"),
        n("RMSNormalization", ["h0", "norm1"], ["h1"], name="attn_norm", axis=-1, epsilon=1e-6),
        n("MatMul", ["h1", "wq"], ["q0"], name="q_proj"),
        n(
            "RotaryEmbedding",
            ["q0", "cos", "sin", "positions"],
            ["q"],
            name="rope",
            num_heads=HEADS,
        ),
        n(
            "Attention",
            ["q", "k_cache", "v_cache", "mask"],
            ["attn"],
            name="attention",
            q_num_heads=HEADS,
            kv_num_heads=KV_HEADS,
        ),
        n("MatMul", ["attn", "wo"], ["o"], name="o_proj"),
        n("Add", ["h0", "o"], ["h2"], name="residual"),
        n("RMSNormalization", ["h2", "norm2"], ["h3"], name="final_norm", axis=-1, epsilon=1e-6),
        n("Transpose", ["embed"], ["embed_t"], name="tie", perm=[1, 0]),
        n("MatMul", ["h3", "embed_t"], ["logits"], name="lm_head"),
        n("ArgMax", ["logits"], ["next_token"], name="argmax", axis=-1, keepdims=0),
    ]
    del inits["perm"]
    graph = helper.make_graph(
        nodes,
        "demo_decoder",
        [
            helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, "M"]),
            helper.make_tensor_value_info("positions", TensorProto.INT64, [1, "M"]),
            helper.make_tensor_value_info(
                "k_cache", TensorProto.FLOAT, [1, CACHE, KV_HEADS * HEAD_DIM]
            ),
            helper.make_tensor_value_info(
                "v_cache", TensorProto.FLOAT, [1, CACHE, KV_HEADS * HEAD_DIM]
            ),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, ["M", CACHE]),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "M", VOCAB]),
            helper.make_tensor_value_info("next_token", TensorProto.INT64, [1, "M"]),
        ],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 23)], producer_name="onnx-genrt"
    )


def bundled_model_path() -> Path:
    return Path(str(resources.files("onnx_genrt") / "models" / MODEL_FILE))


def demo_inputs(rows: int, length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Feeds for an M=rows step after ``length`` cached positions."""
    mask = np.zeros((rows, CACHE), bool)
    for r in range(rows):
        mask[r, : length + r + 1] = True
    return {
        "tokens": rng.integers(0, VOCAB, (1, rows), dtype=np.int64),
        "positions": (np.arange(rows, dtype=np.int64) + length)[None, :],
        "k_cache": rng.standard_normal((1, CACHE, KV_HEADS * HEAD_DIM)).astype(np.float32),
        "v_cache": rng.standard_normal((1, CACHE, KV_HEADS * HEAD_DIM)).astype(np.float32),
        "mask": mask,
    }


def run_demo(provider: str | list[str] = "cpu", steps: int = 24, verify_rows: int = 4) -> int:
    """Interleave PRIMARY (M=1) and VERIFY (M=k+1) bound runs; check each against eager."""
    from onnx_genrt.session import InferenceSession

    path = bundled_model_path()
    providers = [provider] if isinstance(provider, str) else list(provider)
    label = ",".join(providers)
    print(f"model: {path.name} ({path.stat().st_size / 1024:.0f} KiB), provider: {label}")
    sess = InferenceSession(path, providers=providers)
    eager = InferenceSession(path, providers=providers, enable_graphs=False)
    rng = np.random.default_rng(0)
    bindings = {}
    for slot, rows in ((DeviceGraphSlot.PRIMARY, 1), (DeviceGraphSlot.VERIFY, verify_rows)):
        b = sess.io_binding()
        for name, value in demo_inputs(rows, 0, rng).items():
            b.bind_input(name, value)
        b.bind_output("logits", shape=(1, rows, VOCAB))
        b.bind_output("next_token", shape=(1, rows))
        bindings[slot] = b
    worst = 0.0
    timings: dict[DeviceGraphSlot, list[float]] = {s: [] for s in bindings}
    for step in range(steps):
        for slot, b in bindings.items():
            rows = b.input("tokens").shape[1]
            feeds = demo_inputs(rows, step % (CACHE - verify_rows), rng)
            for name, value in feeds.items():
                b.input(name)[...] = value  # in place: the binding signature stays equal
            start = time.perf_counter()
            sess.run_with_iobinding(b, slot)
            timings[slot].append(time.perf_counter() - start)
            ref_logits, ref_tokens = eager.run(None, feeds)
            out = b.get_outputs()
            worst = max(worst, float(np.max(np.abs(out["logits"] - ref_logits))))
            if not np.array_equal(out["next_token"], ref_tokens):
                print(f"MISMATCH at step {step} in slot {slot.value}")
                return 1
    print(f"{steps} steps per slot; replayed outputs equal eager (max |dlogits| = {worst:.2e})")
    print(
        f"{'slot':<9}{'M':>3}{'captures':>10}{'replays':>9}{'fallbacks':>11}{'invalid.':>10}{'median us':>11}"
    )
    for slot, b in bindings.items():
        s = sess.graph_stats(slot)
        med = float(np.median(timings[slot][3:])) * 1e6
        rows = b.input("tokens").shape[1]
        print(
            f"{slot.value:<9}{rows:>3}{s.captures:>10}{s.replays:>9}{s.fallbacks:>11}{s.invalidations:>10}{med:>11.0f}"
        )
        for reason, count in s.fallback_reasons.items():
            print(f"  fallback x{count}: {reason}")
    return 0


def main(args: argparse.Namespace) -> int:
    return run_demo(args.provider, args.steps)
