"""The GPU check (``make gpu-check``): the verifier's Triton kernels and the served models' CUDA path, in minutes.

    PYTHONPATH=backend_src:. python3 -m bench.gpu_check [--device auto|cuda|cpu] [--output results/gpu_check.json]

Made for a GPU machine lent for minutes, with no network, no tritonserver and no install of the package (hence the
``PYTHONPATH``): it needs only torch, triton, transformers and numpy, installs nothing and downloads nothing. It writes
one JSON and prints a short table; the exit status is 1 when a check fails or a part or run is skipped. docs/gpus.md
says what it needs (C compiler, Python headers, GPU memory, disk) and the versions it has been run with.

Its parts, one module each:

1. ``kernels`` (:mod:`.kernels`): the Triton kernels against the torch path on the same device, fed the same noise
   (uniform accept draws and the exponential race as tensors), for V in {49152, 128256, 151936}, k in {1, 4, 8}, B in
   {1, 8, 64}, float32 and bfloat16: rejection sampling with and without draft probabilities and typical acceptance,
   greedy and sampled rows, outputs equal token for token. Then: a distribution test of the kernels' own (Philox)
   randomness (the first emitted token follows the target's distribution, and so do the next one after an accepted
   draft and the bonus token after k accepted drafts: chi-square over 2^20 rows); a batch of more than 2^31 elements
   (B x (k+1) x V, bfloat16: 64-bit offsets) against the torch path; seeded rows batch-invariant (a row alone, in its
   batch, and in the batch reversed gives the same tokens, on both paths).
2. ``bandwidth`` (:mod:`.bandwidth`): the verifier at B = 64, k = 5, V = 128256 (draft probabilities, sampled and
   greedy rows, float32 and bfloat16): bytes of probabilities per second against the device's copy bandwidth measured
   in the same run (a 1 GiB device-to-device copy, read + write), for the kernel launch, the public
   ``rejection_sample`` on each backend and the torch maths alone.
3. ``decoding`` (:mod:`.decoding`): speculative decoding in process
   (:class:`spec_decode.serving.local_ensemble.LocalEnsemble`: the three served backends, rows stacked and padded as
   the Triton ensemble passes them) with a random-weight Llama target of about 1.2B parameters, a 2-layer
   early-exit draft and a random head of each published speculator layout (:mod:`.speculators`: EAGLE-1, EAGLE-3,
   Medusa, MLP speculator, Arctic LSTM, served together through ``speculator_path``), greedy, k = 4: every method's
   output must equal the target's plain greedy decoding by transformers' ``generate`` token for token (in bfloat16 a
   divergence at a near-tie is reported as such), each model proposer must draft as many tokens per step as k or its
   head allows, and the heads' other layouts (vLLM's EAGLE-1 and Medusa, Arctic's MLP) must draft as the served ones;
   with tokens/s, acceptance and mean tokens per step; then the forward cost of 1-9 new positions on a 300-token
   cache.

:mod:`.context` holds the sizes (full on CUDA, tiny on CPU) and the failure record; :mod:`.report` the versions and
the table; :mod:`.__main__` the command line.

``--device cpu`` (the default when CUDA is not available) runs the same code at tiny sizes, the kernels under
``TRITON_INTERPRET=1``: the unit tests run it, so the check cannot rot between GPU sessions. Nothing here imports
torch or triton on import of this package: :func:`bench.gpu_check.__main__.main` sets ``TRITON_INTERPRET`` first,
since triton reads it when the kernels are defined.
"""
