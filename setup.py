"""Builds the optional C extensions; everything else is in pyproject.toml.

``optional=True``: where no C compiler (or no POSIX threads) is available the build
skips them, ``checking="process"`` uses its pure-Python sender and the engine
dispatches records and folds them into session memory in Python
(``durable_sessions.native``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "durable_sessions._native",
            ["src/durable_sessions/_native.c"],
            optional=True,
        ),
        Extension(
            "durable_sessions._engine",
            ["src/durable_sessions/_engine.c"],
            optional=True,
        ),
        Extension(
            "durable_sessions._memory",
            ["src/durable_sessions/_memory.c"],
            optional=True,
        ),
        Extension(
            "durable_sessions._mapping",
            ["src/durable_sessions/_mapping.c"],
            optional=True,
        ),
    ]
)
