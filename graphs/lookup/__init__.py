"""A tool-using pair: a caller looks a fact up in a per-task random table, an answerer writes the answer."""
