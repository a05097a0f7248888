"""`python -m drmas_graph.cli ...` (what `torchrun -m` and `deepspeed --module` run): the `drmas-graph` command."""

from drmas_graph.cli import main

raise SystemExit(main())
