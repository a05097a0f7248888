import sys

from drmas_graph.ui import main

sys.exit(main())
