import sys

from durable_sessions_collector.cli import main

sys.exit(main())
