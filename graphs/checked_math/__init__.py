"""Checked math: a solver answers once, a checker judges three answers (the solver's and two planted ones) and
is paid per verdict (study v2 of benchmarks/learning)."""
