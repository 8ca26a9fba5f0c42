"""The training tools: the corpus, the target as teacher, ``make draft`` (the draft LM), ``make speculator`` (EAGLE)."""
