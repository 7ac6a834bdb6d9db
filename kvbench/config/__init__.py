"""What to run: suites (YAML sweep definitions, validated and expanded into cases: suite) and the one validated
run configuration built from flags and a suite on rank 0 (runconfig).

Public API: ``suite.load``, ``suite.expand``, ``suite.SuiteError``, ``runconfig.RunConfig``.
"""
