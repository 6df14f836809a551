"""Does PyTorch's context-parallel API (`torch.distributed.tensor.experimental.context_parallel`, ring
attention over SDPA) run on CPU/gloo for the attention our models use? The probe behind
`policy.dtensor_cfg.context_parallel_size` (grpo_train.policy.context_parallel), run by hand:

    uv run --no-sync python benchmarks/tp/check_context_parallel.py

Two gloo processes, a tiny Qwen2 (sdpa attention, causal, no padding mask: the only case the API shards),
one 256-token sequence sharded over the sequence by `context_parallel` (head-tail load balancing), each
rank's logits compared with the unsharded model's at the same positions. Cases: `default` (the SDPA
backend torch picks on CPU), `math` (SDPA forced to its math backend), both torch alone (they fail in
torch 2.13), and `grpo` (the default backend after `register_cpu_ring_attention`: the CPU flash op
routed into torch's ring loop), which also runs backward and compares each parameter's gradient,
summed over the two ranks, with the unsharded model's. Prints, per case and rank, the max |logit
difference| (and the worst relative gradient difference) or the exception; exits 1 unless every case
asked for ran and matched within 1e-5 (`python ... grpo` runs one case).
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

S = 256
TOL = 1e-5


def run(rank: int, world: int, case: str, port: int, failures) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg).eval()
    ids = torch.randint(3, 64, (1, S), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(S)[None]
    reference = model(input_ids=ids, position_ids=positions).logits[0]  # [S, V]
    reference.pow(2).mean().backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    reference = reference.detach()
    if case == "grpo":
        from grpo_train.policy.context_parallel import register_cpu_ring_attention

        register_cpu_ring_attention()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ids_cp, positions_cp = ids.clone(), positions.clone()
    try:
        with context_parallel(
            mesh, buffers=[ids_cp, positions_cp], buffer_seq_dims=[1, 1], no_restore_buffers={ids_cp, positions_cp}
        ):
            with sdpa_kernel([SDPBackend.MATH]) if case == "math" else nullcontext():
                logits = model(input_ids=ids_cp, position_ids=positions_cp, attention_mask=None).logits[0]
        diff = float((logits.detach() - reference[positions_cp[0]]).abs().max())
        (logits.pow(2).sum() / reference.numel()).backward()  # this rank's share of the mean, after the context
        worst = 0.0
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad)
            worst = max(worst, float((p.grad - want[name]).norm() / want[name].norm().clamp_min(1e-30)))
        print(
            f"{case} rank {rank}: ran; max |logit diff| vs CP=1 {diff:.2e}; worst gradient rel. diff {worst:.2e}",
            flush=True,
        )
        if not (diff <= TOL and worst <= TOL):
            failures.put(case)
    except Exception as err:  # the measured outcome: print it
        print(f"{case} rank {rank}: {type(err).__name__}: {str(err).splitlines()[0][:300]}", flush=True)
        failures.put(case)
    dist.destroy_process_group()


def main() -> int:
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    failures = mp.get_context("spawn").SimpleQueue()
    for i, case in enumerate(sys.argv[1:] or ["default", "math", "grpo"]):
        mp.spawn(run, args=(2, case, 29617 + i, failures), nprocs=2)
    return 1 if not failures.empty() else 0


if __name__ == "__main__":
    sys.exit(main())
