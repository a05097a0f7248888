"""Math with a verifier paid for its own job: the math graph, with a reward per agent (see `env`)."""
