import sys

from raftps.tools.cli import main

sys.exit(main())
