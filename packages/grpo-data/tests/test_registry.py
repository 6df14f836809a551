import pytest

from grpo_data.errors import DataError
from grpo_data.registry import register, resolve


def test_register_and_resolve():
    registry = {}

    @register(registry, "double", "widget")
    def double(x):
        return 2 * x

    assert resolve("double", registry, "widget") is double
    assert resolve(len, registry, "widget") is len
    assert resolve("os.path:join", registry, "widget").__name__ == "join"
    with pytest.raises(ValueError, match="widget 'double' is already registered"):
        register(registry, "double", "widget")(lambda x: x)
    with pytest.raises(DataError, match=r"unknown widget 'triple'; built-in widgets are \['double'\]"):
        resolve("triple", registry, "widget")
    with pytest.raises(DataError, match="has no callable 'nope'"):
        resolve("os.path:nope", registry, "widget")
