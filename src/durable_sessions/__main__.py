import sys

from durable_sessions.cli import main

sys.exit(main())
