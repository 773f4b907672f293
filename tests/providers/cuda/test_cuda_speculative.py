"""Speculative decoding on the GPU: token-identical to CUDA greedy, every slot replaying.

Runs the embedded trained model (its MTP head and draft model) on the CUDA provider. Greedy
on CUDA is the reference; CUDA greedy itself is checked against the CPU provider's tokens
where the CPU provider imports (small fp16 rounding may flip a near tie, so only a clear
top-1 margin is required to agree there).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = ["class Foo:\n    def __init__(self", "import os\n\ndef main(", "for i in range(", "def "]
SLOTS = ("primary", "verify")
COUNTS = ("captures", "replays", "fallbacks", "invalidations")


@pytest.fixture(scope="module")
def model():
    from onnx_genrt.providers.cuda.plugin import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is not None:
        pytest.fail(f"ONNX_GENRT_REQUIRE_GPU=1 but no GPU is usable: {reason}")
    from onnx_genrt.engine import Model
    from onnx_genrt.generate_cli import default_model_dir

    m = Model(default_model_dir(), "cuda")
    assert m.session.plan.placement_counts() == {"cuda": len(m.session.plan.steps)}
    return m


def _generate(model, prompt, spec=None, new=48, k=4):
    from onnx_genrt.engine import generate

    drafts = {"k": k} if spec is not None else {}  # k without a proposer is refused
    return generate(model, prompt, max_new_tokens=new, spec=spec, ignore_eos=True, **drafts)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("spec", ["mtp", "draft", "ngram"])
def test_speculation_equals_greedy_on_cuda(model, spec, k):
    for prompt in PROMPTS:
        greedy = _generate(model, prompt)
        fast = _generate(model, prompt, spec=spec, k=k)
        assert fast.tokens == greedy.tokens, (spec, k, prompt)
        assert fast.speculation["proposed"] > 0, fast.speculation


@pytest.mark.parametrize("spec", ["mtp", "draft", "ngram"])
def test_every_slot_replays_over_256_tokens(model, spec):
    prompt = "class Foo:\n    def __init__(self"
    greedy = _generate(model, prompt, new=256)
    before = model.session.executor.all_stats()
    res = _generate(model, prompt, spec=spec, new=256)
    assert res.tokens == greedy.tokens
    target = res.graph_stats["target"]
    for slot in SLOTS:  # counts of this run alone (the model served other tests before)
        stats = {key: target[slot][key] - before.get(slot, {}).get(key, 0) for key in COUNTS}
        # Pipelined MTP runs every step as a verify (a step without confident drafts
        # verifies only its pending token), so PRIMARY may sit idle; its graph from the
        # greedy run above must then still be there, never recaptured.
        idle = spec == "mtp" and slot == "primary" and stats["replays"] == 0
        if idle:
            assert stats["captures"] == 0 and target[slot]["captures"] >= 1, (slot, stats)
        else:
            assert stats["replays"] > 0, (slot, stats)
        assert stats["invalidations"] <= 1, (slot, stats)
        assert stats["fallbacks"] == 0, (slot, stats, target[slot]["fallback_reasons"])
    assert target["verify"]["replays"] - before.get("verify", {}).get("replays", 0) > 0
    if spec != "ngram":  # the MTP head / draft model runs graphed in its own slot(s)
        proposer = res.graph_stats["proposer"]
        assert any(s["replays"] > 0 for s in proposer.values()), proposer
        assert all(s["fallbacks"] == 0 for s in proposer.values()), proposer
    assert res.speculation["acceptance_rate"] > 0.2, res.speculation


def test_cuda_greedy_matches_cpu_greedy(model):
    pytest.importorskip("numba")
    from onnx_genrt.engine import Model
    from onnx_genrt.engine.decoder import DecoderRunner
    from onnx_genrt.generate_cli import default_model_dir

    cpu = Model(default_model_dir(), "cpu")
    for prompt in PROMPTS:
        want = _generate(cpu, prompt, new=32).tokens
        got = _generate(model, prompt, new=32).tokens
        if got != want:  # only allowed after a near tie in the CPU logits
            i = next(j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
            runner = DecoderRunner(cpu.session, cpu.config, i + 1)
            top = sorted(runner.forward(want[:i], None).logits[-1].tolist(), reverse=True)
            assert top[0] - top[1] < 2e-2, (prompt, i, got, want)


def test_look_ahead_greedy_matches_step_by_step_greedy(model):
    """On the GPU the next greedy step is queued on the device argmax before the host reads
    the current one (the default); forcing it off must give the same tokens."""
    from onnx_genrt.engine import Generator, GeneratorParams

    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt)
        seqs = []
        for look_ahead in (True, False):
            params = GeneratorParams(model)
            params.set_search_options(max_length=len(ids) + 64)
            with Generator(model, params) as gen:
                gen.look_ahead = look_ahead
                gen.eos = set()
                gen.append_tokens(ids)
                queued = 0
                while not gen.is_done():
                    gen.generate_next_token()
                    queued += gen._ahead is not None
                seqs.append(gen.get_sequence())
            assert (queued > 0) == look_ahead
        assert seqs[0] == seqs[1], prompt


def test_pipelined_mtp_with_eos_and_min_length(model, monkeypatch):
    """MTP on the GPU queues each verify with inputs the chain wrote on the device; with an
    eos token (and eos masked before min_length) the tokens still equal greedy's."""
    from onnx_genrt.engine import GeneratorParams
    from onnx_genrt.engine.api import make_generator
    from tests.llm_fixtures import spy_device_fed_launches

    device_fed = spy_device_fed_launches(monkeypatch)

    def run(prompt, eos, min_length, spec):
        ids = model.tokenizer.encode(prompt)
        params = GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + 48, min_length=min_length)
        with make_generator(model, params, spec, 4) as gen:
            gen.eos = {eos}
            gen.append_tokens(ids)
            while not gen.is_done():
                gen.generate_next_token()
            return gen.get_sequence()

    for prompt in PROMPTS:
        greedy = _generate(model, prompt)
        new = greedy.tokens[greedy.prompt_tokens :]
        eos = new[12]
        for min_length in (0, greedy.prompt_tokens + new.index(eos) + 5):
            assert run(prompt, eos, min_length, "mtp") == run(prompt, eos, min_length, None)
    assert any(device_fed), "no verify step was fed on the device"
