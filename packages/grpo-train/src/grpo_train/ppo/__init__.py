"""PPO with a value model and GAE, built from the GRPO loop's components.

`gae` and `value_loss` are pure tensor maths; `estimators` picks the advantage estimator by
name; `value_worker` trains the value model, `value_group` runs N of them data-parallel;
`ppo_loop` is the loop.
"""
