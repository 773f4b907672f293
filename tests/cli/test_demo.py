"""The bundled demo model: reproducible, equal to onnxruntime, and the demo job passes."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_genrt.demo import build_demo_model, bundled_model_path, demo_inputs, run_demo
from onnx_genrt.session import InferenceSession


def test_bundled_model_is_what_the_builder_makes():
    bundled = onnx.load(str(bundled_model_path()))
    assert bundled.SerializeToString() == build_demo_model().SerializeToString()


@pytest.mark.parametrize(("rows", "length"), [(1, 0), (1, 17), (4, 5)])
def test_demo_model_matches_onnxruntime(rows, length):
    path = str(bundled_model_path())
    feeds = demo_inputs(rows, length, np.random.default_rng(rows + length))
    ours = InferenceSession(path).run(None, feeds)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ours[1], ref[1])


def test_demo_job_replays_both_slots_equal_to_eager(capsys):
    """The demo compares each replayed step with an eager run (next tokens exactly); the
    largest logit difference it prints must be float32 rounding, not merely printed."""
    assert run_demo(steps=6) == 0
    out = capsys.readouterr().out
    found = re.search(r"replayed outputs equal eager \(max \|dlogits\| = (\S+)\)", out)
    assert found, out
    assert float(found.group(1)) <= 1e-5
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.startswith(("primary", "verify"))
    }
    assert int(rows["primary"][3]) == 4 and int(rows["verify"][3]) == 4  # replays
