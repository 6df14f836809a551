"""Bad configs are refused by `grpo config validate` in one line, exit 2, no traceback, fast.

Runs the CLI's `main` in this process (stderr captured) so the many cases share one import of
the stack; `test_cli.py` covers the same contract through real subprocesses. Each case names the
key path or file the refusal must point at.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from grpo_cli.configs import CONFIG_DIR
from grpo_cli.main import EXIT_CONFIG_ERROR, main
from grpo_train.config.loader import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_CONFIG_VALUES

TINY = str(CONFIG_DIR / "grpo_arith_tiny.yaml")


def refused(capsys, *args: str) -> str:
    """The one stderr line of a refused `grpo ...`; asserts exit 2 and nothing else printed."""
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG_ERROR, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo: config error:"), err
    assert "Traceback" not in err
    return lines[0]


def child(tmp_path: Path, text: str, name: str = "c.yaml") -> str:
    """A config file inheriting the tiny demo config, plus `text`."""
    path = tmp_path / name
    path.write_text(f"defaults: {TINY}\n{text}")
    return str(path)


# ------------------------------------------------------------------------- hostile YAML
def _laughs(levels: int, width: int = 9) -> str:
    lines = ['a0: &a0 ["lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


HOSTILE = [
    # a_i expands to 1 + 9 * a_(i-1) values (a0: 2): 2, 19, 172, 1549, 13942, 125479 -> a5, line 6, crosses 100,000
    (
        "billion laughs",
        lambda p: p.write_text(_laughs(9)),
        f"invalid YAML at line 6: expands to more than {MAX_CONFIG_VALUES} values",
    ),
    # x is 21 values (10 keys, 10 values, itself); a k-line adds its key, its mapping, 21 keys and 21 uses of x:
    # 1 + 1 + 21 + 21 * 21 = 464. After line 1 (22 values) the count passes 100,000 on k-line 216 (file line 217).
    (
        "aliases in many places",
        lambda p: p.write_text(
            "x: &x {"
            + ", ".join(f"a{j}: {j}" for j in range(10))
            + "}\n"
            + "".join(f"k{i}: {{{', '.join(['<<: *x'] + [f'v{j}: *x' for j in range(20)])}}}\n" for i in range(500))
        ),
        "invalid YAML at line 217: expands to more than 100000 values (",
    ),
    (
        "deep flow sequence",
        lambda p: p.write_text("grpo: " + "[" * 20_000 + "]" * 20_000 + "\n"),
        f"invalid YAML at line 1: nested deeper than {MAX_CONFIG_DEPTH} levels",
    ),
    (
        "deep block mapping",
        lambda p: p.write_text("".join("  " * i + f"k{i}:\n" for i in range(100)) + "  " * 100 + "v: 1\n"),
        f"invalid YAML at line {MAX_CONFIG_DEPTH}: nested deeper than {MAX_CONFIG_DEPTH} levels",
    ),
    (
        "latin-1 text",
        lambda p: p.write_bytes("grpo:\n  seed: 1  # caf\xe9\n".encode("latin-1")),
        "not UTF-8 text (byte 0xe9 at line 2)",
    ),
    (
        "binary file",
        lambda p: p.write_bytes(bytes(range(256)) * 4),
        "not UTF-8 text (byte 0x80 at line 2)",
    ),  # 0x0a ends line 1
    (
        "100 MB file",
        lambda p: _sparse(p, 100 * 2**20),
        f"104857600 bytes; a config file is at most {MAX_CONFIG_BYTES} bytes",
    ),
    (
        "references that multiply",
        lambda p: p.write_text(
            "r0: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n"
            + "".join(f"r{i}: [" + ", ".join([f'"${{r{i - 1}}}"'] * 10) + "]\n" for i in range(1, 9))
        ),
        f"expands to more than {MAX_CONFIG_VALUES} values through ${{...}} references",
    ),
    (
        "reference to itself",
        lambda p: p.write_text('loop: ["${loop}"]\n'),
        "nested deeper than 32 levels (a ${...} reference to itself?)",
    ),
]


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:  # a sparse file: its size is what matters, not its bytes
        f.write(b"grpo:\n  seed: 1\n")
        f.truncate(size)


@pytest.mark.parametrize("make, words", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_yaml_is_refused_in_one_line_fast(make, words, capsys, tmp_path):
    path = tmp_path / "hostile.yaml"
    make(path)
    start = time.perf_counter()
    line = refused(capsys, "config", "validate", str(path))
    assert time.perf_counter() - start < 10  # measured 0.01-0.3 s; minutes or an OOM before the bounds
    assert str(path) in line and words in line, line


def test_a_hostile_parent_is_named(capsys, tmp_path):
    (tmp_path / "parent.yaml").write_text(_laughs(9))
    path = tmp_path / "kid.yaml"
    path.write_text("defaults: parent.yaml\n")
    line = refused(capsys, "config", "validate", str(path))
    assert str(tmp_path / "parent.yaml") in line and "expands to more than" in line


def test_hostile_override_value(capsys):
    line = refused(capsys, "config", "validate", TINY, "grpo.seed=" + "[" * 5000 + "]" * 5000)
    assert "grpo.seed" in line and "not valid YAML" in line


# ---------------------------------------------------------------- optimizer and scheduler
@pytest.mark.parametrize(
    "override, key, words",
    [
        ("policy.optimizer.kwargs.lr=abc", "policy.optimizer.kwargs.lr", "'abc' is refused: TypeError"),
        ("policy.optimizer.kwargs.lr=-1.0", "policy.optimizer.kwargs.lr", "Invalid learning rate: -1.0"),
        ("policy.optimizer.kwargs.betas=oops", "policy.optimizer.kwargs.betas", "'oops' is refused"),
        (
            "policy.optimizer.kwargs.betas=[0.9, 2.0]",
            "policy.optimizer.kwargs.betas",
            "Invalid beta parameter at index 1",
        ),
        (
            "+policy.optimizer.kwargs.momentun=0.9",
            "policy.optimizer.kwargs.momentun",
            "unexpected keyword argument 'momentun'",
        ),
        ("policy.optimizer.name=torch.optim.AdamX", "policy.optimizer.name", "cannot be imported"),
        ("policy.optimizer.name=AdamW", "policy.optimizer.name", "must be a dotted import path"),
        (
            "policy.optimizer.name=os.system",
            "policy.optimizer.name",
            "'os.system' is not a subclass of torch.optim.optimizer.Optimizer",
        ),
        (
            "policy.optimizer.name=torch.nn.Linear",
            "policy.optimizer.name",
            "is not a subclass of torch.optim.optimizer.Optimizer",
        ),
    ],
)
def test_optimizer_kwargs_and_class_are_checked(override, key, words, capsys):
    line = refused(capsys, "config", "validate", TINY, override)
    assert f": {key}: " in line and words in line, line


SCHEDULER = """policy:
  scheduler:
    - name: {name}
      kwargs: {kwargs}
"""


@pytest.mark.parametrize(
    "name, kwargs, key, words",
    [
        (
            "torch.optim.lr_scheduler.LinearLR",
            "{start_factor: abc}",
            "policy.scheduler[0].kwargs.start_factor",
            "'abc' is refused",
        ),
        (
            "torch.optim.lr_scheduler.StepLR",
            "{step_size: 10, gamma: 0.5, bogus: 1}",
            "policy.scheduler[0].kwargs.bogus",
            "unexpected keyword argument 'bogus'",
        ),
        (
            "torch.optim.lr_scheduler.StepLR",
            "{}",
            "policy.scheduler[0].kwargs",
            "missing 1 required positional argument: 'step_size'",
        ),
        ("torch.optim.lr_scheduler.NoSuchLR", "{}", "policy.scheduler[0].name", "cannot be imported"),
        (
            "subprocess.Popen",
            "{}",
            "policy.scheduler[0].name",
            "is not a subclass of torch.optim.lr_scheduler.LRScheduler",
        ),
    ],
)
def test_scheduler_entries_are_checked(name, kwargs, key, words, capsys, tmp_path):
    path = child(tmp_path, SCHEDULER.format(name=name, kwargs=kwargs))
    line = refused(capsys, "config", "validate", path)
    assert f": {key}: " in line and words in line, line


def test_scheduler_milestones_must_match(capsys, tmp_path):
    path = child(
        tmp_path,
        """policy:
  scheduler:
    - {name: torch.optim.lr_scheduler.LinearLR, kwargs: {start_factor: 0.1, total_iters: 5}}
    - {name: torch.optim.lr_scheduler.ConstantLR, kwargs: {factor: 1.0}}
    - milestones: [5, 9]
""",
    )
    line = refused(capsys, "config", "validate", path)
    assert ": policy.scheduler: " in line and "2 schedulers need 1 milestones, got [5, 9]" in line


def test_value_optimizer_is_checked_for_ppo(capsys):
    line = refused(capsys, "config", "validate", "ppo_arith_tiny.yaml", "value.optimizer.kwargs.lr=fast")
    assert ": value.optimizer.kwargs.lr: 'fast' is refused" in line


# ------------------------------------------------------------------ environments and data
@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (
            ["+env.nosuch.num_workers=1"],
            "env.nosuch",
            "unknown environment; registered: arithmetic, calculator, code, code_interpreter, math",
        ),
        (
            ["+env.arithmetic.difficulty=3"],
            "env.arithmetic.difficulty",
            "unknown key (environment 'arithmetic' takes: no settings)",
        ),
        (["+env.math.timeout_s=soon"], "env.math.timeout_s", "Input should be a valid number"),
        (["+env.math.timeout_s='5'"], "env.math.timeout_s", "Input should be a valid number"),
        (["+env.math.timout_s=5"], "env.math.timout_s", "unknown key (environment 'math' takes: max_answer_chars, "),
        (["+env.code.max_parallel=[2]"], "env.code.max_parallel", "Input should be a valid integer"),
        (
            ["data.train.env_name=math"],
            "data.train.env_name",
            "'math' is not configured in the env section (configured: arithmetic)",
        ),
        (["data.validation.env_name=code"], "data.validation.env_name", "'code' is not configured"),
        (["+data.default.env_name=mathh"], "data.default.env_name", "'mathh' is not configured"),
    ],
)
def test_env_settings_and_references_are_checked(overrides, key, words, capsys):
    line = refused(capsys, "config", "validate", TINY, *overrides)
    assert f": {key}: " in line and words in line, line


def test_valid_env_settings_pass(capsys):
    assert (
        main(["config", "validate", TINY, "+env.math.timeout_s=2", "+env.code.max_parallel=2", "+env.code.limits={}"])
        == 0
    )
    assert capsys.readouterr().out.strip().endswith(": OK")


# The demo: max_total_sequence_length 32, max_model_len 32, max_new_tokens 8, max_input_seq_length 16.
@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (
            ["policy.generation.max_new_tokens=31"],
            "policy.generation.max_new_tokens",
            "31 leaves no room for a prompt in policy.generation.vllm_cfg.max_model_len (32",
        ),
        (
            ["policy.generation.max_new_tokens=16"],
            "data.max_input_seq_length",
            "16 + policy.generation.max_new_tokens (16) + 1 exceeds policy.generation.vllm_cfg.max_model_len (32): "
            "accepted prompts would be cut again at generation; use at most 15",
        ),
        (["+data.train.max_input_seq_length=24"], "data.train.max_input_seq_length", "use at most 23"),
        (
            ["policy.generation.vllm_cfg.max_model_len=64"],
            "policy.generation.vllm_cfg.max_model_len",
            "64 exceeds policy.max_total_sequence_length (32)",
        ),
        (
            ["policy.generation.backend=hf", "policy.max_total_sequence_length=24"],
            "data.max_input_seq_length",
            "exceeds policy.max_total_sequence_length (24)",
        ),
    ],
)
def test_lengths_must_fit_together(overrides, key, words, capsys):
    line = refused(capsys, "config", "validate", TINY, *overrides)
    assert f": {key}: " in line and words in line, line


def test_bad_rows_policy_is_a_checked_key(capsys):
    line = refused(capsys, "config", "validate", TINY, "+data.bad_rows=ignore")
    assert "data.bad_rows" in line and "'refuse' or 'skip'" in line
    assert main(["config", "validate", TINY, "+data.bad_rows=skip"]) == 0


def test_train_refuses_a_bad_optimizer_before_any_actor_starts(capsys, monkeypatch, tmp_path):
    """`grpo train` checks the optimizer beside Ray's start (config.checks.check_optimizers_in_background),
    not in `_load`: the same one line naming the file and key, exit 2, and build_components (the
    actors) is never reached."""
    from grpo_train import setup

    started = []
    monkeypatch.setattr(setup, "init_ray", lambda *a, **k: started.append("ray"))
    monkeypatch.setattr(setup, "build_components", lambda *a, **k: started.append("actors"))
    line = refused(capsys, "train", "-c", TINY, "policy.optimizer.kwargs.lr=-1.0", "--run-dir", str(tmp_path / "run"))
    assert f"{TINY}: policy.optimizer.kwargs.lr: " in line and "Invalid learning rate: -1.0" in line, line
    assert started == ["ray"]
