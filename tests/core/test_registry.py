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
from onnx_genrt.core import PROVIDER_API_VERSION
from onnx_genrt.core.errors import InvalidInputError, ProviderUnavailableError
from onnx_genrt.core.graph_slots import DeviceGraphSlot
from onnx_genrt.core.hookspecs import ENTRY_POINT_GROUP, hookimpl
from onnx_genrt.core.registry import (
    ProviderRegistry,
    ProviderSpec,
    api_version_problem,
    get_registry,
    reset_registry,
)
from onnx_genrt.providers.cpu.provider import CPUProvider
from onnx_genrt.session import InferenceSession

from ..models import mlp, mlp_reference

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "plugins"
FAULTY = "onnx-genrt-faulty-plugins 0.3.1"

API = ".".join(map(str, PROVIDER_API_VERSION))
API_RE = re.escape(API)


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


def _registry_with(*entry_point_names: str) -> ProviderRegistry:
    """A registry of the built-ins plus the named entry points of the installed test plugins."""
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    chosen = [ep for ep in eps if ep.name in ("cpu", "cuda", *entry_point_names)]
    assert len(chosen) == 2 + len(entry_point_names), [ep.name for ep in eps]
    return ProviderRegistry(entry_points=chosen)


def assert_cpu_session_runs(providers: list) -> None:
    """A CPU session runs the small MLP and matches numpy in float64."""
    model = mlp(hidden=8)
    sess = InferenceSession(model, providers=providers)
    assert set(sess.plan.placement_counts()) == {"cpu"}
    x = np.random.default_rng(7).standard_normal((3, 8)).astype(np.float32)
    (y,) = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-6)


def test_in_process_plugin_registers_through_the_same_hook():
    class Plugin:
        @hookimpl
        def register_providers(self, register):
            class Renamed(CPUProvider):
                name = "cpu2"

            register(ProviderSpec("cpu2", factory=Renamed, api_version=(1, 0)))
            register(
                ProviderSpec(
                    "gone",
                    factory=Renamed,
                    availability=lambda: "driver missing",
                    api_version=(1, 0),
                )
            )

    reg = _registry_with()
    reg.register_plugin(Plugin(), name="inline")
    infos = {p.name: p for p in reg.providers()}
    assert infos["cpu2"].available and infos["cpu2"].api_version == "1.0"
    assert infos["cpu2"].distribution == "in-process plugin 'inline'"
    assert not infos["gone"].available and infos["gone"].reason == "driver missing"
    assert reg.create("cpu2").name == "cpu2"
    assert reg.errors == []


@pytest.mark.parametrize("exc", [ValueError("cannot enumerate devices"), SystemExit(4)])
def test_plugin_whose_hook_raises_is_reported_and_others_survive(exc):
    class Bad:
        @hookimpl
        def register_providers(self, register):
            raise exc

    reg = _registry_with()
    reg.register_plugin(Bad(), name="bad")
    (error,) = reg.errors
    assert error.plugin == "in-process plugin 'bad'"
    assert f"register_providers raised {type(exc).__name__}: {exc}" == error.error
    assert_cpu_session_runs([reg.create("cpu")])


def test_plugin_that_registers_nothing_is_reported():
    class Forgot:
        def register_providers(self, register):  # no @hookimpl: pluggy never calls it
            register(ProviderSpec("forgot", factory=CPUProvider, api_version=(1, 0)))

    reg = _registry_with()
    reg.register_plugin(Forgot(), name="forgot")
    assert "forgot" not in reg.names()
    assert "registered no providers" in reg.errors[0].error
    assert "@onnx_genrt.core.hookspecs.hookimpl" in reg.errors[0].error


def test_in_process_plugin_cannot_take_a_builtin_name():
    class Plugin:
        @hookimpl
        def register_providers(self, register):
            register(ProviderSpec("cuda", factory=CPUProvider, api_version=(1, 0)))

    reg = _registry_with()
    reg.register_plugin(Plugin(), name="squatter")
    assert re.fullmatch(
        r"provider 'cuda' is built into onnx-genrt \S+; in-process plugin 'squatter' cannot "
        r"take it over: give the provider another name",
        reg.errors[0].error,
    )
    assert reg.spec("cuda").factory is not CPUProvider


def test_second_registration_of_a_name_is_refused_naming_the_first():
    def plugin(tag):
        class Plugin:
            @hookimpl
            def register_providers(self, register):
                register(
                    ProviderSpec("mine", factory=CPUProvider, description=tag, api_version=(1, 0))
                )

        return Plugin()

    reg = ProviderRegistry(entry_points=())
    reg.register_plugin(plugin("first"), name="one")
    reg.register_plugin(plugin("second"), name="two")
    assert reg.spec("mine").description == "first"
    assert "provider 'mine' is already registered by in-process plugin 'one'" in reg.errors[0].error
    assert "in-process plugin 'two' cannot register it again" in reg.errors[0].error


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": "a,b"}, "provider name 'a,b' is not usable: use letters, digits"),
        ({"name": ""}, "provider name '' is not usable"),
        ({"factory": "CPUProvider"}, "provider 'odd': factory 'CPUProvider' is not callable"),
        ({"availability": None}, "provider 'odd': availability None is not callable"),
        ({"api_version": "1.0"}, "provider 'odd': api_version must be a (major, minor) tuple"),
    ],
)
def test_malformed_spec_fields_are_refused_by_name(fields, message):
    spec = ProviderSpec(**{"name": "odd", "factory": CPUProvider, "api_version": (1, 0), **fields})

    class Plugin:
        @hookimpl
        def register_providers(self, register):
            register(spec)
            register(ProviderSpec("fine", factory=CPUProvider, api_version=(1, 0)))

    reg = ProviderRegistry(entry_points=())
    reg.register_plugin(Plugin(), name="mixed")
    assert reg.names() == ["fine"]  # the plugin's other provider is unaffected
    assert [e.error[: len(message)] for e in reg.errors] == [message]


@pytest.mark.parametrize(
    ("check", "reason"),
    [
        (lambda: 3, "availability check returned 3, not None or a reason"),
        (lambda: sys.exit(2), "availability check raised SystemExit: 2"),
        (lambda: 1 / 0, "availability check raised ZeroDivisionError: division by zero"),
    ],
)
def test_misbehaving_availability_check_makes_the_provider_unavailable(check, reason):
    class Plugin:
        @hookimpl
        def register_providers(self, register):
            register(
                ProviderSpec("flaky", factory=CPUProvider, availability=check, api_version=(1, 0))
            )

    reg = _registry_with()
    reg.register_plugin(Plugin(), name="flaky")
    info = {p.name: p for p in reg.providers()}["flaky"]
    assert not info.available and info.reason == reason
    with pytest.raises(
        ProviderUnavailableError, match=re.escape(f"'flaky' is unavailable: {reason}")
    ):
        reg.create("flaky")
    assert_cpu_session_runs([reg.create("cpu")])


def test_factory_failure_names_the_provider_and_distribution(monkeypatch):
    from onnx_genrt.providers.cpu.provider import CPUProvider

    def broken(self, *args, **kwargs):
        raise RuntimeError("the BLAS library went away")

    monkeypatch.setattr(CPUProvider, "__init__", broken)
    with pytest.raises(
        ProviderUnavailableError,
        match=r"provider 'cpu' \(onnx-genrt \S+\) could not be created with options "
        r"\{'threads': 2\}: RuntimeError: the BLAS library went away",
    ):
        ProviderRegistry().create("cpu", threads=2)


def test_an_unknown_option_is_the_providers_own_clear_error():
    with pytest.raises(InvalidInputError, match=r"provider 'cpu' has no option 'cores'"):
        ProviderRegistry().create("cpu", cores=2)


def test_api_version_rule_names_both_versions(monkeypatch):
    import onnx_genrt.core.registry as registry_module

    monkeypatch.setattr(registry_module, "PROVIDER_API_VERSION", (1, 3))
    assert api_version_problem((1, 0)) is None  # an older minor loads
    assert api_version_problem((1, 3)) is None
    assert "written for provider API 1.4, newer than the 1.3" in api_version_problem((1, 4))
    for major in ((0, 9), (2, 0)):
        message = api_version_problem(major)
        expected = (
            f"written for provider API {major[0]}.{major[1]}, but this onnx-genrt implements 1.3"
        )
        assert expected in message
        assert "different major version is incompatible" in message
    assert "declares no provider API version" in api_version_problem(None)
    for bad in ("1.0", (1,), (1, 0, 0), (1.0, 0), (True, 0), (1, -1)):
        assert "must be a (major, minor) tuple of ints" in api_version_problem(bad)


def test_builtins_declare_the_runtime_api_version():
    reg = _registry_with()
    for info in reg.providers():
        if info.name in ("cpu", "cuda"):
            assert info.api_version == f"{PROVIDER_API_VERSION[0]}.{PROVIDER_API_VERSION[1]}"
            assert info.distribution.startswith("onnx-genrt ")
    assert not hasattr(reg.spec("cpu"), "priority")


# -- installed distributions: tests/plugins/ built and pip-installed into a temp folder ------


@pytest.fixture(scope="module")
def installed_plugins(tmp_path_factory):
    """Build and install the example, broken and faulty plugin distributions (one pip run)."""
    target = tmp_path_factory.mktemp("site")
    dists = ("example_provider", "broken_plugin", "faulty_plugins")
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
            *(str(PLUGINS / d) for d in dists),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert done.returncode == 0, f"installing {dists} failed:\n{done.stdout}\n{done.stderr}"
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    reset_registry()
    yield target
    sys.path.remove(str(target))
    prefixes = ("onnx_genrt_example_provider", "onnx_genrt_broken_plugin", "onnx_genrt_faulty")
    for mod in [m for m in sys.modules if m.startswith(prefixes)]:
        del sys.modules[mod]
    importlib.invalidate_caches()
    reset_registry()


def _cli(target: Path, *args: str) -> subprocess.CompletedProcess:
    """``onnx-genrt ARGS`` as a real process that sees the installed plugins."""
    script = Path(sys.executable).with_name("onnx-genrt")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "onnx_genrt.cli"]
    path = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        timeout=120,
    )


@pytest.fixture(scope="module")
def providers_output(installed_plugins) -> str:
    """``onnx-genrt providers`` with every test plugin installed: it exits 0."""
    done = _cli(installed_plugins, "providers")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    return done.stdout


def _line_for(output: str, entry_point: str) -> str:
    lines = [line for line in output.splitlines() if f"(entry point {entry_point} = " in line]
    assert len(lines) == 1, f"expected one line for entry point {entry_point}:\n{output}"
    return lines[0]


def _check_refused(entry_point: str, message: str, providers_output: str) -> ProviderRegistry:
    """The fault is listed by ``onnx-genrt providers`` and recorded in-process with the
    distribution's name and version; the CPU provider still runs a model."""
    line = _line_for(providers_output, entry_point)
    assert line.strip().startswith(f"{FAULTY} (entry point {entry_point} = ")
    assert message in line
    reg = _registry_with(entry_point)
    (error,) = reg.errors
    assert error.plugin.startswith(f"{FAULTY} (entry point {entry_point} = ")
    assert message in error.error
    assert set(reg.names()) == {"cpu", "cuda"}
    assert_cpu_session_runs([reg.create("cpu")])
    assert_cpu_session_runs(["cpu"])  # the process-wide registry, every plugin installed
    return reg


def test_plugin_calling_sys_exit_at_import_is_reported(installed_plugins, providers_output):
    # providers_output: the real command survived the exit, went on and exited 0.
    message = (
        "import failed: SystemExit: this plugin exits at import on purpose "
        "(a plugin must not exit the process)"
    )
    _check_refused("exits_at_import", message, providers_output)


def test_plugin_raising_at_import_is_reported(installed_plugins, providers_output):
    line = _line_for(providers_output, "broken")
    assert line.strip() == (
        "onnx-genrt-broken-plugin 0.1.0 (entry point broken = onnx_genrt_broken_plugin): "
        "import failed: RuntimeError: this plugin is broken on purpose"
    )
    reg = _registry_with("broken")
    assert [e.error for e in reg.errors] == [
        "import failed: RuntimeError: this plugin is broken on purpose"
    ]
    assert_cpu_session_runs([reg.create("cpu")])
    assert_cpu_session_runs(["cpu"])


def test_registering_something_that_is_not_a_spec_is_reported(installed_plugins, providers_output):
    _check_refused(
        "bad_spec",
        "register() was given str 'not a spec', not a ProviderSpec: call register(ProviderSpec(",
        providers_output,
    )


def test_factory_returning_a_non_provider_is_broken_and_never_used(
    installed_plugins, providers_output
):
    message = (
        "provider 'halfway': factory returned NotAProvider, not an ExecutionProvider: return "
        "an instance of a subclass of onnx_genrt.core.provider.ExecutionProvider"
    )
    assert message in _line_for(providers_output, "bad_factory")
    assert not re.search(r"^halfway\s", providers_output, re.MULTILINE)
    reg = _registry_with("bad_factory")
    with pytest.raises(ProviderUnavailableError, match="'halfway' from onnx-genrt-faulty-plugins"):
        reg.create("halfway")
    assert "halfway" not in reg.names() and message in reg.errors[0].error
    with pytest.raises(ProviderUnavailableError, match="'halfway' from .* is not used: provider"):
        reg.create("halfway")  # refused for good, with the reason
    with pytest.raises(ProviderUnavailableError, match="factory returned NotAProvider"):
        InferenceSession(mlp(hidden=8), providers=["halfway", "cpu"])
    assert_cpu_session_runs([reg.create("cpu")])
    assert_cpu_session_runs(["cpu"])


def test_plugin_cannot_take_over_the_cpu_name(installed_plugins, providers_output):
    reg = _check_refused(
        "takes_cpu",
        "provider 'cpu' is built into onnx-genrt 0.1.0; onnx-genrt-faulty-plugins 0.3.1 "
        "cannot take it over: give the provider another name",
        providers_output,
    )
    assert type(reg.create("cpu")) is CPUProvider
    assert type(get_registry().create("cpu")) is CPUProvider
    assert re.search(
        rf"^cpu\s+available\s+{API_RE}\s.*\sonnx-genrt 0\.1\.0\s", providers_output, re.M
    )


def test_incompatible_major_api_version_is_refused(installed_plugins, providers_output):
    _check_refused(
        "api_major",
        "provider 'future_major': written for provider API 2.0, but this onnx-genrt implements "
        f"{API}; a different major version is incompatible",
        providers_output,
    )
    with pytest.raises(ProviderUnavailableError, match="'future_major' .* is not used: .* API 2.0"):
        InferenceSession(mlp(hidden=8), providers=["future_major"])


def test_newer_minor_api_version_is_refused(installed_plugins, providers_output):
    _check_refused(
        "api_minor",
        f"provider 'future_minor': written for provider API 1.7, newer than the {API} this "
        "onnx-genrt implements: upgrade onnx-genrt",
        providers_output,
    )


def test_spec_without_api_version_is_refused(installed_plugins, providers_output):
    _check_refused(
        "no_version",
        f"provider 'unversioned': declares no provider API version; this onnx-genrt implements {API}",
        providers_output,
    )


def test_broken_plugin_does_not_affect_a_working_one(installed_plugins, providers_output):
    reg = _registry_with("example", "broken")
    assert [e.plugin for e in reg.errors] == [
        "onnx-genrt-broken-plugin 0.1.0 (entry point broken = onnx_genrt_broken_plugin)"
    ]
    assert set(reg.names()) == {"cpu", "cuda", "example"}
    assert re.search(
        r"^example\s+available\s+1\.1\s+primary, verify, draft\s+onnx-genrt-example-provider "
        r"0\.1\.0\s+example",
        providers_output,
        re.MULTILINE,
    )
    assert "broken plugins (8, not used):" in providers_output
    model = mlp(hidden=8)
    sess = InferenceSession(model, providers=[reg.create("example")])
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    (y,) = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, mlp_reference(model, x), rtol=1e-5, atol=1e-6)
    assert_cpu_session_runs([reg.create("cpu")])


def test_providers_verbose_shows_tracebacks(installed_plugins):
    done = _cli(installed_plugins, "providers", "--verbose")
    assert done.returncode == 0, done.stderr
    after = done.stdout.split("(entry point exits_at_import = ", 1)[1]
    assert "Traceback (most recent call last)" in after
    assert 'sys.exit("this plugin exits at import on purpose")' in after


def test_third_party_provider_is_discovered_and_runs_a_model(installed_plugins):
    registry = get_registry()
    infos = {p.name: p for p in registry.providers()}
    assert infos["example"].available
    assert infos["example"].distribution == "onnx-genrt-example-provider 0.1.0"
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


def test_providers_command_in_process_lists_broken_plugins(installed_plugins, capsys):
    assert cli_main(["providers"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^cpu\s+available\s", out, re.MULTILINE)
    assert re.search(rf"^cuda\s+(available|unavailable)\s+{API_RE}\s", out, re.MULTILINE)
    assert "broken plugins (8, not used):" in out


def test_providers_command_reports_a_factory_that_raises(monkeypatch, capsys):
    import onnx_genrt.core.registry as registry_module

    def refuse(**options):
        raise RuntimeError("driver said no")

    class Plugin:
        @hookimpl
        def register_providers(self, register):
            register(ProviderSpec("boom", factory=refuse, api_version=(1, 0)))

    reg = _registry_with()
    reg.register_plugin(Plugin(), name="boom")
    monkeypatch.setattr(registry_module, "_default", reg)
    assert cli_main(["providers", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^boom\s+failed\s+1\.0\s+-\s+in-process plugin 'boom'\s+provider 'boom' \(in-process "
        r"plugin 'boom'\) could not be created: RuntimeError: driver said no$",
        out,
        re.MULTILINE,
    )
    assert 'raise RuntimeError("driver said no")' in out  # --verbose: the traceback
    assert re.search(rf"^cpu\s+available\s+{API_RE}\s+primary, verify, draft\s", out, re.MULTILINE)
    assert "broken plugins" not in out  # a factory that raises is not a broken plugin


def test_providers_command_prints_a_providers_status_notes(monkeypatch, capsys):
    """What a provider says of itself (``status_notes``: a feature on, or off and why) is
    printed beside it; a provider with nothing to say prints its description alone."""
    import onnx_genrt.core.registry as registry_module

    class Noted(CPUProvider):
        name = "noted"

        def status_notes(self):
            return ("fast path: off (needs a newer driver)", "cache: on")

    class Plugin:
        @hookimpl
        def register_providers(self, register):
            register(ProviderSpec("noted", factory=Noted, api_version=(1, 0), description="d"))

    reg = _registry_with()
    reg.register_plugin(Plugin(), name="noted")
    monkeypatch.setattr(registry_module, "_default", reg)
    assert cli_main(["providers"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^noted\s+available\s.*  d; fast path: off \(needs a newer driver\); cache: on$",
        out,
        re.MULTILINE,
    )
    assert CPUProvider().status_notes() == ()
    assert re.search(r"^cpu\s+available\s.*\S$", out, re.MULTILINE)
    assert not re.search(r"^cpu\s.*; ", out, re.MULTILINE)
