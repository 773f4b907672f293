"""DecoderRunner and StaticKVCache: what they refuse, and the values they bind and read."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx_genrt.core.errors import InvalidInputError, KernelError, ModelLoadError, NonFiniteError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.kernels import KernelRegistry
from onnx_genrt.engine import Generator, GeneratorParams, Model, generate
from onnx_genrt.engine.batch import BatchGenerator
from onnx_genrt.engine.decoder import DecoderRunner
from onnx_genrt.providers.cpu.kernels import REGISTRY
from onnx_genrt.providers.cpu.provider import CPUProvider

from ..llm_fixtures import nan_token_copy

PRIMARY, VERIFY = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY


def _edited_copy(source: Path, target: Path, edit: Callable[[onnx.GraphProto], None]) -> Path:
    """A copy of the decoder in ``source`` whose graph declarations ``edit`` changed."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("draft", "mtp", "spec*"))
    path = target / "model.onnx"
    proto = onnx.load(path, load_external_data=False)  # the weights stay in their file
    edit(proto.graph)
    onnx.save(proto, path)
    return target


def _dims(graph: onnx.GraphProto, name: str):
    value = next(v for v in [*graph.input, *graph.output] if v.name == name)
    return value.type.tensor_type.shape.dim


def _open_generator(folder: Path) -> None:
    model = Model(folder)
    params = GeneratorParams(model)
    params.set_search_options(max_length=16)
    Generator(model, params).close()


@pytest.mark.parametrize("declared", ["none", "rank 3"])
def test_a_kv_input_without_a_rank_4_shape_is_refused(qwen2_dir, tmp_path, declared):
    def edit(graph):
        key = next(i for i in graph.input if i.name == "past_key_values.0.key")
        if declared == "none":
            key.type.tensor_type.ClearField("shape")
        else:
            del key.type.tensor_type.shape.dim[-1]

    folder = _edited_copy(qwen2_dir, tmp_path / "m", edit)
    with pytest.raises(ModelLoadError, match=r"past_key_values\.0\.key must be rank 4"):
        _open_generator(folder)


@pytest.mark.parametrize(("axis", "value"), [(1, 3), (3, 8)])
def test_kv_dimensions_that_disagree_with_the_config_are_refused(qwen2_dir, tmp_path, axis, value):
    def set_dim(graph):
        _dims(graph, "past_key_values.0.key")[axis].dim_value = value

    folder = _edited_copy(qwen2_dir, tmp_path / "m", set_dim)
    with pytest.raises(
        ModelLoadError,
        match=rf"past_key_values\.0\.key dimension {axis} is {value}, the config says",
    ):
        _open_generator(folder)


def test_a_fixed_batch_dimension_decodes_that_many_rows_only(qwen2_dir, tmp_path):
    def fix_batch(size):
        def edit(graph):
            _dims(graph, "past_key_values.0.key")[0].dim_value = size

        return edit

    one = Model(_edited_copy(qwen2_dir, tmp_path / "one", fix_batch(1)))
    reference = generate(Model(qwen2_dir), [5, 17, 99], 6, ignore_eos=True).tokens
    assert generate(one, [5, 17, 99], 6, ignore_eos=True).tokens == reference
    with pytest.raises(
        ModelLoadError,
        match=r"past_key_values\.0\.key has a fixed batch dimension 1; a cache of 2 rows",
    ):
        generate(one, [[5, 17, 99], [1, 2]], 6)
    two = Model(_edited_copy(qwen2_dir, tmp_path / "two", fix_batch(2)))
    with pytest.raises(ModelLoadError, match="fixed batch dimension 2; a cache of 1 rows"):
        generate(two, [5, 17, 99], 6)


def test_logits_without_a_static_vocabulary_are_refused(qwen2_dir, tmp_path):
    def dynamic_vocab(graph):
        _dims(graph, "logits")[-1].dim_param = "vocab"

    folder = _edited_copy(qwen2_dir, tmp_path / "m", dynamic_vocab)
    with pytest.raises(ModelLoadError, match="'logits' needs a static vocabulary dimension"):
        generate(Model(folder), [5, 17, 99], 4)


def test_logits_not_made_row_by_row_are_computed_for_every_prompt_row(qwen2_dir, tmp_path):
    """Here the logits are ``raw + raw * 0``: one step reads two values, so they have no
    row tail; a prefill computes every row, and greedy tokens equal the unedited model's."""

    def expose_raw_logits(graph):
        lm_head = next(n for n in graph.node if "logits" in n.output)
        lm_head.output[0] = "raw_logits"
        zero = onnx.helper.make_tensor("zero", onnx.TensorProto.FLOAT, [], [0.0])
        graph.initializer.append(zero)
        graph.node.extend(
            [
                onnx.helper.make_node("Mul", ["raw_logits", "zero"], ["no_logits"]),
                onnx.helper.make_node("Add", ["raw_logits", "no_logits"], ["logits"]),
            ]
        )

    folder = _edited_copy(qwen2_dir, tmp_path / "m", expose_raw_logits)
    model = Model(folder)
    runner = DecoderRunner(model.session, model.config, 16)
    assert model.session.row_tail("logits") is None and not runner.prefill_last_row
    prompt = [5, 17, 99, 3]
    every = runner.forward(prompt, None).logits
    assert every.shape[0] == len(prompt)
    np.testing.assert_allclose(every[-1], _prefill_logits(Model(qwen2_dir), prompt), atol=1e-5)
    reference = generate(Model(qwen2_dir), prompt, 8, ignore_eos=True).tokens
    assert generate(model, prompt, 8, ignore_eos=True).tokens == reference


@pytest.fixture(scope="module")
def model(qwen2_dir) -> Model:
    return Model(qwen2_dir)


def _prefill_logits(model: Model, tokens: list[int]) -> np.ndarray:
    """Reference: the last row's logits of ``tokens`` run eagerly on a fresh cache."""
    runner = DecoderRunner(model.session, model.config, 64)
    return runner.forward(tokens, None).logits[-1].copy()


def test_steps_that_do_not_fit_their_width_or_the_cache_are_refused(model):
    runner = DecoderRunner(model.session, model.config, 8)
    with pytest.raises(InvalidInputError, match="cannot feed 0 tokens in a step of width 0"):
        runner.forward([], None)
    with pytest.raises(InvalidInputError, match="cannot feed 3 tokens in a step of width 2"):
        runner.forward([1, 2, 3], VERIFY, width=2)
    assert runner.cache.length == 0
    runner.forward([5, 17, 99, 3, 250], None)
    out = runner.forward([7, 8, 9], None)  # fills the cache to its last position
    assert runner.cache.length == 8
    np.testing.assert_allclose(
        out.logits[-1], _prefill_logits(model, [5, 17, 99, 3, 250, 7, 8, 9]), rtol=1e-4, atol=1e-5
    )
    runner.rewind_to(6)
    with pytest.raises(InvalidInputError, match="sequence of 9 tokens exceeds the KV cache of 8"):
        runner.forward([7], VERIFY, width=3)  # one token, but a step 3 wide
    assert runner.cache.length == 6


def test_rewinds_outside_the_cache_are_refused(model):
    runner = DecoderRunner(model.session, model.config, 16)
    runner.forward([5, 17, 99], None)
    for length in (-1, 4):
        with pytest.raises(
            InvalidInputError, match=f"cannot rewind to {length}: the cache holds 3"
        ):
            runner.rewind_to(length)
    runner.rewind_to(3)
    runner.rewind_to(0)
    out = runner.forward([1, 2], None)
    np.testing.assert_allclose(out.logits[-1], _prefill_logits(model, [1, 2]), rtol=1e-4, atol=1e-5)


def test_device_fed_steps_are_checked(model):
    runner = DecoderRunner(model.session, model.config, 8)
    first = runner.launch([5, 17, 99], None)
    first.wait()
    with pytest.raises(InvalidInputError, match="takes one token from a device argmax"):
        runner.launch([1, 2], PRIMARY, width=2, feed_token_of=first)
    with pytest.raises(InvalidInputError, match="needs a graph slot and a width"):
        runner.launch(None, None, width=2)
    with pytest.raises(InvalidInputError, match="needs a graph slot and a width"):
        runner.launch(None, VERIFY)
    with pytest.raises(InvalidInputError, match="a step of 6 after 3 positions exceeds"):
        runner.launch(None, VERIFY, width=6)
    # The inputs a step of width 5 left on the device, run again: up to the last position.
    host_fed = runner.forward([1, 2], VERIFY, width=5)
    want = host_fed.tokens.copy(), host_fed.logits.copy()
    runner.rewind_to(3)
    device_fed = runner.launch(None, VERIFY, width=5).wait()
    assert device_fed.tokens[:2].tolist() == want[0].tolist()
    np.testing.assert_array_equal(device_fed.logits[:2], want[1])


def test_a_cache_view_is_its_rows_of_the_batch_cache(model):
    batch = BatchGenerator(model, 4, 32)
    cache = batch.runner.cache
    view = cache.rows_view(1, 2)
    assert (view.rows, view.length, view.max_length) == (2, 0, cache.max_length)
    for whole, part in zip([*cache.keys, *cache.values], [*view.keys, *view.values], strict=True):
        assert np.shares_memory(part, whole)
        np.testing.assert_array_equal(part, whole[1:3])
    for start, count in ((0, 1), (3, 1), (0, 4)):  # the edges of the cache
        assert cache.rows_view(start, count).keys[0].shape[0] == count
    with pytest.raises(InvalidInputError, match=r"rows 3\.\.4 of a cache of 4"):
        cache.rows_view(3, 2)
    for start, count in ((3, 2), (-1, 1), (0, 0), (4, 1)):
        with pytest.raises(InvalidInputError, match="rows .* of a cache of 4"):
            cache.rows_view(start, count)
    with pytest.raises(InvalidInputError, match="a step of 5 rows on a cache of 4"):
        batch.runner.step_rows(np.ones(5, np.int64), np.zeros(5, np.int64), PRIMARY)


def test_argmax_ids_are_checked_against_both_ends_of_the_vocabulary():
    from onnx_genrt.engine.decoder import check_token_ids

    check_token_ids(np.array([0, 4095]), 4096, "a step")
    check_token_ids(np.array([], np.int64), 4096, "a step")
    check_token_ids(np.array([4096]), None, "a step")  # no static vocabulary: nothing to check
    for ids, bad, rows in (([0, 4096], [4096], [1]), ([-1, 0, 7], [-1], [0])):
        message = f"ids {bad} outside the vocabulary of 4096 (rows {rows})"
        with pytest.raises(KernelError, match=re.escape(message)):
            check_token_ids(np.array(ids), 4096, "a step")


class _Memory:
    """A device that reports ``limit`` bytes of memory (what check_cache_fits reads)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit

    def memory_limit(self) -> int | None:
        return self.limit


def test_a_kv_cache_may_use_all_of_the_memory_and_no_more():
    from onnx_genrt.engine.decoder import check_cache_fits

    shape, layers = (1, 2, 64, 16), 3
    need = 2 * layers * np.zeros(shape, np.float16).nbytes  # keys and values of every layer
    check_cache_fits(_Memory(need), layers, shape, np.float16)
    check_cache_fits(_Memory(None), layers, shape, np.float16)
    with pytest.raises(InvalidInputError, match=f"max_length 64 needs {need} bytes"):
        check_cache_fits(_Memory(need - 1), layers, shape, np.float16)
    big = (1, 8, 2**20, 128)  # 2 x 4 layers x 2**30 float32 values: 32 GiB
    message = r"needs 34359738368 bytes \(32\.0 GiB: .*\), more than this provider's 16\.0 GiB"
    with pytest.raises(InvalidInputError, match=message):
        check_cache_fits(_Memory(16 * 2**30), 4, big, np.float32)


def _with_position_ids(source: Path, target: Path) -> Path:
    """A copy of the decoder whose attention takes its rotary positions from a
    ``position_ids`` input (GroupQueryAttention's optional input 9) instead of the mask."""

    def take_position_ids(graph):
        for node in graph.node:
            if node.op_type == "GroupQueryAttention":
                node.input[9] = "position_ids"
        graph.input.append(
            onnx.helper.make_tensor_value_info(
                "position_ids", onnx.TensorProto.INT64, ["batch_size", "sequence_length"]
            )
        )

    folder = _edited_copy(source, target, take_position_ids)
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["decoder"]["inputs"]["position_ids"] = "position_ids"
    path.write_text(json.dumps(config))
    return folder


def test_position_ids_are_fed_alone_and_in_a_batch(qwen2_dir, tmp_path):
    """Positions count from each row's length: greedy output equals onnxruntime-genai's on
    the same folder, for one sequence (prefill, decode, a verify-wide step) and batched."""
    from .test_greedy_parity import _onnxruntime_genai

    folder = _with_position_ids(qwen2_dir, tmp_path / "m")
    model = Model(folder)
    prompts = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    reference = [_onnxruntime_genai(folder, p, 12) for p in prompts]
    for prompt, want in zip(prompts, reference, strict=True):
        assert generate(model, prompt, 12, ignore_eos=True).tokens == want
    assert (
        generate(model, prompts[1], 12, spec="ngram", k=3, ignore_eos=True).tokens == reference[1]
    )
    rows = generate(model, prompts, 12, ignore_eos=True)
    assert [r.tokens for r in rows] == reference


class _ArgMaxFault(CPUProvider):
    """The CPU provider whose ArgMax adds ``shift`` to every index it gives (a device argmax
    gone wrong), from the moment a test sets ``shift``; without its prebound replay call,
    so replayed steps run the faulty kernel too."""

    name = "argmax-fault"
    shift = 0

    @functools.cached_property
    def kernels(self) -> KernelRegistry:
        registry = KernelRegistry()
        for domain, op in REGISTRY.ops():
            for since in REGISTRY.versions(domain, op):
                kernel = REGISTRY.lookup(domain, op, since)
                if op == "ArgMax":
                    kernel = dataclasses.replace(kernel, fn=self._shifted(kernel.fn), bind=None)
                registry.add(kernel)
        return registry

    def _shifted(self, arg_max):
        def shifted(ctx, x):
            ids = arg_max(ctx, x)
            ids += self.shift  # in place: the buffer the step reads back
            return ids

        return shifted


def test_device_argmax_ids_outside_the_vocabulary_are_a_kernel_error(qwen2_dir):
    """A single step (prefill, then a replayed decode step) and a batched step check the
    device argmax against the vocabulary before any id reaches the text."""
    faulty = _ArgMaxFault()
    model = Model(qwen2_dir, [faulty])
    prompt = [5, 17, 99]
    reference = generate(Model(qwen2_dir), prompt, 6, ignore_eos=True).tokens
    assert generate(model, prompt, 6, ignore_eos=True).tokens == reference  # healthy so far
    vocab = model.config.vocab_size
    faulty.shift = vocab
    with pytest.raises(
        KernelError, match=f"argmax of the step at 0 gave .* outside the vocabulary of {vocab}"
    ):
        generate(model, prompt, 4)
    faulty.shift = 0
    with Generator(model, _params(model, 16)) as gen:
        gen.append_tokens(prompt)
        gen.generate_next_token()
        faulty.shift = vocab
        with pytest.raises(KernelError, match="argmax of the step at 3 gave token ids"):
            gen.generate_next_token()
    faulty.shift = 0
    batch = BatchGenerator(model, 2, 32)
    rows = [batch.add(p, _params(model, 16), ignore_eos=True) for p in (prompt, [1, 2])]
    batch.step()
    assert [batch.sequence(r) for r in rows] == [
        generate(model, p, 2, ignore_eos=True).tokens for p in (prompt, [1, 2])
    ]
    faulty.shift = vocab
    with pytest.raises(KernelError, match="argmax of a batched step of 2 rows gave token ids"):
        batch.step()


def _params(model: Model, max_length: int) -> GeneratorParams:
    params = GeneratorParams(model)
    params.set_search_options(max_length=max_length)
    return params


def test_batched_steps_are_checked_and_may_reach_the_last_position(model):
    runner = DecoderRunner(model.session, model.config, 8, rows=2)
    prompt = [5, 17, 99, 3, 250, 7, 9]
    runner.forward(prompt, None)  # row 0 holds 7 positions; row 1 none
    tokens = np.array([11, 11])
    with pytest.raises(InvalidInputError, match="2 tokens for 1 row lengths"):
        runner.step_rows(tokens, np.array([7]), None)
    with pytest.raises(InvalidInputError, match="a row of 9 positions exceeds the KV cache of 8"):
        runner.step_rows(tokens, np.array([8, 0]), None)
    with pytest.raises(InvalidInputError, match="a step of 0 rows on a cache of 2"):
        runner.step_rows(tokens[:0], np.array([], np.int64), None)
    _, logits = runner.step_rows(tokens, np.array([7, 0]), None, read_logits=True)
    for row, alone in enumerate(([*prompt, 11], [11])):
        np.testing.assert_allclose(logits[row], _prefill_logits(model, alone), atol=1e-4)


NAN_TOKEN = 42


@pytest.fixture(scope="module")
def nan_token_model(qwen2_dir, tmp_path_factory) -> Model:
    """The decoder with token NAN_TOKEN's embedding row NaN (its own copy of the tied
    table): steps that feed it, or attend to it, give non-finite logits; others do not."""
    return Model(nan_token_copy(qwen2_dir, tmp_path_factory.mktemp("nan") / "m", NAN_TOKEN))


def test_non_finite_logits_name_the_positions_of_the_step(nan_token_model):
    model, x = nan_token_model, NAN_TOKEN

    def runner(prompt: list[int]) -> DecoderRunner:
        r = DecoderRunner(model.session, model.config, 16, rows=2)
        r.forward(prompt, None)
        return r

    with pytest.raises(NonFiniteError, match=r"at positions 2 \(slot eager\)"):
        runner([5, x, 7])  # a prefill computes its last row only
    with pytest.raises(NonFiniteError, match=r"at positions 2\.\.2 \(slot primary\)"):
        runner([5, 7]).forward([x], PRIMARY)
    with pytest.raises(NonFiniteError, match=r"at positions 2\.\.3 \(slot verify\)"):
        runner([5, 7]).forward([x, 1], VERIFY, width=3)
    fed = runner([5, 7])
    with pytest.raises(NonFiniteError):
        fed.forward([1, x], VERIFY, width=3)
    fed.rewind_to(2)  # the step's inputs stay on the device: run it again, device-fed
    with pytest.raises(NonFiniteError, match=r"at positions of a 3-row step \(slot verify\)"):
        fed.launch(None, VERIFY, width=3).wait()
    with pytest.raises(NonFiniteError, match=r"in a batched step of 2 rows \(slot primary\)"):
        runner([5, 7]).step_rows(np.array([1, x]), np.array([2, 0]), PRIMARY)
    healthy = runner([5, 7])
    _, logits = healthy.step_rows(np.array([1, 1]), np.array([2, 0]), PRIMARY, read_logits=True)
    assert np.isfinite(logits).all()


def test_float16_logits_are_bound_and_read_as_float16(qwen2_dir, tmp_path):
    """A decoder whose logits output is float16 (a Cast after the lm_head): the step binds
    float16 buffers, and greedy tokens equal onnxruntime-genai's on the same folder."""
    from .test_greedy_parity import _onnxruntime_genai

    def half_logits(graph):
        lm_head = next(n for n in graph.node if "logits" in n.output)
        lm_head.output[0] = "float_logits"
        graph.node.append(
            onnx.helper.make_node("Cast", ["float_logits"], ["logits"], to=onnx.TensorProto.FLOAT16)
        )
        declared = next(o for o in graph.output if o.name == "logits")
        declared.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16

    folder = _edited_copy(qwen2_dir, tmp_path / "m", half_logits)
    model = Model(folder)
    runner = DecoderRunner(model.session, model.config, 16)
    assert runner.forward([5, 17, 99], None).logits.dtype == np.float16
    prompt = [5, 17, 99, 3]
    reference = _onnxruntime_genai(folder, prompt, 10)
    assert generate(model, prompt, 10, ignore_eos=True).tokens == reference


def test_a_hidden_state_row_is_that_row_on_the_device_and_on_the_host(model, qwen2_dir):
    """``hidden_state(row)`` (negative rows count from the step's end) against onnxruntime's
    hidden_states of the same prompt: the host copy and the device view (an MTP chain's
    device-to-device source) hold the same row."""
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(str(qwen2_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    config = model.config
    prompt = [5, 17, 99, 3]
    empty = np.zeros((1, config.num_kv_heads, 0, config.head_size), np.float32)
    feeds = {
        "input_ids": np.array([prompt], np.int64),
        "attention_mask": np.ones((1, len(prompt)), np.int64),
        **{i.name: empty for i in sess.get_inputs() if i.name.startswith("past_key_values")},
    }
    (reference,) = sess.run(["hidden_states"], feeds)
    runner = DecoderRunner(model.session, config, 16)
    out = runner.forward(prompt, None)
    for row in (0, 2, -1, -4):
        state = out.hidden_state(row)
        assert state.row == row % len(prompt)
        on_device = np.asarray(state.device_row())
        assert on_device.shape == (1, 1, config.hidden_size)
        np.testing.assert_allclose(on_device[0, 0], reference[0, row], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(state.numpy(), on_device[0, 0])


def _without_decode_heads(model: Model):
    from onnx_genrt.session import InferenceSession, load_model

    return InferenceSession(load_model(model.config.model_path, folder=model.folder))


def test_non_finite_logits_first_met_in_a_replayed_step_raise(nan_token_model):
    """The step's graph is captured on finite logits and replayed (the CPU provider's native
    replay, the non-finite probe fused into one NonFinite call) before the NaN token comes:
    the replay still raises, and names the step."""
    model = nan_token_model
    runner = DecoderRunner(model.session, model.config, 16, rows=2)
    runner.forward([5, 7], None)
    for token in (1, 2, 3):  # captured, then replayed
        runner.forward([token], PRIMARY)
    graph = model.session.main_provider.recorded_graph(PRIMARY)
    assert graph is not None and graph.native_calls == len(graph.calls)
    with pytest.raises(NonFiniteError, match=r"at positions 5\.\.5 \(slot primary\)"):
        runner.forward([NAN_TOKEN], PRIMARY)


def test_a_session_without_the_decode_heads_takes_the_argmax_of_the_logits(model, nan_token_model):
    """A runner over a session without the device argmax reads the logits: its tokens equal
    the device argmax of a runner with the heads, alone and batched, and non-finite logits
    still raise."""
    plain = DecoderRunner(_without_decode_heads(model), model.config, 16, rows=2)
    heads = DecoderRunner(model.session, model.config, 16, rows=2)
    assert not plain.device_argmax and heads.device_argmax
    prompt = [5, 17, 99, 3]
    for feed, slot in ((prompt, None), ([7], PRIMARY), ([8, 9], VERIFY)):
        want = heads.forward(feed, slot, width=len(feed)).tokens
        assert plain.forward(feed, slot, width=len(feed)).tokens.tolist() == want.tolist()
    lengths = np.array([heads.cache.length, 0])
    want, logits = heads.step_rows(np.array([1, 2]), lengths, PRIMARY, read_logits=True)
    got, _ = plain.step_rows(np.array([1, 2]), lengths, PRIMARY)
    assert got.tolist() == want.tolist() == np.argmax(logits, axis=-1).tolist()
    broken = DecoderRunner(_without_decode_heads(nan_token_model), model.config, 16, rows=2)
    with pytest.raises(NonFiniteError, match=r"at positions 0\.\.1 \(slot primary\)"):
        broken.forward([5, NAN_TOKEN], PRIMARY)
    broken.rewind_to(0)
    with pytest.raises(NonFiniteError, match="in a batched step of 2 rows"):
        broken.step_rows(np.array([1, NAN_TOKEN]), np.array([0, 0]), PRIMARY)
