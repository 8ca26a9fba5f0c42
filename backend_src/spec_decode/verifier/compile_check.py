"""Compile every verifier kernel for a real GPU target without a GPU (``python -m spec_decode.verifier.compile_check``;
the tree kernels of :mod:`.tree_kernels` with ``--tree``).

The interpreter (TRITON_INTERPRET=1) accepts constructs the compiler rejects (``break``, dtype-changing loop variables,
``if`` on a block), so CI also compiles each kernel ahead of time for sm_90 (H100/H200) with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``, each in float32, bfloat16 and float16, and with
K and V as the constexpr 1 that the JIT makes of an argument equal to 1. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import sys

_PTRS = {"tp_ptr": "*fp32", "dp_ptr": "*fp32", "ids_ptr": "*i64", "seeds_ptr": "*i64", "greedy_ptr": "*i8",
         "u_ptr": "*fp32", "e_ptr": "*fp32", "out_ptr": "*i64", "flags_ptr": "*i32", "K": "i32", "V": "i32",
         "posterior_threshold": "fp32", "posterior_alpha": "fp32", "par_ptr": "*i64", "r_ptr": "*fp32",
         "rej_ptr": "*i64", "d_ptr": "*i64", "path_ptr": "*i64"}


def compile_all(arch: int = 90, block_v: int = 4096, tree: bool = False,
                dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")) -> list[str]:
    """Compile each kernel variant for ``cuda:arch`` (compute capability x 10) with tiles of ``block_v``: the chain
    kernels of :mod:`.kernels`, or with ``tree`` those of :mod:`.tree_kernels`; probabilities in each of ``dtypes``.

    Returns:
        one line per variant compiled.

    Raises:
        triton.compiler.errors.CompilationError: a kernel the compiler rejects. AssertionError: no PTX produced.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    from .kernels import rejection_kernel, typical_kernel

    if tree:
        from .tree_kernels import tree_rejection_kernel as rejection_kernel
        from .tree_kernels import tree_typical_kernel as typical_kernel

    target = GPUTarget("cuda", arch, 32)
    done = []
    variants = [(rejection_kernel, {"HAS_DRAFT_PROBS": p, "HAS_NOISE": n, "BLOCK_V": block_v})
                for p in (True, False) for n in (True, False)]
    variants += [(typical_kernel, {"HAS_NOISE": n, "BLOCK_V": block_v}) for n in (True, False)]
    jobs = [(fn, consts, dtype) for fn, consts in variants for dtype in dtypes]
    # Triton's JIT turns an integer argument equal to 1 into a constexpr: k = 1 drafts, or a vocabulary of 1.
    jobs += [(fn, {**consts, **ones}, "fp32") for fn, consts in (variants[0], variants[-1])
             for ones in ({"K": 1}, {"V": 1}, {"K": 1, "V": 1})]
    for fn, consts, ptr_dtype in jobs:
        sig = {a: "constexpr" if a in consts else f"*{ptr_dtype}" if a in ("tp_ptr", "dp_ptr") else _PTRS[a]
               for a in fn.arg_names}
        compiled = triton_compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target)
        assert compiled.asm.get("ptx"), "no PTX produced"
        done.append(f"{fn.__name__} {ptr_dtype} {consts} -> sm_{arch} ok")
    return done


if __name__ == "__main__":
    for line in compile_all(tree="--tree" in sys.argv[1:]):
        print(line)
    sys.exit(0)
