"""The training tools: the corpus, the target as teacher, their command line, ``make draft`` and ``make speculator``."""
