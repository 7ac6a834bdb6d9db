"""Only the C extensions live here; everything else is in pyproject.toml."""
import os

from setuptools import Extension, setup


def _ucx() -> list:
    """kvbench._ucx, where the libucx wheel (ucxx's UCX, with its headers) is installed in this interpreter: built by
    `make install` after the engines (transports/ucx_rma.py says what is missing where it is not)."""
    try:
        import libucx
    except ImportError:
        return []
    home = os.path.dirname(libucx.__file__)
    if not os.path.exists(os.path.join(home, "include", "ucp", "api", "ucp.h")):
        return []
    lib = os.path.join(home, "lib")
    return [Extension("kvbench._ucx", ["kvbench/_ucx.c"], depends=["kvbench/_module.h"],
                      extra_compile_args=["-O2", "-Wno-sign-compare"],  # UCX's own headers would warn on every build
                      include_dirs=[os.path.join(home, "include")], library_dirs=[lib], runtime_library_dirs=[lib],
                      libraries=["ucp", "ucs"])]


setup(ext_modules=[Extension("kvbench._native", ["kvbench/_native.c"], depends=["kvbench/_module.h"], extra_compile_args=["-O2"]),
                   Extension("kvbench._codec", ["kvbench/_codec.c"], depends=["kvbench/_module.h"], extra_compile_args=["-O3"]),
                   Extension("kvbench._keyed", ["kvbench/_keyed.c"], depends=["kvbench/_module.h"], extra_compile_args=["-O3"]),
                   Extension("kvbench._mpicalls", ["kvbench/_mpicalls.c"], depends=["kvbench/_module.h"],
                             extra_compile_args=["-O2"])] + _ucx())
