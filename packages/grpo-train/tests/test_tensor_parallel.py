"""Tensor (and sequence) parallel policy models on two real gloo ranks against one unsharded model.

Each rank builds the same random tiny model twice: once plain (the oracle, on the same rank)
and once parallelized with `apply_tensor_parallel` over a TP=2 mesh. On the padded and the
packed path, with and without SP, the TP model's logprobs, the clipped PG loss and every
parameter's gradient (gathered with `full_tensor()`) must equal the plain model's (fp32,
1e-5 relative), and refit and checkpoints see the plain model's full tensors. The vocab-sharded
logits go through grpo_kernels' dispatch: on CPU it picks the sharded torch op; told the logits
are CUDA tensors it picks the Triton kernels, which then run under the interpreter
(TRITON_INTERPRET=1, root conftest) and must give the same numbers. Qwen2 (tied head) and Llama (untied head) cover the plan's two head layouts.
Rank 0 runs in the test process, rank 1 in a child process that loads this file by path.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

RTOL = 1e-5
# k_proj.bias has an exactly-zero gradient in exact arithmetic (see test_fsdp.py): an absolute
# floor on the difference norm.
ATOL = 1e-7
# (model, sequence_parallel, packed) runs repeated with the Triton kernels (interpreted: slow).
TRITON_RUNS = (("qwen2", False, False), ("llama", True, True))
TORCH_OP, TRITON_OP = "grpo_kernels.vocab_parallel", "grpo_kernels.ops.vocab_parallel"


def tiny_model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    return model.float().eval()


def make_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 5, 12])  # 26 tokens packed: not a multiple of tp (SP pads)
    S = int(lengths.max()) - 1  # 11: odd width, SP pads the padded path too
    lengths[2] = S
    attention_mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(3, 64, (3, S), generator=g) * attention_mask
    token_mask = attention_mask.float()
    token_mask[:, 0] = 0
    return input_ids, attention_mask, token_mask, torch.randn(3, generator=g)


def pg_loss(lp, token_mask, advantages):
    """The clipped PG loss with a KL term, against fixed prev/ref logprobs offset from lp."""
    from grpo_kernels import PGLossConfig, clipped_pg_loss

    prev = (lp.detach() + 0.05 * torch.cos(torch.arange(lp.numel()).view_as(lp).float())) * token_mask
    cfg = PGLossConfig(reference_policy_kl_penalty=0.1, ratio_clip_min=0.2, ratio_clip_max=0.2)
    loss, _ = clipped_pg_loss(
        lp,
        prev,
        prev,
        prev - 0.1 * token_mask,
        advantages[:, None] * token_mask,
        token_mask,
        torch.ones(lp.shape[0]),
        cfg,
        float(token_mask.sum()),
        float(lp.shape[0]),
    )
    return loss


def step(model, packed: bool):
    """logprobs [B, S], loss, {name: full gradient} of one forward/backward."""
    from grpo_train.policy.fsdp import full
    from grpo_train.policy.logprobs import packed_logprobs, sequence_logprobs

    input_ids, attention_mask, token_mask, advantages = make_batch()
    model.zero_grad(set_to_none=True)
    if packed:
        lengths = attention_mask.sum(1)
        stream = input_ids[attention_mask.bool()]
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        positions = torch.cat([torch.arange(int(n)) for n in lengths])
        flat = packed_logprobs(model, stream, positions, cu, int(lengths.max()), temperature=0.7)
        lp = torch.zeros(input_ids.shape).masked_scatter(attention_mask.bool(), flat)
    else:
        lp = sequence_logprobs(model, input_ids, attention_mask, temperature=0.7, fused=False)
    loss = pg_loss(lp, token_mask, advantages)
    loss.backward()
    grads = {name: full(p.grad).detach().clone() for name, p in model.named_parameters()}
    return lp.detach(), loss.detach(), grads


@contextlib.contextmanager
def vocab_parallel_picks(as_if_cuda: bool):
    """-> the modules of the implementations grpo_kernels' dispatch picks for the TP logprob path,
    filled as it runs; with as_if_cuda the selection sees CUDA logits (a stand-in with is_cuda)."""
    from grpo_kernels import dispatch

    real, picked = dispatch.pick_vocab_parallel_token_logprobs, []

    def pick(logits):
        impl = real(SimpleNamespace(is_cuda=True) if as_if_cuda else logits)
        picked.append(impl.__module__)
        return impl

    dispatch.pick_vocab_parallel_token_logprobs = pick
    try:
        yield picked
    finally:
        dispatch.pick_vocab_parallel_token_logprobs = real


def can_interpret_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"


def assert_close(got, want, what):
    diff = float((got - want).norm())
    assert diff <= RTOL * float(want.norm()) + ATOL, (what, diff, float(want.norm()))


def assert_same_full_state(tp_model, plain, what: str) -> None:
    """Refit and checkpoints see full tensors: the refit stream gathered bucket by bucket (the
    weight transport's own bucketing) and the checkpoint state dict equal the plain model's,
    bitwise, under the same names (a tied head sent and saved once, as unsharded)."""
    from grpo_train.policy.fsdp import full_model_state
    from grpo_train.refit.buckets import plan_buckets
    from grpo_train.refit.metas import tensor_metadata
    from grpo_train.refit.tensors import iter_refit_tensors

    want = dict(iter_refit_tensors(plain))
    metas = tensor_metadata(iter_refit_tensors(tp_model, gather=False))
    assert [m.name for m in metas] == list(want), what
    stream = iter_refit_tensors(tp_model)
    buckets = plan_buckets(metas, 8 * 1024)  # several buckets of the tiny model
    assert len(buckets) > 2, what
    for bucket in buckets:
        for index in bucket:
            name, tensor = next(stream)
            assert name == metas[index].name and not hasattr(tensor, "placements"), (what, name)
            assert torch.equal(tensor, want[name]), (what, name)
    saved = full_model_state(tp_model)  # rank 0 holds it, as under FSDP2
    if torch.distributed.get_rank() != 0:
        assert saved == {}, what
        return
    assert saved.keys() == plain.state_dict().keys(), what
    for name, tensor in plain.state_dict().items():
        assert torch.equal(saved[name], tensor), (what, "checkpoint", name)


def run_rank(rank: int, port: int) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from grpo_train.policy.tensor_parallel import apply_tensor_parallel

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for kind, sp in (("qwen2", False), ("qwen2", True), ("llama", True)):
            plain = tiny_model(kind)
            tp_model = apply_tensor_parallel(tiny_model(kind), mesh, sequence_parallel=sp)
            if kind == "qwen2":  # the tied head stays one (sharded) parameter
                assert tp_model.lm_head.weight is tp_model.model.embed_tokens.weight
            assert_same_full_state(tp_model, plain, f"{kind} sp={sp} rank {rank}")
            for packed in (False, True):
                what = f"{kind} sp={sp} packed={packed} rank {rank}"
                want_lp, want_loss, want_grads = step(plain, packed)
                triton = can_interpret_triton() and (kind, sp, packed) in TRITON_RUNS
                for as_if_cuda in (False, True) if triton else (False,):
                    with vocab_parallel_picks(as_if_cuda) as picked:
                        lp, loss, grads = step(tp_model, packed)
                    run = f"{what} {picked}"
                    assert set(picked) == {TRITON_OP if as_if_cuda else TORCH_OP}, run
                    assert_close(lp, want_lp, run + " logprobs")
                    assert_close(loss, want_loss, run + " loss")
                    assert grads.keys() == want_grads.keys(), run
                    for name in want_grads:
                        assert_close(grads[name], want_grads[name], f"{run} grad {name}")
    finally:
        dist.destroy_process_group()


CHILD = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("tensor_parallel_rank", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
torch.set_num_threads(1)
module.run_rank(1, int(sys.argv[2]))
# Every check ran above (a failure raises with its traceback first). Skip the interpreter's teardown: once in
# a clean-clone CI run a native thread aborted the child at exit ("terminate called without an active
# exception", SIGABRT) after all its checks had passed.
import os
os._exit(0)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_tp2_logprobs_loss_and_gradients_match_one_unsharded_model():
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", CHILD, __file__, str(port)], stderr=subprocess.PIPE, text=True)
    try:
        run_rank(0, port)
    finally:
        _, err = child.communicate(timeout=240)
    assert child.returncode == 0, err[-3000:]


def test_tp_size_must_divide_heads_kv_heads_and_vocabulary():
    from grpo_train.policy.tensor_parallel import tp_size_problem

    config = tiny_model("qwen2").config  # 4 heads, 2 KV heads, vocabulary 64
    assert tp_size_problem(config, 2) is None
    assert tp_size_problem(config, 4) == (
        "4 does not divide the model's num_key_value_heads=2 (each tensor-parallel "
        "rank holds whole heads and an equal vocabulary slice)"
    )
    assert "num_attention_heads=4, num_key_value_heads=2" in tp_size_problem(config, 3)


def test_custom_plan_is_loaded_by_module_and_object_and_unknown_models_name_the_key():
    from grpo_train.policy.tensor_parallel import choose_plan, llama_style_plan

    model = tiny_model("llama")
    plan = choose_plan(model, False, custom_plan="grpo_train.policy.tensor_parallel:llama_style_plan")
    assert plan.keys() == llama_style_plan(model, False).keys()
    with pytest.raises(ValueError, match="cannot load it"):
        choose_plan(model, False, custom_plan="grpo_train.policy.tensor_parallel:no_such_plan")
    model.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="set policy.dtensor_cfg.custom_parallel_plan"):
        choose_plan(model, False)
