"""Triton-facing code: the backends behind each model's ``model.py`` and the tensor adapter.

Each backend takes plain numpy/torch inputs and returns plain outputs, so it is testable without Triton;
:func:`~spec_decode.serving.adapter.execute` converts ``pb_utils`` tensors at the boundary.
"""
