"""Stream a generation from the ``generate`` model over gRPC and report TTFT, tokens/s and tokens per step.

Usage:
    python -m client.generate --url 127.0.0.1:8001 --prompt "def fib(n):" --max-tokens 64
    python -m client.generate --humaneval 3 --method ngram --num-draft-tokens 4
    python -m client.generate --prompts-file prompts.txt --temperature 0.8 --seed 1   # one prompt per line
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class GenerationResult:
    """One streamed generation as the client saw it.

    Attributes:
        text: concatenated text_output of every response.
        output_ids: concatenated output_ids.
        responses: per-response (seconds since send, text, ids).
        ttft_s: time to first token (s): from sending to the first response with tokens.
        total_s: from sending to the final response (s).
        stats: the final response's statistics (num_steps, num_draft_tokens_total, num_accepted_tokens,
            num_emitted_tokens, finish_reason, cum_log_probs), the per-token outputs joined over the responses
            (output_log_probs, output_token_ranks: one value per output id; top_log_probs, top_log_prob_ids: a list of
            N per output id) and the prompt's (prompt_log_probs, prompt_token_ranks, prompt_top_log_probs,
            prompt_top_log_prob_ids), when the request asked for them; with ``speculative_method=auto``,
            auto_methods, auto_num_draft_tokens, auto_draft_trees and auto_tree_top_k (its choice at each step).
    """

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    responses: list[tuple[float, str, list[int]]] = field(default_factory=list)
    ttft_s: float = 0.0
    total_s: float = 0.0
    stats: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second over the whole request (including TTFT)."""
        return len(self.output_ids) / self.total_s if self.total_s else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean emitted tokens per speculative step."""
        steps = self.stats.get("num_steps", 0)
        return self.stats.get("num_emitted_tokens", 0) / steps if steps else 0.0


def build_inputs(prompt: str, max_tokens: int, **params):
    """gRPC input tensors for ``generate``: text_input, max_tokens, plus any optional input given (None = omitted).

    Optional keyword names and types: temperature, top_p, repetition_penalty, presence_penalty, frequency_penalty
    (FP32); top_k, num_draft_tokens, tree_top_k, tree_depth, end_id, min_tokens, min_length, top_logprobs,
    prompt_logprobs, beam_width, num_return_sequences, n (INT32); random_seed (UINT64); stream,
    exclude_input_in_output, return_log_probs, ignore_eos, draft_tree (BOOL); speculative_method, acceptance_method,
    guided_decoding_guide_type, guided_decoding_guide (STRING); stop_words, bad_words (list of STRING); stop_token_ids
    (list of INT32). docs/client.md has their meaning.

    Raises:
        ValueError: a name that is not an input of generate.
    """
    import tritonclient.grpc as grpcclient

    types = {name: ("FP32", np.float32) for name in ("temperature", "top_p", "repetition_penalty",
                                                    "presence_penalty", "frequency_penalty")}
    types.update({name: ("INT32", np.int32) for name in (
        "top_k", "num_draft_tokens", "tree_top_k", "tree_depth", "end_id", "min_tokens", "min_length", "top_logprobs",
        "prompt_logprobs", "beam_width", "num_return_sequences", "n")})
    types.update({name: ("BOOL", np.bool_) for name in ("stream", "exclude_input_in_output", "return_log_probs",
                                                       "ignore_eos", "draft_tree")})
    types.update({name: ("BYTES", np.object_) for name in ("speculative_method", "acceptance_method",
                                                          "guided_decoding_guide_type", "guided_decoding_guide")})
    types["random_seed"] = ("UINT64", np.uint64)
    values = {"text_input": ("BYTES", np.array([prompt.encode() if isinstance(prompt, str) else prompt], np.object_)),
              "max_tokens": ("INT32", np.array([max_tokens], np.int32))}
    for name, value in params.items():
        if value is None:
            continue
        if name in ("stop_words", "bad_words"):
            values[name] = ("BYTES", np.array([w.encode() for w in value], np.object_))
        elif name == "stop_token_ids":
            values[name] = ("INT32", np.array(list(value), np.int32))
        elif name in types:
            dt, npt = types[name]
            v = value.encode() if isinstance(value, str) else value
            values[name] = (dt, np.array([v], npt))
        else:
            raise ValueError(f"unknown generate input {name!r}")
    inputs = []
    for name, (dt, arr) in values.items():
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


_STATS = ("num_steps", "num_draft_tokens_total", "num_accepted_tokens", "num_emitted_tokens")
_PER_TOKEN = ("output_log_probs", "output_token_ranks", "top_log_probs", "top_log_prob_ids")  # joined over responses
_PROMPT = ("prompt_log_probs", "prompt_token_ranks", "prompt_top_log_probs", "prompt_top_log_prob_ids")


def stream_generate(url: str, prompt: str, max_tokens: int, on_text=None, timeout_s: float = 300.0, **params):
    """Send one request to ``generate`` over a gRPC stream and collect every response.

    Args:
        url: gRPC host:port.
        prompt: text_input.
        max_tokens: max_tokens.
        on_text: called with each response's text as it arrives (e.g. to print it).
        timeout_s: give up after this many seconds.
        **params: optional inputs (see :func:`build_inputs`); ``stream`` defaults to True here (one response per
            step), while the server's default is False (one response).

    Returns:
        :class:`GenerationResult`.

    Raises:
        tritonclient.utils.InferenceServerException: the server answered with an error.
        TimeoutError: no final response within ``timeout_s``.
    """
    import tritonclient.grpc as grpcclient

    params.setdefault("stream", True)
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    result = GenerationResult()
    client.start_stream(callback=lambda result, error: q.put((time.perf_counter(), result, error)))
    try:
        t0 = time.perf_counter()
        client.async_stream_infer("generate", build_inputs(prompt, max_tokens, **params),
                                  enable_empty_final_response=True)
        while True:
            t, res, err = q.get(timeout=max(0.0, timeout_s - (time.perf_counter() - t0)))
            if err is not None:
                raise err
            resp = res.get_response()
            final = resp.parameters["triton_final_response"].bool_param
            names = {o.name for o in resp.outputs}
            if "text_output" in names:
                text = res.as_numpy("text_output").reshape(-1)[0].decode("utf-8")
                ids = res.as_numpy("output_ids").reshape(-1).tolist()
                if ids and not result.output_ids:
                    result.ttft_s = t - t0
                result.text += text
                result.output_ids += ids
                result.responses.append((t - t0, text, ids))
                if on_text is not None and text:
                    on_text(text)
                for s in _STATS:
                    if s in names:
                        result.stats[s] = int(res.as_numpy(s).reshape(-1)[0])
                if "finish_reason" in names:
                    result.stats["finish_reason"] = res.as_numpy("finish_reason").reshape(-1)[0].decode()
                if "cum_log_probs" in names:
                    result.stats["cum_log_probs"] = float(res.as_numpy("cum_log_probs").reshape(-1)[0])
                for name in _PER_TOKEN:  # one entry (a float, an int or a list of N) per output id
                    if name in names:
                        rows = res.as_numpy(name).reshape(len(ids), -1) if ids else np.zeros((0, 0))
                        values = rows.tolist() if name.startswith("top_") else rows.reshape(-1).tolist()
                        result.stats.setdefault(name, []).extend(values)
                for name in _PROMPT:
                    if name in names:
                        result.stats[name] = res.as_numpy(name).tolist()
                if "auto_methods" in names:  # speculative_method=auto: its choice at each step
                    result.stats["auto_methods"] = [m.decode() for m in res.as_numpy("auto_methods").reshape(-1)]
                    for name in ("auto_num_draft_tokens", "auto_draft_trees", "auto_tree_top_k"):
                        if name in names:
                            result.stats[name] = res.as_numpy(name).reshape(-1).tolist()
            if final:
                result.total_s = t - t0
                return result
    except queue.Empty:
        raise TimeoutError(f"no final response within {timeout_s} s") from None
    finally:
        client.stop_stream()
        client.close()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: stream each prompt, print text live, then a summary line per prompt."""
    from .datasets import file_prompts, humaneval_prompts

    ap = argparse.ArgumentParser(description="Stream generations from the generate model over gRPC.")
    ap.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port (default 127.0.0.1:8001)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="a prompt")
    src.add_argument("--prompts-file", help="file with one prompt per line, or JSON Lines with a 'prompt' key")
    src.add_argument("--humaneval", type=int, metavar="N", help="the first N HumanEval prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--method", dest="speculative_method", default=None,
                    help="speculative_method: none, or a proposer the server serves (ngram, suffix, hybrid, draft, "
                         "...; its error lists them); the server's default when omitted")
    ap.add_argument("--acceptance", dest="acceptance_method", choices=["rejection", "typical"], default=None,
                    help="acceptance_method: rejection (lossless, default) or typical (faster, not lossless)")
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--draft-tree", dest="draft_tree", default=None, action=argparse.BooleanOptionalAction,
                    help="draft_tree: --draft-tree lets the proposer draft a tree, --no-draft-tree asks for chains "
                         "(the server's default when omitted; docs/trees.md)")
    ap.add_argument("--tree-top-k", dest="tree_top_k", type=int, default=None,
                    help="tree_top_k: the tree's children per expanded node, 0-10 (0 or omitted: draft_model's config)")
    ap.add_argument("--tree-depth", dest="tree_depth", type=int, default=None,
                    help="tree_depth: the tree's levels at most, 0-64 (0 or omitted: draft_model's config)")
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--seed", dest="random_seed", type=int, default=None)
    ap.add_argument("--stop", dest="stop_words", action="append", default=None, help="stop word (repeatable)")
    ap.add_argument("--json", action="store_true", help="print one JSON result per prompt instead of live text")
    args = ap.parse_args(argv)

    if args.prompt is not None:
        prompts = [args.prompt]
    elif args.prompts_file:
        prompts = file_prompts(args.prompts_file)
    else:
        prompts = humaneval_prompts(args.humaneval or 1)
    params = {k: getattr(args, k) for k in ("speculative_method", "acceptance_method", "num_draft_tokens",
                                            "draft_tree", "tree_top_k", "tree_depth", "temperature", "top_k",
                                            "top_p", "random_seed", "stop_words")}
    from tritonclient.utils import InferenceServerException

    try:
        for prompt in prompts:
            _run_one(args, prompt, params)
    except InferenceServerException as e:
        print(f"\nerror from the server: {e.message()}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
    return 0


def _run_one(args, prompt: str, params: dict) -> None:
    """Stream one prompt and print its text live (or one JSON line with --json)."""
    if not args.json:
        sys.stdout.write(f"\033[2m{prompt}\033[0m")
        sys.stdout.flush()
    on_text = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    r = stream_generate(args.url, prompt, args.max_tokens, on_text=on_text, **params)
    summary = {
        "ttft_ms": round(r.ttft_s * 1000, 1), "tokens": len(r.output_ids), "tokens_per_s": round(r.tokens_per_s, 2),
        "mean_tokens_per_step": round(r.tokens_per_step, 2), "responses": len(r.responses),
        **{k: v for k, v in r.stats.items() if k != "output_log_probs"},
    }
    if args.json:
        print(json.dumps({"prompt": prompt, "text": r.text, **summary}))
    else:
        print(f"\n\n--- TTFT {summary['ttft_ms']} ms | {summary['tokens']} tokens | "
              f"{summary['tokens_per_s']} tokens/s | {summary['mean_tokens_per_step']} tokens/step | "
              f"{summary['responses']} responses | finish: {r.stats.get('finish_reason')}\n")


if __name__ == "__main__":
    sys.exit(main())
