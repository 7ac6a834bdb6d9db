"""The commands: ``kvbench`` and its subcommands (main), the flags they share (args), ``run`` (run), ``size``,
``list`` and ``env`` (info), ``fit`` and ``plan`` (plan), ``trace`` (trace), ``probe`` (probe), and rank 0's progress
bar (progress).

Public API: ``main.main`` (the console script) and ``main.build_parser``.
"""
