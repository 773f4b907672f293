"""Plugins with one loading fault each, for the registry's isolation tests."""
