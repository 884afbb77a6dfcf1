"""Builds the optional C extensions; everything else is in pyproject.toml.

``optional=True``: where no C compiler is available the build skips them and the Python
code, which stays the reference either way, does their work: the receivers read binary
requests with protobuf's parser alone (``otlp/decode.py``) and build every row of an
action in Python (``store/base.py``'s ``action_row``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "durable_sessions_collector.otlp._wire",
            ["src/durable_sessions_collector/otlp/_wire.c"],
            optional=True,
        ),
        Extension(
            "durable_sessions_collector.store._rows",
            ["src/durable_sessions_collector/store/_rows.c"],
            optional=True,
        ),
    ]
)
