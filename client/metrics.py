"""Read the server's Prometheus metrics (Triton's ``/metrics`` port) into a dict, with ``prometheus_client``'s parser.

Usage:
    python -m client.metrics --url 127.0.0.1:8002          # the spec_decode_* series
    python -m client.metrics --url 127.0.0.1:8002 --all    # every series (Triton's nv_* too)
"""

from __future__ import annotations

import argparse
import time


def scrape(url: str, prefix: str = "spec_decode_", timeout_s: float = 10.0) -> dict[tuple, float]:
    """Every sample whose name starts with ``prefix``.

    Args:
        url: host:port of the metrics endpoint (``--metrics-port``).
        prefix: keep samples whose name starts with this ("" = all).

    Returns:
        (name, ((label, value), ...) sorted) -> value; look one up with :func:`value`.

    Raises:
        OSError: the endpoint did not answer (``urllib.error.URLError`` and timeouts are OSErrors).
    """
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{url}/metrics", timeout=timeout_s) as resp:  # stdlib: the GPU machine has
        text = resp.read().decode()  # no requests
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def value(samples: dict[tuple, float], name: str, **labels: str) -> float:
    """The sample ``name`` with exactly these labels (0.0 when absent, as a counter that never moved).

    A counter named without ``_total`` (Triton's ``nv_inference_count``) is found too: the parser names its sample
    ``<name>_total``.
    """
    key = tuple(sorted(labels.items()))
    return samples.get((name, key), samples.get((name + "_total", key), 0.0))


def wait_for(url: str, predicate, timeout_s: float = 30.0, interval_s: float = 0.1,
             prefix: str = "spec_decode_") -> dict[tuple, float]:
    """Scrape (the samples whose name starts with ``prefix``, as :func:`scrape`) until ``predicate(samples)`` holds;
    returns those samples.

    Raises:
        TimeoutError: it did not hold within ``timeout_s`` (the message has the last samples).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url, prefix)
        if predicate(samples):
            return samples
        if time.monotonic() > deadline:
            raise TimeoutError(f"metrics condition not met within {timeout_s} s: {samples}")
        time.sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    """CLI: print the metrics, one sample per line."""
    ap = argparse.ArgumentParser(description="Print the server's speculative-decoding metrics.")
    ap.add_argument("--url", default="127.0.0.1:8002", help="metrics host:port (default 127.0.0.1:8002)")
    ap.add_argument("--all", action="store_true", help="every series, not only spec_decode_*")
    args = ap.parse_args(argv)
    for (name, labels), v in sorted(scrape(args.url, "" if args.all else "spec_decode_").items()):
        lab = ",".join(f'{k}="{x}"' for k, x in labels)
        print(f"{name}{{{lab}}} {v:g}" if lab else f"{name} {v:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
