"""The round's policy in one room: which steps run, with which method and k, within which budget.

- :mod:`.k_schedule`: k from step to step (transformers' ``constant`` and ``heuristic`` schedules) and vLLM's
  ``disable_by_batch_size``;
- :mod:`.chunked_prefill`: the round's token budget (``max_num_batched_tokens``) over running steps and prompts;
- :mod:`.auto` and :mod:`.round_cost`: ``speculative_method=auto``, the goodput rule over a cost model learned from
  the rounds (the target's forward seconds travel in every step's result);
- :mod:`.plan`: the frozen :class:`~.plan.RoundPlan` and :class:`~.plan.Scheduler`, whose ``run_round`` (plan, run,
  observe) serves both the ``generate`` model and the in-process transport.

The submodules are imported by name (this package imports none of them, so the settings can read the schedules'
names without loading the rest).
"""
