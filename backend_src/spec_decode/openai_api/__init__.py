"""An OpenAI-compatible HTTP server in front of Triton's ``generate`` (docs/openai.md).

Modules: :mod:`.app` (the Starlette app and its routes), :mod:`.params` (request bodies -> ``generate`` inputs),
:mod:`.responses` (OpenAI response objects and streamed chunks), :mod:`.triton` (the gRPC streaming client of
``generate``), :mod:`.errors` (OpenAI's error objects), :mod:`.__main__` (``python -m spec_decode.openai_api``, which
the launcher starts beside tritonserver on ``OPENAI_PORT``).
"""
