"""The verified-math app's graph: the math app's solver/verifier loop (`graphs.math.graph`), unchanged.

The app differs from `graphs/math` only in what it pays (`graphs.verified_math.env`): the solver is paid for
the final answer, the verifier for each verdict being right. The graph's transcript already records, per
verifier turn, the solver round it judged, which is all the reward needs. Like every app here it does not
import ``drmas_graph``.
"""

from __future__ import annotations

from graphs.math.graph import build_graph

__all__ = ["build_graph"]
