"""Provider discovery through pluggy entry points, the built-ins and third parties alike."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from onnx_genrt.cli import main as cli_main
from onnx_genrt.core.errors import ProviderUnavailableError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.hookspecs import ENTRY_POINT_GROUP, hookimpl
from onnx_genrt.core.registry import ProviderRegistry, ProviderSpec, get_registry, reset_registry

from .models import mlp, mlp_reference

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).resolve().parent / "plugins"


def test_builtins_register_through_the_package_entry_points():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert eps["cpu"] == "onnx_genrt.providers.cpu.plugin"
    assert eps["cuda"] == "onnx_genrt.providers.cuda.plugin"
    names = ProviderRegistry().names()
    assert "cpu" in names and "cuda" in names


def test_core_and_session_never_import_a_provider_by_name():
    pattern = re.compile(r"providers\.(cpu|cuda)|from onnx_genrt\.providers|import providers")
    offenders = []
    for folder in ("core", "session"):
        for path in (ROOT / folder).rglob("*.py"):
            if pattern.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_cuda_reports_unavailable_with_reason_when_no_gpu():
    from onnx_genrt.providers.cuda.plugin import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    info = {p.name: p for p in ProviderRegistry().providers()}["cuda"]
    assert info.available == (reason is None)
    if reason is not None:
        assert "no GPU or CuPy" in info.reason
        with pytest.raises(ProviderUnavailableError, match="'cuda' is unavailable: no GPU or CuPy"):
            ProviderRegistry().create("cuda")


def test_unknown_provider_names_the_known_ones():
    with pytest.raises(ProviderUnavailableError, match=r"no provider named 'tpu'.*cpu"):
        ProviderRegistry().create("tpu")


def test_in_process_plugin_registers_through_the_same_hook():
    class Plugin:
        @hookimpl
        def register_providers(self, register):
            from onnx_genrt.providers.cpu.provider import CPUProvider

            class Renamed(CPUProvider):
                name = "cpu2"

            register(ProviderSpec("cpu2", factory=Renamed))
            register(ProviderSpec("gone", factory=Renamed, availability=lambda: "driver missing"))

    reg = ProviderRegistry()
    reg.register_plugin(Plugin(), name="inline")
    infos = {p.name: p for p in reg.providers()}
    assert infos["cpu2"].available
    assert not infos["gone"].available and infos["gone"].reason == "driver missing"
    assert reg.create("cpu2").name == "cpu2"


def test_plugin_whose_hook_raises_is_reported_and_others_survive():
    class Bad:
        @hookimpl
        def register_providers(self, register):
            raise ValueError("cannot enumerate devices")

    reg = ProviderRegistry()
    reg.register_plugin(Bad(), name="bad")
    assert any("bad" in e.plugin and "cannot enumerate devices" in e.error for e in reg.errors)
    assert reg.create("cpu").name == "cpu"


@pytest.fixture(scope="module")
def installed_plugins(tmp_path_factory):
    """Build and install the example and broken plugin distributions into a temp target."""
    target = tmp_path_factory.mktemp("site")
    for dist in ("example_provider", "broken_plugin"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--target",
                str(target),
                str(PLUGINS / dist),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        )
        assert done.returncode == 0, f"installing {dist} failed:\n{done.stdout}\n{done.stderr}"
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    reset_registry()
    yield target
    sys.path.remove(str(target))
    for mod in [m for m in sys.modules if m.startswith("onnx_genrt_example_provider")]:
        del sys.modules[mod]
    importlib.invalidate_caches()
    reset_registry()


def test_third_party_provider_is_discovered_and_runs_a_model(installed_plugins):
    from onnx_genrt.session import InferenceSession

    registry = get_registry()
    infos = {p.name: p for p in registry.providers()}
    assert infos["example"].available
    assert "onnx-genrt-example-provider" in infos["example"].plugin
    model = mlp(hidden=8)
    sess = InferenceSession(model, providers=["example"])
    assert sess.plan.placement_counts() == {"example": len(model.graph.node)}
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    (y,) = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-6)
    # The example declares three slots: bound runs capture and replay in each.
    provider = sess.main_provider
    assert provider.graph_slots == frozenset(DeviceGraphSlot)
    binding = sess.io_binding()
    xb = binding.bind_input("x", x.copy())
    yb = binding.bind_output("y", shape=(3, 8))
    for slot in (DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY):
        for step in range(4):
            provider.write_from_host(xb, x * step + 1)
            sess.run_with_iobinding(binding, slot)
            got = provider.to_numpy(yb)
            np.testing.assert_allclose(
                got, mlp_reference(model, x * step + 1), rtol=1e-5, atol=1e-6
            )
        stats = sess.graph_stats(slot)
        assert (stats.captures, stats.replays, stats.fallbacks) == (1, 2, 0), slot


def test_broken_plugin_is_reported_by_name_and_does_not_stop_others(installed_plugins, capsys):
    registry = get_registry()
    errors = [e for e in registry.errors if e.plugin.startswith("broken")]
    assert errors and "this plugin is broken on purpose" in errors[0].error
    assert "onnx-genrt-broken-plugin" in errors[0].plugin
    assert {"cpu", "example"} <= set(registry.names())
    assert cli_main(["providers"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"example\s+available", out)
    assert re.search(r"cpu\s+available", out)
    assert "plugin failed" in out and "broken on purpose" in out
