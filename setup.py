"""Only the C extensions live here; everything else is in pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("kvbench._native", ["kvbench/_native.c"], depends=["kvbench/_module.h"], extra_compile_args=["-O2"]),
                   Extension("kvbench._codec", ["kvbench/_codec.c"], depends=["kvbench/_module.h"], extra_compile_args=["-O3"]),
                   Extension("kvbench._keyed", ["kvbench/_keyed.c"], depends=["kvbench/_module.h"], extra_compile_args=["-O3"]),
                   Extension("kvbench._mpicalls", ["kvbench/_mpicalls.c"], depends=["kvbench/_module.h"],
                             extra_compile_args=["-O2"])])
