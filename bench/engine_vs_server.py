"""What serving costs plain decoding: ``none`` through the real server against the same engine driven in process.

The same target, loaded as target_model loads it (its config defaults: :class:`~spec_decode.settings.TargetSettings`,
the paged KV pool), decodes the same held-out HumanEval prompts greedily (``ignore_eos``, so every request has the
same length) two ways, prompt by prompt in alternating order so that drift on a shared machine hits both:

- in process: :func:`spec_decode.in_process.run_local` with no proposer (a step is the target's forward and the
  verifier's argmax), one sequence at a time;
- through the server: one streamed gRPC ``generate`` request at a time (generate and target_model, each its own
  process: generate walks a greedy round's argmax itself, :mod:`spec_decode.serving.triton_step`).

Prints tokens/s of each and their ratio (goal: the server >= 0.95x in process), saves JSON.

    python -m bench.engine_vs_server --output results/engine_vs_server.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

GOAL = 0.95


def main(argv: list[str] | None = None) -> int:
    """Run both paths over the prompts; print and save the figures."""
    from client.datasets import humaneval_prompts
    from client.generate import stream_generate
    from spec_decode.engine.model_loading import load_cached_lm, load_tokenizer, resolve_model_path
    from spec_decode.engine.scorer import TargetScorer
    from spec_decode.generation import Generation
    from spec_decode.in_process import LocalStep, run_local
    from spec_decode.launcher import TritonServer, prepare_repository
    from spec_decode.request import GenerationRequest
    from spec_decode.settings import TargetSettings

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=6, help="held-out HumanEval prompts (default 6)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--output", type=Path, default=Path("results/engine_vs_server.json"))
    args = ap.parse_args(argv)

    path = resolve_model_path("default")
    tokenizer = load_tokenizer(path)
    step = LocalStep({}, TargetScorer(load_cached_lm(path, TargetSettings.from_params({}))))
    prompts = humaneval_prompts(args.prompts)

    def in_process(i: int, prompt: str) -> tuple[int, float]:
        req = GenerationRequest(prompt, args.max_tokens, speculative_method="none", ignore_eos=True)
        gen = Generation(1000 + i, tokenizer(prompt)["input_ids"], req, tokenizer, [], 4096, 0)
        t0 = time.perf_counter()
        run_local(gen, step)
        return len(gen.output_ids), time.perf_counter() - t0

    rows = []
    logdir = Path(tempfile.mkdtemp(prefix="spec_decode_engine_vs_server_"))
    with TritonServer(prepare_repository(None), log_path=logdir / "server.log") as srv:
        srv.wait_ready(timeout=900)

        def served(i: int, prompt: str) -> tuple[int, float]:
            t0 = time.perf_counter()
            r = stream_generate(srv.grpc_url, prompt, args.max_tokens, speculative_method="none", ignore_eos=True)
            return len(r.output_ids), time.perf_counter() - t0

        served(-1, "warm up"), in_process(-1, "warm up")
        for i, prompt in enumerate(prompts):
            order = (("in_process", in_process), ("server", served))
            for name, fn in (order if i % 2 == 0 else order[::-1]):
                tokens, seconds = fn(i, prompt)
                rows.append({"prompt": i, "path": name, "tokens": tokens, "seconds": seconds})
                print(f"prompt {i:>2} {name:<10} {tokens / seconds:7.2f} tokens/s", flush=True)
    tps = {p: sum(r["tokens"] for r in rows if r["path"] == p) / sum(r["seconds"] for r in rows if r["path"] == p)
           for p in ("in_process", "server")}
    ratio = tps["server"] / tps["in_process"]
    print(f"\nin process {tps['in_process']:.2f} tokens/s, through the server {tps['server']:.2f}: {ratio:.3f}x "
          f"(goal >= {GOAL}: {'reached' if ratio >= GOAL else 'NOT reached'})")
    result = {"tokens_per_s": tps, "server_over_in_process": ratio, "goal": GOAL, "reached": ratio >= GOAL,
              "rows": rows, "settings": vars(args) | {"output": str(args.output)}, "machine": platform.platform(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
