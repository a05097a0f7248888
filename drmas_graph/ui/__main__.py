import sys

from drmas_graph.cli import ui_main

sys.exit(ui_main())
