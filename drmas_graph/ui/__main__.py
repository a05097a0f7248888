import sys

from drmas_graph.cli._ui import main

sys.exit(main())
