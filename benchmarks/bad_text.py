"""What marking the strings that are not UTF-8 text of an OTLP/JSON body costs
(``bad_text.marked``, asked once orjson has refused the body), in C and in Python.

The sidecar's OTLP/JSON receiver and ``durable-sessions check``'s OTLP/JSON reader call
it on every body orjson refuses, and it holds the GIL throughout: in the sidecar, its
writer thread and every other receiver wait for it. Bodies of ``--mib`` MiB:

- ``tiny bad strings``: ``{"a":["\\xff\\xfe","\\xff\\xfe",...,"x"]}``, millions of bad
  strings, each a mark;
- ``CJK, one bad byte``: short strings of CJK text (valid UTF-8 that is not ASCII, each
  looked at) and one bad string at the end.

Setups, alternating round by round in one process (the median round is reported): ``C``
(``durable_sessions._native.mark_bad_strings``) and ``Python``
(``DURABLE_SESSIONS_NATIVE=false``: ``reference_mark_bad_strings``).

Run::

    .venv/bin/python benchmarks/bad_text.py [--mib 16] [--rounds 3]

It measures and prints; it asserts nothing (beyond both setups marking the same).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from durable_sessions import bad_text
from durable_sessions.native import SWITCH, native_module


def tiny_bad_strings(mib: float) -> bytes:
    string = b'"\xff\xfe",'
    return b'{"a":[' + string * int(mib * 2**20 / len(string)) + b'"x"]}'


def cjk_one_bad_byte(mib: float) -> bytes:
    words = ['"東京",', '"日本語",', '"会話の記録",', '"ツール呼び出し",']
    chunk = "".join(words).encode()
    return b'{"a":[' + chunk * int(mib * 2**20 / len(chunk)) + b'"\xff"]}'


def timed(body: bytes, native: bool) -> tuple[float, bad_text.Marked | None]:
    if native:
        os.environ.pop(SWITCH, None)
    else:
        os.environ[SWITCH] = "false"
    started = time.perf_counter()
    found = bad_text.marked(body)
    return time.perf_counter() - started, found


def measure(name: str, body: bytes, rounds: int) -> None:
    mib = len(body) / 2**20
    times: dict[str, list[float]] = {"C": [], "Python": []}
    for number in range(1, rounds + 1):
        (c_time, c_found), (python_time, python_found) = timed(body, True), timed(body, False)
        assert c_found == python_found, "the C path and the reference marked differently"
        times["C"].append(c_time)
        times["Python"].append(python_time)
        print(f"  round {number}: C {c_time * 1000:.0f} ms, Python {python_time * 1000:.0f} ms")
    marks = 0 if c_found is None else len(c_found.details)
    print(f"{name}: {mib:.1f} MiB, {marks:,} marks")
    for setup, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {setup:6} median {median * 1000:8.0f} ms ({median / mib * 1000:.1f} ms per MiB)")
    ratios = [c / p for c, p in zip(times["C"], times["Python"], strict=True)]
    print(f"  C / Python: median of the rounds' ratios {statistics.median(ratios):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if native_module() is None:
        raise SystemExit(
            f"durable_sessions._native was not built (or {SWITCH} turns it off): nothing to compare"
        )
    print(f"Python {platform.python_version()}, {platform.machine()}")
    measure("tiny bad strings", tiny_bad_strings(args.mib), args.rounds)
    measure("CJK, one bad byte", cjk_one_bad_byte(args.mib), args.rounds)


if __name__ == "__main__":
    main()
