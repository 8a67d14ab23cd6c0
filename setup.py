"""Builds the optional native copy helper; every other setting lives in pyproject.toml.

``optional=True``: a machine without a C compiler still installs kvswap, and the shared-memory
mover falls back to preadv/pwritev (daemon/movers/segment.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvswap.daemon.movers._fastcopy", ["daemon/movers/_fastcopy.c"],
                             extra_compile_args=["-O2"], optional=True)])
