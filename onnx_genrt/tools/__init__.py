"""Developer tools that measure the runtime, each an ``onnx-genrt`` command: ``bench``
(:mod:`.llm_bench`, with ``--dispatch`` :mod:`.dispatch_bench`), ``profile``
(:mod:`.step_profile`) and ``step-cost`` (:mod:`.step_cost`).

A command module has ``add_parser(sub)``, which ``onnx_genrt.cli.build_parser`` calls;
docs/architecture.md ("Where new code goes") says what goes here, what stays beside the
user commands in ``onnx_genrt/`` and what goes in ``scripts/``."""
