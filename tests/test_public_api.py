"""The curated top-level API (`eagle_jax/__init__.py`): every name it lists resolves to the object
its module defines, and `import eagle_jax` leaves the training stack unloaded until asked for."""

import subprocess
import sys

import pytest

import eagle_jax


def test_every_listed_name_resolves_and_dir_shows_it():
    missing = [n for n in eagle_jax.__all__ if not hasattr(eagle_jax, n)]
    assert not missing
    assert len(set(eagle_jax.__all__)) == len(eagle_jax.__all__)
    assert set(eagle_jax.__all__) <= set(dir(eagle_jax))


def test_exports_are_the_modules_own_objects():
    from eagle_jax import draft, speculative
    from eagle_jax.training import data, objectives, trainer

    assert eagle_jax.speculative_generate is speculative.speculative_generate
    assert eagle_jax.TreeBudget is draft.TreeBudget and eagle_jax.load_drafter is draft.load_drafter
    assert eagle_jax.TrainConfig is trainer.TrainConfig and eagle_jax.Trainer is trainer.Trainer
    assert eagle_jax.eagle3_loss is objectives.eagle3_loss
    assert eagle_jax.load_conversations is data.load_conversations


def test_unknown_names_raise_attribute_error_and_submodules_still_import():
    with pytest.raises(AttributeError, match="no_such_name"):
        eagle_jax.no_such_name  # noqa: B018
    from eagle_jax import program_cache  # a submodule, not an attribute of the package's namespace

    assert program_cache.__name__ == "eagle_jax.program_cache"


def test_import_leaves_the_training_stack_unloaded_until_first_use():
    code = ("import sys, eagle_jax; before = 'eagle_jax.training.trainer' in sys.modules or 'optax' in sys.modules; "
            "eagle_jax.Trainer; print(before, 'optax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]


@pytest.mark.slow
def test_the_readme_library_example_runs_as_written(capsys):
    """README.md's "As a library" block, executed as written: the real default target and its
    packaged EAGLE-3 head, greedy speculative tokens equal to plain decoding's (its own assert)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = re.search(r"<!-- library-example -->\n```python\n(.*?)```", readme, re.S)
    assert block, "README.md lost its <!-- library-example --> block"
    exec(compile(block.group(1), "README.md:library-example", "exec"), {})
    printed = capsys.readouterr().out
    assert re.search(r"^tau \d+\.\d\d: 64 tokens in \d+ target passes$", printed, re.M), printed
