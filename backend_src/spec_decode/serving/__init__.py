"""Serving: one backend per model (draft_model, target_model, verifier_model, generate, generate_trtllm), plus the wire
module.

- :mod:`.wire`: every tensor of every model in the repository (name, Triton dtype, dims) and the scalar decoder; the
  config.pbtxt files are tested against it.
- :mod:`.draft_model`, :mod:`.target_model`, :mod:`.verifier_model`, :mod:`.generate`, :mod:`.trtllm_format`
  (``generate_trtllm``: generate for NVIDIA's OpenAI frontend): the backends behind each
  ``model_repository/<model>/1/model.py``. Each takes plain numpy/torch inputs and returns plain outputs, so it is
  testable without Triton.
- :mod:`.adapter`: the pb_utils boundary (:func:`~.adapter.execute` converts Triton's tensors for the backends);
  :mod:`.generate_inputs` decodes and checks generate's inputs, :mod:`.step_inputs` a step row; :mod:`.batching`
  serves the rows of one ``execute()`` together.
- :mod:`.rounds` and :mod:`.triton_step`: generate's lockstep rounds and their BLS transport to the step ensembles;
  :mod:`.local_ensemble` runs the same round in one process.
- :mod:`.metrics`: the Prometheus metrics every model exports.
"""
