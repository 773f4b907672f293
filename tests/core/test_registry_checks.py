"""Details of plugin loading in ``core.registry`` that a user reads (found by a mutation run:
the load order across distributions, a plugin object registered twice, the length limits of
messages, the traceback kept for ``providers --verbose`` and the hint of a major API
mismatch had no test). Entry points are stand-ins with a distribution, loaded in-process."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from onnx_genrt.core.hookspecs import hookimpl
from onnx_genrt.core.registry import ProviderRegistry, ProviderSpec, api_version_problem
from onnx_genrt.providers.cpu.provider import CPUProvider


@dataclass
class FakeEntryPoint:
    """What the registry reads of an ``importlib.metadata.EntryPoint``."""

    name: str
    distribution: str
    plugin: Any

    @property
    def value(self) -> str:
        return f"{self.distribution.replace('-', '_')}:{self.name}"

    @property
    def dist(self) -> SimpleNamespace:
        return SimpleNamespace(name=self.distribution, version="1.0")

    def load(self) -> Any:
        return self.plugin


class RegistersNothing:
    """A plugin without the hook: each one is an error, recorded in load order."""


def _raising(message: str) -> object:
    class Raises:
        @hookimpl
        def register_providers(self, register):
            raise RuntimeError(message)

    return Raises()


def test_plugins_load_built_ins_first_then_by_distribution_then_entry_point():
    eps = [
        FakeEntryPoint("a", "zeta-plugins", RegistersNothing()),
        FakeEntryPoint("z", "alpha-plugins", RegistersNothing()),
        FakeEntryPoint("b", "alpha-plugins", RegistersNothing()),
        FakeEntryPoint("m", "onnx_genrt", RegistersNothing()),  # the built-ins' distribution
    ]
    reg = ProviderRegistry(entry_points=eps)
    assert [e.plugin for e in reg.errors] == [
        "onnx_genrt 1.0 (entry point m = onnx_genrt:m)",
        "alpha-plugins 1.0 (entry point b = alpha_plugins:b)",
        "alpha-plugins 1.0 (entry point z = alpha_plugins:z)",
        "zeta-plugins 1.0 (entry point a = zeta_plugins:a)",
    ]


def test_one_plugin_object_registered_twice_names_the_first_registration():
    plugin = RegistersNothing()
    reg = ProviderRegistry(entry_points=[])
    reg.register_plugin(plugin, name="first")
    reg.register_plugin(plugin, name="second")
    assert [e.error for e in reg.errors] == [
        "registered no providers: define register_providers(register) marked "
        "@onnx_genrt.core.hookspecs.hookimpl and call register(ProviderSpec(...))",
        "already registered as <in-process>:first",
    ]


def test_a_long_exception_message_is_cut_to_300_characters():
    prefix = "register_providers raised RuntimeError: "
    room = 300 - len("RuntimeError: ")
    reg = ProviderRegistry(entry_points=[])
    reg.register_plugin(_raising("x" * room), name="fits")
    reg.register_plugin(_raising("y" * (room + 1)), name="too_long")
    fits, cut = (e.error for e in reg.errors)
    assert fits == prefix + "x" * room
    assert cut == prefix + "y" * (room - 3) + "..."


def test_something_registered_that_is_not_a_spec_shows_60_characters_of_it():
    class Plugin:
        @hookimpl
        def register_providers(self, register):
            register("w" * 100)

    reg = ProviderRegistry(entry_points=[])
    reg.register_plugin(Plugin(), name="odd")
    shown = repr("w" * 100)[:57] + "..."
    assert reg.errors[0].error.startswith(f"register() was given str {shown}, not a ProviderSpec")


def test_the_traceback_is_kept_for_an_exception_and_nothing_otherwise():
    reg = ProviderRegistry(entry_points=[])
    reg.register_plugin(_raising("no devices"), name="raises")
    reg.register_plugin(RegistersNothing(), name="empty")
    raised, empty = reg.errors
    assert raised.detail.startswith("Traceback (most recent call last):")
    assert raised.detail.rstrip().endswith("RuntimeError: no devices")
    assert empty.detail == ""


def test_a_major_version_mismatch_names_the_build_to_install(monkeypatch):
    import onnx_genrt.core.registry as registry_module

    monkeypatch.setattr(registry_module, "PROVIDER_API_VERSION", (4, 7))
    message = api_version_problem((3, 9))
    assert message.endswith("install a build of the plugin for API 4.x")


def test_a_spec_whose_name_is_not_hashable_is_refused_and_others_load():
    """A name that is a list is refused like any unusable name; the refusal is not looked
    up by that name (a list is no dict key), so the registry and the plugin's other provider
    still load."""

    class Plugin:
        @hookimpl
        def register_providers(self, register):
            register(ProviderSpec(["cpu2"], factory=CPUProvider, api_version=(1, 0)))
            register(ProviderSpec("fine", factory=CPUProvider, api_version=(1, 0)))

    reg = ProviderRegistry(entry_points=[])
    reg.register_plugin(Plugin(), name="listed")
    assert reg.names() == ["fine"]
    assert [e.error for e in reg.errors] == [
        "provider name ['cpu2'] is not usable: use letters, digits, '_', '-' or '.' "
        "(it is written in provider lists such as --provider a,b)"
    ]
