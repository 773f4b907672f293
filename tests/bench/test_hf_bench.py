"""scripts/hf_bench.py on CPU: its HF configurations produce real greedy decodes.

A tiny random Qwen2 is saved in tmp_path; ``model.generate`` with the dynamic and the static
cache, and the script's own StaticCache loop, must give exactly the ids of an independent
greedy loop (full forward over the whole sequence each step, no cache, float64). The EOS id
is chosen among the tokens that loop emits when EOS is allowed, so the ``min_new_tokens``
masking is exercised too.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "hf_bench.py"
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "initializer_range": 0.3,  # wide random weights: varied greedy text
}
PROMPT_TOKENS = 12
NEW = 12


@pytest.fixture(scope="module")
def hf_bench():
    spec = importlib.util.spec_from_file_location("hf_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(model64, prompt: torch.Tensor, n: int, eos: int | None) -> list[int]:
    seq = prompt.clone()
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model64(input_ids=seq, use_cache=False).logits[0, -1]
            if eos is not None:
                logits[eos] = float("-inf")
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, hf_bench):
    """Saved tiny Qwen2 with an EOS that greedy decoding would hit, and the float64 ids."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY)).eval()
    model64 = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY)).eval()
    model64.load_state_dict(model.state_dict())
    model64 = model64.double()
    prompt = hf_bench.make_prompt(TINY["vocab_size"], PROMPT_TOKENS, 0, "cpu")
    free = _reference(model64, prompt, NEW, None)
    eos = free[3]
    masked = _reference(model64, prompt, NEW, eos)
    assert masked != free and eos not in masked
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(folder)
    return folder, prompt, masked, eos


@pytest.mark.parametrize("config", ["eager-dynamic", "static", "static-loop"])
def test_greedy_ids_match_float64_loop(hf_bench, checkpoint, config):
    folder, prompt, expected, eos = checkpoint
    model = hf_bench.load_model(str(folder), "cpu", torch.float32)
    assert hf_bench.eos_ids(model) == [eos]
    with torch.no_grad():
        res = hf_bench.run_config(config, model, prompt, NEW, repeats=1)
    assert res["ok"], res.get("error")
    assert res["ids"] == expected
    assert res["first_ids"] == expected[: hf_bench.SHOWN_IDS]
    assert res["ttft_ms"] > 0
    if config != "static-loop":
        assert res["notes"]["auto_compiled"] is False  # CPU: generate never compiles


def test_main_json_and_roofline(hf_bench, checkpoint, tmp_path, capsys):
    folder, _, expected, _ = checkpoint
    out = tmp_path / "hf.json"
    rc = hf_bench.main(
        [
            "--model", str(folder), "--device", "cpu", "--dtype", "float32",
            "--tokens", str(NEW), "--prompt-tokens", str(PROMPT_TOKENS), "--repeats", "1",
            "--configs", "static-loop,static+cudagraphs", "--json", str(out),
            "--roofline-bandwidth", "100",
        ]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    loop, graphs = report["configs"]
    assert loop["ok"] and loop["ids"] == expected
    assert not graphs["ok"] and graphs["error"] == "RuntimeError: needs CUDA"
    table = capsys.readouterr().out
    assert "needs CUDA" in table and "roofline" in table

    # Tied embedding counted once: every parameter except lm_head (it is the embedding).
    model = hf_bench.load_model(str(folder), "cpu", torch.float32)
    state = model.state_dict()
    expected_bytes = sum(
        t.numel() * t.element_size() for k, t in state.items() if k != "lm_head.weight"
    )
    roof = report["roofline"]
    assert roof["param_bytes"] == expected_bytes
    assert roof["tok_s_ceiling"] == pytest.approx(100e9 / expected_bytes)
