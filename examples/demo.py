"""`make demo`: check the example logs and print which sessions are unrecoverable and why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent


def main() -> int:
    logs = sorted(str(p) for p in (EXAMPLES / "logs").glob("*.jsonl")) or sorted(
        str(p) for p in EXAMPLES.glob("*.jsonl")
    )
    if not logs:
        print("no example logs found", file=sys.stderr)
        return 2
    print(f"$ durable-sessions check --strict {len(logs)} example log(s)\n", flush=True)
    result = subprocess.run([sys.executable, "-m", "durable_sessions", "check", "--strict", *logs])
    return 0 if result.returncode in (0, 1) else result.returncode


if __name__ == "__main__":
    sys.exit(main())
