"""A plugin that fails at import, for the registry's error-isolation test."""

raise RuntimeError("this plugin is broken on purpose")
