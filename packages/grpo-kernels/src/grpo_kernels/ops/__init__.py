"""Triton fast paths, one module per op, each in the five layers of STYLE.md:
`_<op>_fwd_kernel` / `_<op>_bwd_kernel` -> `<op>_fwd` / `<op>_bwd` -> `<Op>Function` -> `<op>()`.

Importing a module here imports triton; nothing imports them except `grpo_kernels.dispatch`
(on CUDA tensors) and the tests (under TRITON_INTERPRET=1).
"""
