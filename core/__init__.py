"""Core: tensors, dtypes, the execution-provider interface, graph slots and the plugin registry."""
