"""TP x DP on a 2-D gloo mesh (4 CPU processes) against one unsharded model: a check too heavy
for the test suite on the project's 2-core machine, run by hand.

    RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 uv run --no-sync python benchmarks/tp/check_dp_tp_mesh.py [--sp]

Every rank builds the same random tiny Qwen2 (tied head) twice. The plain copy runs the whole
batch; the other is tensor-parallel over the mesh's `tp` dimension (`apply_tensor_parallel`)
and FSDP2-sharded over its `dp` dimension (`policy.fsdp.shard`, gradients summed), and each dp
rank runs its half of the rows with the loss normalised by the global counts. Prints the
largest relative difference of the logprobs, the loss (summed over dp ranks) and every
parameter's gradient (gathered with `full_tensor()`); exits 1 above 1e-5.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RTOL = 1e-5


def tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=128,
            pad_token_id=0,
            tie_word_embeddings=True,
        )
    ).float()


def batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 5, 11, 7])
    attention_mask = (torch.arange(11)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(3, 64, (4, 11), generator=g) * attention_mask
    token_mask = attention_mask.float()
    token_mask[:, 0] = 0
    return input_ids, attention_mask, token_mask, torch.randn(4, generator=g)


def loss_of(lp, token_mask, advantages, global_tokens, global_seqs):
    from grpo_kernels import PGLossConfig, clipped_pg_loss

    prev = (lp.detach() + 0.05) * token_mask
    cfg = PGLossConfig(reference_policy_kl_penalty=0.1)
    loss, _ = clipped_pg_loss(
        lp,
        prev,
        prev,
        prev - 0.1 * token_mask,
        advantages[:, None] * token_mask,
        token_mask,
        torch.ones(lp.shape[0]),
        cfg,
        global_tokens,
        global_seqs,
    )
    return loss


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def rank_main(rank: int, port: int, sp: bool, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from grpo_train.policy import fsdp
    from grpo_train.policy.logprobs import sequence_logprobs
    from grpo_train.policy.tensor_parallel import apply_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    input_ids, attention_mask, token_mask, advantages = batch()
    tokens, seqs = float(token_mask.sum()), float(input_ids.shape[0])

    plain = tiny_model()
    want_lp = sequence_logprobs(plain, input_ids, attention_mask, 0.7, fused=False)
    want_loss = loss_of(want_lp, token_mask, advantages, tokens, seqs)
    want_loss.backward()

    model = apply_tensor_parallel(tiny_model(), mesh["tp"], sequence_parallel=sp)
    root = fsdp.shard(model, mesh["dp"])
    rows = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
    lp = root(lambda m: sequence_logprobs(m, input_ids[rows], attention_mask[rows], 0.7, fused=False))
    loss = loss_of(lp, token_mask[rows], advantages[rows], tokens, seqs)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh["dp"].get_group())
    errors = {"logprobs": rel(lp.detach(), want_lp[rows].detach()), "loss": rel(total, want_loss.detach())}
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        errors[f"grad {name}"] = (
            float((fsdp.full(p.grad) - q.grad).norm() / q.grad.norm().clamp_min(1e-12))
            if float(q.grad.norm()) > 1e-9
            else float((fsdp.full(p.grad) - q.grad).norm())
        )
    if rank == 0:
        queue.put(errors)
    dist.destroy_process_group()


def main() -> int:
    import os

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sp", action="store_true", help="sequence parallelism too")
    args = parser.parse_args()
    queue = mp.get_context("spawn").Queue()
    mp.spawn(rank_main, args=(29600 + os.getpid() % 1000, args.sp, queue), nprocs=4)
    errors = queue.get()
    worst = max(errors, key=lambda k: errors[k])
    print(
        f"dp=2 x tp=2 (sp={args.sp}) vs one unsharded model: {len(errors)} quantities, "
        f"largest relative difference {errors[worst]:.2e} ({worst})"
    )
    for name in ("logprobs", "loss"):
        print(f"  {name}: {errors[name]:.2e}")
    return 0 if errors[worst] <= RTOL else 1


if __name__ == "__main__":
    sys.exit(main())
