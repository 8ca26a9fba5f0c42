"""The served path on the GPU: the real tritonserver with the step models as ``KIND_GPU`` instances, against
transformers' greedy decoding and the same engine in process.

    PYTHONPATH=backend_src:.:build/gpu_day/site python3 -m bench.gpu_day.served [--device auto|cuda|cpu]
        [--bundle build/gpu_day/tritonserver.tar.xz] [--output results/gpu_day_served.json]

A random-weight Llama target (on CUDA about 1.1B parameters: 16 layers, hidden 2048, the embedded model's
vocabulary of 49,152 so that its tokenizer, carried in ``build/gpu_day/tokenizer``, serves it) and a random EAGLE-3
head over it are served by a tritonserver unpacked from the bundle (:mod:`.bundle`; without one, the launcher's
server: PATH's or the embedded one). Through Triton's HTTP generate extension (the standard library's
``urllib``: nothing to install), greedy, k = 4, ``ignore_eos``:

- every setting of :data:`METHODS` (the EAGLE-3 head's trees and its chains among them) at 1 and 8 concurrent
  streams must give transformers' greedy decoding of the same prompt ids token for token (float32; IEEE float32
  GEMMs, ``torch.set_float32_matmul_precision("highest")``);
- tokens/s of ``none`` at concurrency 1 through the server against the same served backends in process
  (:class:`spec_decode.serving.local_ensemble.LocalEnsemble`, the same settings): the goal is >= 0.90x;
- :mod:`bench.round_stages`' breakdown of a round (none and suffix at concurrency 1 and 8) from the server's own
  counters: the round's milliseconds beyond the target's and the proposer's work (goal <= 1.0 ms at c = 1 for none).

Without CUDA it runs the same code at tiny sizes on a CPU tritonserver (``tests/unit/bench/test_gpu_day.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time
import traceback
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = ROOT / "build" / "gpu_day" / "tokenizer"
METHODS = ("none", "ngram", "suffix", "eagle3", "eagle3:chain")
"""The settings served: a method (its trees where it drafts them: ``draft_tree`` is on by default), or a method and
``:chain`` (``draft_tree`` false: the EAGLE-3 head's trees against its chains)."""
K = 4
STDLIB_PROMPTS = ("json/decoder.py", "textwrap.py", "string.py", "shlex.py", "fnmatch.py", "heapq.py", "bisect.py",
                  "colorsys.py")
"""Prompts: the opening of these standard-library files (real code, on every machine with Python)."""


@dataclass(frozen=True)
class Sizes:
    """One run's sizes: the random target's ``LlamaConfig`` keywords, prompt characters and new tokens per request."""

    llama: dict
    prompt_chars: int
    max_tokens: int


CUDA_SIZES = Sizes(dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=49152, max_position_embeddings=2048), 800, 64)
CPU_SIZES = Sizes(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024), 200, 8)


def save_tokenizer(dest: Path = TOKENIZER_DIR) -> Path:
    """Save the embedded default model's tokenizer (SmolLM2's, vocabulary 49,152) under ``dest`` so that it travels
    to a machine without the embedded model's package (the bundle's folder is carried); returns ``dest``.

    Raises:
        FileNotFoundError: the embedded model's package is not installed (``make setup``).
    """
    from spec_decode.engine.model_loading import load_tokenizer, prepare_default_model

    load_tokenizer(prepare_default_model()).save_pretrained(dest)
    return dest


def build_models(folder: Path, sizes: Sizes, device: str) -> dict[str, Path]:
    """A random Llama target (``sizes.llama``, seed 0, saved in bfloat16 with the tokenizer of
    :data:`TOKENIZER_DIR`, or of the folder ``SPEC_DECODE_GPU_DAY_TOKENIZER`` names) and a random EAGLE-3 head over it
    (:func:`bench.gpu_check.speculators.write_eagle3`).

    Returns:
        {"target": folder, "eagle3": folder}.

    Raises:
        FileNotFoundError: no tokenizer at :data:`TOKENIZER_DIR`, and none to save there (:func:`save_tokenizer`).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.gpu_check.speculators import write_eagle3

    tokenizer = Path(os.environ.get("SPEC_DECODE_GPU_DAY_TOKENIZER", TOKENIZER_DIR))
    if not (tokenizer / "tokenizer.json").is_file():
        try:
            save_tokenizer(tokenizer)  # where the embedded model's package is installed (not on the GPU machine)
        except Exception as exc:
            raise FileNotFoundError(f"{tokenizer}: no tokenizer (python -m bench.gpu_day.bundle saves it)") from exc
    torch.manual_seed(0)
    cfg = LlamaConfig(**sizes.llama, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    with torch.device(device):
        target = LlamaForCausalLM(cfg)
    paths = {"target": folder / "target", "eagle3": folder / "eagle3"}
    target.to(torch.bfloat16).save_pretrained(paths["target"])  # type: ignore[arg-type]
    for f in tokenizer.iterdir():
        shutil.copy2(f, paths["target"])
    lm_head = target.get_output_embeddings().weight
    write_eagle3(paths["eagle3"], sizes.llama, lm_head)
    del target, lm_head
    return paths


def prompts(chars: int) -> list[str]:
    """The opening ``chars`` characters of each file of :data:`STDLIB_PROMPTS` in this Python's standard library."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [(lib / name).read_text()[:chars] for name in STDLIB_PROMPTS]


def reference(target: Path, prompt_ids: list[list[int]], max_tokens: int, device: str) -> list[list[int]]:
    """transformers' greedy decoding of each prompt (float32 on ``device``), ``max_tokens`` new ids each
    (:func:`bench.gpu_check.decoding.reference`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.gpu_check.decoding import reference as greedy

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device).eval()  # type: ignore[arg-type]
    return greedy(model, prompt_ids, max_tokens)


def step_params(paths: dict[str, Path], device: str) -> tuple[dict[str, str], dict[str, str]]:
    """(target_model's, draft_model's) config parameters for this check: float32, 8 sequences, a 16,384-token pool,
    ``cuda_graphs: on`` on CUDA (a failed capture fails the load; on a CPU ``emulate``: the captured branch's code
    runs eagerly), the EAGLE-3 head drafting every slot, no draft LM."""
    common = {"device": device, "dtype": "float32", "max_sequences": "8", "kv_cache_max_tokens": "16384",
              "cuda_graphs": "on" if device == "cuda" else "emulate"}
    target = {**common, "model_path": str(paths["target"])}
    draft = {**common, "draft_model_path": "none", "speculator_path": str(paths["eagle3"]),
             "target_model_path": str(paths["target"]), "speculator_min_token_prob": "0",
             "tokenizer_path": str(paths["target"])}
    return target, draft


def in_process(paths: dict[str, Path], prompt_ids: list[list[int]], max_tokens: int, device: str) -> dict:
    """``none`` at batch 1 through the served backends in process (the same settings as the server's): tokens/s and
    the outputs. Frees its models before returning."""
    import gc

    import torch

    from bench.gpu_check.context import Context
    from bench.gpu_check.decoding import decode
    from spec_decode.serving.draft_model import DraftBackend
    from spec_decode.serving.local_ensemble import LocalEnsemble
    from spec_decode.serving.target_model import TargetBackend
    from spec_decode.serving.verifier_model import VerifierBackend

    ctx = Context.for_device(device)
    target_params, draft_params = step_params(paths, device)
    ens = LocalEnsemble(DraftBackend(draft_params, None, target_params),
                        TargetBackend(target_params, None, draft_params),
                        VerifierBackend({"num_threads": "0", "backend": "auto"}))
    decode(ctx, ens, "none", prompt_ids[:1], 1, 8)  # warm-up
    r = decode(ctx, ens, "none", prompt_ids, 1, max_tokens)
    del ens
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    tokens = max_tokens * len(prompt_ids)
    return {"tokens_per_s": tokens / r["seconds"], "outputs": r["outputs"]}


def repository(paths: dict[str, Path], device: str, gpu_instances: bool = True) -> Path:
    """The served model repository for this check (:func:`step_params`; ``generate`` tokenizes with the target's
    folder), the step models as ``KIND_GPU`` instances on GPU 0 on CUDA when ``gpu_instances``. A temporary folder
    (the caller removes it)."""
    from spec_decode.launcher import prepare_repository

    target, draft = step_params(paths, device)
    repo = prepare_repository({"target_model": target, "draft_model": draft,
                               "generate": {"tokenizer_path": str(paths["target"])}})
    if device == "cuda" and gpu_instances:
        for model in ("target_model", "draft_model", "verifier"):
            cfg = repo / model / "config.pbtxt"
            text, n = re.subn(r"instance_group \[[^\]]*\]",
                              "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]", cfg.read_text())
            if n != 1:
                raise ValueError(f"{cfg}: no instance_group to place on GPU 0")
            cfg.write_text(text)
    return repo


def generate(http_url: str, text: str, method: str, max_tokens: int, timeout_s: float = 300.0) -> dict:
    """One greedy request through Triton's HTTP generate extension (``method``: a setting of :data:`METHODS`); its
    JSON answer (``output_ids``: the new token
    ids; ``num_draft_tokens_total``, ``num_accepted_tokens``).

    Raises:
        urllib.error.HTTPError: the server refused it (the body names why).
    """
    method, _, shape = method.partition(":")
    body = {"text_input": text, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "speculative_method": method, "num_draft_tokens": 0 if method == "none" else K,
            "draft_tree": shape != "chain"}
    req = urllib.request.Request(f"http://{http_url}/v2/models/generate/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def load(http_url: str, texts: list[str], method: str, max_tokens: int, concurrency: int) -> dict:
    """``texts`` through the server, ``concurrency`` requests at a time: outputs (new token ids, in order), drafted
    and accepted (draft tokens, summed), seconds, tokens_per_s."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda t: generate(http_url, t, method, max_tokens), texts))
    seconds = time.perf_counter() - t0
    outputs = [list(a["output_ids"]) for a in answers]
    total = lambda key: sum(int(a.get(key, [0])[0] if isinstance(a.get(key), list) else a.get(key, 0))  # noqa: E731
                            for a in answers)
    return {"outputs": outputs, "drafted": total("num_draft_tokens_total"), "accepted": total("num_accepted_tokens"),
            "seconds": seconds, "tokens_per_s": sum(len(o) for o in outputs) / seconds}


def stub_missing_libraries() -> list[str]:
    """The libraries that the Python backend stub of the server to run (:func:`spec_decode.launcher.embedded.
    server_command`) links and the dynamic loader cannot find with that server's environment (``ldd``'s "not found"
    lines; empty when it can start, or when there is no stub to look at)."""
    import subprocess

    from spec_decode.launcher.embedded import server_command

    cmd, env = server_command()
    backends = next((Path(a.split("=", 1)[1]) for a in cmd if a.startswith("--backend-directory=")), None)
    stub = backends / "python" / "triton_python_backend_stub" if backends else None
    if stub is None or not stub.is_file():
        return []
    out = subprocess.run(["ldd", str(stub)], env=env, capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if "not found" in line]


def serve_and_measure(repo: Path, log: Path, texts: list[str], ref: list[list[int]], sizes: Sizes, res: dict,
                      fail) -> bool:
    """Serve ``repo``; run every method of :data:`METHODS` at concurrency 1 (the first 4 prompts) and 8 (all),
    compare with ``ref``, and record runs (and :mod:`bench.round_stages`' breakdown for none and suffix) in ``res``;
    False when the server did not get ready (recorded as a failure)."""
    from spec_decode.launcher import TritonServer

    from ..round_stages import breakdown, counters

    t = time.perf_counter()
    with TritonServer(repo, log_path=log, heal=False) as srv:
        try:
            srv.wait_ready(timeout=240)
        except RuntimeError as exc:
            fail(f"server ({res['instances']}) did not get ready: {str(exc)[-1500:]}")
            return False
        res["server_ready_s"] = time.perf_counter() - t
        generate(srv.http_url, texts[0], "none", 4)  # warm-up
        for method in METHODS:
            for concurrency in (1, 8):
                use = texts[:4] if concurrency == 1 else texts
                before = counters(srv.metrics_url) if method in ("none", "suffix") else None
                r = load(srv.http_url, use, method, sizes.max_tokens, concurrency)
                equal = r["outputs"] == ref[: len(use)]
                row = {"method": method, "concurrency": concurrency, "tokens_per_s": r["tokens_per_s"],
                       "drafted": r["drafted"], "accepted": r["accepted"], "equal_to_transformers": equal,
                       "mismatched": [i for i, (a, b) in enumerate(zip(ref, r["outputs"])) if a != b]}
                if before is not None:
                    time.sleep(1.5)  # the models export their counters at most every 0.5 s
                    row["ms_per_round"] = breakdown(before, counters(srv.metrics_url), r["seconds"])
                res["runs"].append(row)
                if method.startswith("eagle3") and not r["drafted"]:  # a head drafts every slot (min prob 0)
                    fail(f"served {method} c={concurrency}: drafted nothing (the check would prove nothing)")
                if not equal:
                    fail(f"served {method} c={concurrency}: {len(row['mismatched'])} of {len(use)} outputs "
                         f"differ from transformers' greedy decoding")
                print(f"  served {method:<12} c={concurrency}: {r['tokens_per_s']:8.1f} tok/s  equal {equal}",
                      flush=True)
    return True


def served(device: str, bundle: Path | None, out: Path) -> dict:
    """The part (module docstring). Returns its JSON; ``failures`` lists what failed (empty: passed)."""
    import torch

    from spec_decode.engine.model_loading import load_tokenizer

    from .bundle import unpack

    torch.set_float32_matmul_precision("highest")
    sizes = CUDA_SIZES if device == "cuda" else CPU_SIZES
    res: dict = {"device": device, "config": sizes.llama, "k": K, "max_tokens": sizes.max_tokens, "failures": [],
                 "runs": []}
    work = Path(tempfile.mkdtemp(prefix="gpu_day_served_"))
    work_repos: list[Path] = []
    fail = res["failures"].append
    try:
        t = time.perf_counter()
        paths = build_models(work / "models", sizes, device)
        texts = prompts(sizes.prompt_chars)
        tok = load_tokenizer(paths["target"])
        prompt_ids = [list(tok(x)["input_ids"]) for x in texts]
        res["prompt_tokens"] = [len(p) for p in prompt_ids]
        ref = reference(paths["target"], prompt_ids, sizes.max_tokens, device)
        res["build_and_reference_s"] = time.perf_counter() - t
        local = in_process(paths, prompt_ids[:4], sizes.max_tokens, device)
        res["in_process_none_c1_tokens_per_s"] = local["tokens_per_s"]
        if local["outputs"] != ref[:4]:
            fail("in process: none differs from transformers' greedy decoding")
        if bundle is not None:
            t = time.perf_counter()
            os.environ["SPEC_DECODE_TRITONSERVER_DIR"] = str(unpack(bundle, work / "server"))
            res["unpack_s"] = time.perf_counter() - t
        res["stub_missing_libraries"] = stub_missing_libraries()
        if res["stub_missing_libraries"]:
            fail(f"the Python backend stub cannot start: {res['stub_missing_libraries']}")
            return res
        # KIND_GPU instances first; if that server does not get ready, the same models as KIND_CPU instances with
        # device cuda (still on the GPU), so the part still measures the served path (and fails, naming why)
        for gpu_instances in ((True, False) if device == "cuda" else (False,)):
            repo = repository(paths, device, gpu_instances)
            work_repos.append(repo)
            kind = "cpu" if device != "cuda" else "kind_gpu" if gpu_instances else "kind_cpu"
            log = out.with_name(f"{out.stem}.{kind}.server.log")
            res["instances"] = "KIND_GPU on GPU 0" if gpu_instances else f"KIND_CPU, device {device}"
            if serve_and_measure(repo, log, texts, ref, sizes, res, fail):
                break
        if not res["runs"]:
            return res
        one = next(r for r in res["runs"] if r["method"] == "none" and r["concurrency"] == 1)
        res["server_over_in_process"] = one["tokens_per_s"] / local["tokens_per_s"]
        res["round_beyond_forward_ms"] = one.get("ms_per_round", {}).get(
            "non-forward time (wall less target and proposer work)")
        res["goals"] = {"server_over_in_process >= 0.90": res["server_over_in_process"] >= 0.90,
                        "round_beyond_forward_ms <= 1.0 at c=1": (res["round_beyond_forward_ms"] or 1e9) <= 1.0}
        return res
    except Exception as exc:  # noqa: BLE001 - reported in the JSON, the part fails
        fail(f"crashed: {type(exc).__name__}: {exc}")
        res["traceback"] = traceback.format_exc()
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for repo in work_repos:
            shutil.rmtree(repo, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Run the part, write its JSON; 0 when nothing failed."""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_day.served", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--bundle", type=Path, default=None,
                    help="a tritonserver bundle (bench.gpu_day.bundle) to serve with")
    ap.add_argument("--output", type=Path, default=ROOT / "results" / "gpu_day_served.json")
    args = ap.parse_args(argv)
    from bench.gpu_check.__main__ import select_device

    device = select_device(args.device)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    res = served(device, args.bundle, args.output)
    args.output.write_text(json.dumps(res, indent=2, default=str))
    for f in res["failures"]:
        print(f"FAIL: {f}", flush=True)
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
