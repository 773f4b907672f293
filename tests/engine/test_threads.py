"""The thread contract: what is shared is safe (compared with single-threaded runs) or
refused at once; never a silent wrong answer."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from onnx_genrt.core.errors import ConcurrentUseError
from onnx_genrt.engine import Generator, GeneratorParams, Model, generate
from onnx_genrt.generate_cli import default_model_dir
from onnx_genrt.session import InferenceSession

from ..models import mlp, mlp_reference

PROMPTS = ["    def __init__(self", "import os\n", "class Foo:", "    return", "for i in range("]


def _in_threads(work, items, threads: int = 4):
    """``work(item)`` for every item, started together from ``threads`` threads."""
    start = threading.Barrier(threads)

    def run(chunk):
        start.wait()
        return [work(item) for item in chunk]

    chunks = [items[i::threads] for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(run, chunks))
    out = {}
    for chunk, results in zip(chunks, done, strict=True):
        out.update(zip(chunk, results, strict=True))
    return [out[item] for item in items]


def test_one_session_run_from_many_threads_gives_each_its_own_result():
    model = mlp(hidden=64)
    session = InferenceSession(model)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((4, 64)).astype(np.float32) for _ in range(64)]
    got = _in_threads(lambda i: session.run(None, {"x": xs[i]})[0], list(range(len(xs))))
    for x, y in zip(xs, got, strict=True):
        np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def shared_model() -> Model:
    return Model(default_model_dir())


@pytest.mark.parametrize("spec", [None, "mtp", "ngram"])
def test_one_model_generating_in_many_threads_matches_one_thread(shared_model, spec):
    items = [(p, n) for p in PROMPTS for n in (12, 20)]

    def work(item):
        prompt, n = item
        return generate(shared_model, prompt, n, spec=spec, ignore_eos=True).tokens

    alone = [work(item) for item in items]
    assert len({tuple(t) for t in alone}) > len(PROMPTS) // 2  # the prompts differ
    assert _in_threads(work, items) == alone


def test_two_generators_interleaved_in_one_thread_match_each_alone(shared_model):
    # What the threads above come down to: steps of two sequences taking turns.
    def alone(prompt):
        return generate(shared_model, prompt, 16, ignore_eos=True).tokens

    gens = []
    for prompt in PROMPTS[:2]:
        params = GeneratorParams(shared_model)
        ids = shared_model.tokenizer.encode(prompt)
        params.set_search_options(max_length=len(ids) + 16)
        gen = Generator(shared_model, params)
        gen.eos = set()
        gen.append_tokens(ids)
        gens.append(gen)
    while not all(g.is_done() for g in gens):
        for g in gens:
            if not g.is_done():
                g.generate_next_token()
    for gen, prompt in zip(gens, PROMPTS[:2], strict=True):
        assert gen.get_sequence() == alone(prompt)  # prompt and new tokens
        gen.close()


def test_a_generator_entered_by_a_second_thread_refuses_it(shared_model):
    params = GeneratorParams(shared_model)
    params.set_search_options(max_length=64)
    gen = Generator(shared_model, params)
    gen.append_tokens(shared_model.tokenizer.encode("import os"))
    inside, release = threading.Event(), threading.Event()
    forward = gen.runner.launch

    def slow_launch(*args, **kwargs):  # the first thread stops inside its step
        inside.set()
        release.wait(10)
        return forward(*args, **kwargs)

    gen.generate_next_token()  # the prompt's token; the next step launches
    gen.runner.launch = slow_launch
    first = threading.Thread(target=gen.generate_next_token)
    first.start()
    assert inside.wait(10)
    with pytest.raises(ConcurrentUseError, match="this Generator is being used by another"):
        gen.generate_next_token()
    release.set()
    first.join(10)
    # The refused call changed nothing: the sequence grew by the first thread's token only.
    before = len(gen.get_sequence())
    gen.runner.launch = forward
    gen.generate_next_token()
    assert len(gen.get_sequence()) == before + 1
    gen.close()


@pytest.mark.parametrize("count", [1, 2, 3])
def test_hold_keeps_every_objects_lock_from_other_threads(count):
    """A run on several providers (mixed placement) holds each one's lock: another thread
    can take none of them until the run ends."""
    from onnx_genrt.core.locking import hold, lock_of

    class Provider:
        pass

    objects = [Provider() for _ in range(count)]

    def others_can_take() -> list[bool]:
        taken: list[bool] = []

        def probe() -> None:
            for obj in objects:
                got = lock_of(obj).acquire(blocking=False)
                taken.append(got)
                if got:
                    lock_of(obj).release()

        thread = threading.Thread(target=probe)
        thread.start()
        thread.join(10)
        return taken

    with hold([*objects, objects[0]]):  # a repeated object is held once
        with hold(objects):  # re-entrant within the thread
            pass
        assert others_can_take() == [False] * count
    assert others_can_take() == [True] * count
