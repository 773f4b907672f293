"""Measurement commands of ``onnx-genrt``: ``bench`` (``llm_bench``, with ``dispatch_bench``
for ``--dispatch``), ``profile`` (``step_profile``) and ``step-cost`` (``step_cost``).

The rule: every ``onnx-genrt`` subcommand is installed with the package; user commands
(generate, chat, serve, inspect, conformance, check-provider) sit in ``onnx_genrt/``,
measurement commands here; one-off developer scripts that are not installed (model training,
the GPU lane, HF comparisons) live in ``scripts/`` (``scripts/README.md``)."""
