"""The bundled `arith-tool-tiny` model of the calculator-tool demo: it resolves by name, its chat
template renders the real calculator env's tools and tool messages the way the multi-turn rollout
carries them, and greedy decoding writes calls that the real parser and the real calculator env
accept, with the tool preference its build recorded. HF only (cheap); the build script checks the
same first turns in real vLLM."""

from __future__ import annotations

import random

import pytest

from grpo_train.assets import BUILTIN_MODELS

NAME = "arith-tool-tiny"
NUM_PROBLEMS = 8  # the first held-out problems of the build (build_info.json: heldout_seed)
MAX_NEW_TOKENS = 24
PARAMETER_RANGE = (0.8e6, 1.5e6)
# Whether greedy decoding starts with a call may flip on near-ties on other hardware; the same machine gives 0.
MAX_CHANGED_FIRST_TURNS = 1


@pytest.fixture(scope="module")
def calculator():
    import grpo_envs

    env = grpo_envs.make("calculator", max_turns=3)
    yield env
    env.close()


@pytest.fixture(scope="module")
def problems(build_info):
    rng = random.Random(build_info["heldout_seed"])
    top = 10 ** build_info["digits"] - 1
    return [(rng.randint(0, top), rng.randint(0, top)) for _ in range(build_info["num_heldout"])][:NUM_PROBLEMS]


def prompt(tokenizer, tools, a: int, b: int) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{a}+{b}="}],
            tools=tools,
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
    )


def greedy(model, tokenizer, ids: list[int]) -> list[int]:
    import torch

    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[0, len(ids) :].tolist()


def test_resolves_and_is_small(model_dir, model):
    assert NAME in BUILTIN_MODELS and (model_dir / "README.md").is_file()
    n = sum(p.numel() for p in model.parameters())
    assert PARAMETER_RANGE[0] <= n <= PARAMETER_RANGE[1], n
    assert (model_dir / "model.safetensors").stat().st_size < 8 * 2**20


def test_template_renders_the_calculator_tools_and_tool_messages(tokenizer, calculator):
    from grpo_train.rollout.chat_tokens import ChatTokens

    tools = calculator.tools()
    text = tokenizer.decode(prompt(tokenizer, tools, 1234, 5678))
    assert text == "<tools>calculator</tools><user>1234+5678=<end><asst>"
    chat = ChatTokens.of(tokenizer)
    assert chat.end_of_turn_id == tokenizer.eos_token_id  # an assistant turn ends with <eos>
    tool_msg = [{"role": "tool", "name": "calculator", "content": "6912"}]
    between = chat.between_turns_ids([5, tokenizer.eos_token_id], tool_msg)
    assert tokenizer.decode(between) == "<result>6912<end><asst>"
    # Carried ids (prompt, a turn, the rendered tool message, the answer) equal a fresh render.
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1234+5678"}}</tool_call>'
    turn = tokenizer(call, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    answer = tokenizer("6912", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    carried = prompt(tokenizer, tools, 1234, 5678) + turn + chat.between_turns_ids(turn, tool_msg) + answer
    messages = [
        {"role": "user", "content": "1234+5678="},
        {"role": "assistant", "content": call},
        *tool_msg,
        {"role": "assistant", "content": "6912"},
    ]
    assert carried == chat.fresh_ids(messages, tools)


def test_greedy_calls_parse_and_the_calculator_env_rewards_the_conversation(
    model, tokenizer, calculator, problems, build_info
):
    """With the first token forced to <tool_call>, greedy decoding writes a well-formed call for
    the right sum on (nearly) every problem; the real env runs it, and the model's answer to the
    tool's result earns reward 1. Unforced, the first turns match the build's record."""
    from grpo_envs.tool_calls import ToolCall, parse_tool_calls

    tools = calculator.tools()
    call_open = tokenizer.convert_tokens_to_ids("<tool_call>")
    rewarded = 0
    for a, b in problems:
        ids = prompt(tokenizer, tools, a, b) + [call_open]
        turn = [call_open, *greedy(model, tokenizer, ids)]
        text = tokenizer.decode(turn, skip_special_tokens=True)
        calls = parse_tool_calls(text, "hermes")
        assert calls == [ToolCall("calculator", {"expression": f"{a}+{b}"})], text
        log = [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": text}]
        out = calculator.step([log], [{"ground_truth": str(a + b)}])
        assert out.terminateds == [False] and out.observations[0][0]["content"] == str(a + b)
        obs = tokenizer.apply_chat_template(out.observations[0], tokenize=False)  # `<result>...<end>`
        ids = ids[:-1] + turn + tokenizer(obs + "<asst>", add_special_tokens=False).input_ids
        answer = tokenizer.decode(greedy(model, tokenizer, ids), skip_special_tokens=True)
        log += [*out.observations[0], {"role": "assistant", "content": answer}]
        final = calculator.step([log], [{"ground_truth": str(a + b)}])
        assert final.terminateds == [True]
        rewarded += final.rewards[0] == 1.0
    assert rewarded >= NUM_PROBLEMS - 1, rewarded
    called = [
        tokenizer.decode(greedy(model, tokenizer, prompt(tokenizer, tools, a, b))).startswith("<tool_call>")
        for a, b in problems
    ]
    changed = sum(c != r for c, r in zip(called, build_info["heldout_first_turns"][:NUM_PROBLEMS], strict=True))
    assert changed <= MAX_CHANGED_FIRST_TURNS, (called, build_info["heldout_first_turns"][:NUM_PROBLEMS])
