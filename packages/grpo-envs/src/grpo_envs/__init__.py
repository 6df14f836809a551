"""grpo-envs: reward environments that speak messages and rewards, never tokens.

    import grpo_envs
    env = grpo_envs.make("math")
    out = env.step([[{"role": "user", "content": "1+1?"},
                     {"role": "assistant", "content": "\\boxed{2}"}]],
                   [{"ground_truth": "2"}])
    out.rewards  # [1.0]

``grpo_envs.pool.EnvPool`` runs any registered environment on Ray actors. Importing this
package imports neither Ray, math-verify nor torch.
"""

from grpo_envs.base import Environment, EnvOutput
from grpo_envs.registry import get, make, names, register

__all__ = ["EnvOutput", "Environment", "get", "make", "names", "register"]
__version__ = "0.1.0"
