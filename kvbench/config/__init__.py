"""What to run: suites (YAML sweep definitions, validated and expanded into cases: suite) and the one validated
run configuration built from flags and a suite on rank 0 (runconfig).

Public API: ``suite.load``, ``suite.expand``, ``suite.SuiteError``, ``runconfig.RunConfig``.
"""


class ConfigError(ValueError):
    """A mistake in what the user asked for: one line, exit 1, nothing written (runconfig and tracecfg raise it)."""
