"""Prompt sources of the training data: the held-out files, HumanEval's split, near-duplicate
filtering, self-instruct questions and their seed topics, and the standard-library and package
code requests. Fast: no model (the question writer is replaced where it would run)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle_jax.training import prompts as P
from eagle_jax.training import distill_files as DF
from eagle_jax.training import selfdistill as SD

def test_held_out_files_consistent():
    chat = P.load_prompt_file(P.EVAL_CHAT_FILE)
    bench = P.load_prompt_file(P.BENCH_CHAT_FILE)
    assert len(chat) == 40 and len({p["id"] for p in chat}) == 40
    assert {p["prompt"] for p in bench} <= {p["prompt"] for p in chat}
    code = P.load_prompt_file(P.EVAL_CODE_FILE)
    assert len(code) == P.HUMANEVAL_EVAL_SIZE
    split = P.humaneval_split()
    assert len(split) == P.HUMANEVAL_EVAL_SIZE and split == P.humaneval_split()  # fixed
    assert sorted(int(p["id"].split("-")[1]) for p in code) == sorted(split)


def test_calibration_prompts_are_training_prompts():
    """Autotuning picks the packaged tree on these: chat and code, none held out or near a held-out one."""
    cal = P.load_prompt_file(P.CALIBRATION_FILE)
    code = [p for p in cal if p["id"].startswith("humaneval-")]
    assert code and len(code) < len(cal)
    assert not {int(p["id"].split("-")[1]) for p in code} & P.humaneval_split()  # the training split
    assert all(p["prompt"].startswith(P.humaneval_user_prompt("")[:40]) for p in code)
    assert P.drop_near_duplicates(cal, P.eval_prompts()) == cal


def test_humaneval_split_from_package():
    try:
        ev, tr = P.humaneval_prompts("eval"), P.humaneval_prompts("train")
    except Exception as e:  # no network and no cached wheel
        pytest.skip(f"HumanEval wheel unavailable: {e}")
    assert len(ev) == 40 and len(tr) == 124 and not {p["id"] for p in ev} & {p["id"] for p in tr}
    assert [p["prompt"] for p in ev] == [p["prompt"] for p in P.load_prompt_file(P.EVAL_CODE_FILE)]


def test_near_duplicates_and_held_out_filter():
    held = [{"prompt": "Why is the sky blue?"}, {"prompt": "Write a short poem about the ocean at night."}]
    ps = [{"id": str(i), "prompt": t} for i, t in enumerate([
        "why is the sky blue", "Write a short poem about the ocean at night, please.", "How do volcanoes form?",
        "How do volcanoes form ?", "Explain how a bicycle gear works for a child.", "What is a prime number?"])]
    st = {}
    kept = P.drop_near_duplicates(ps, held, stats=st)
    assert [p["id"] for p in kept] == ["2", "4", "5"] and st == {"duplicates": 1, "near_held_out": 2}
    kept = P.drop_near_duplicates(ps[2:], reference=[{"prompt": "What is a prime number?"}])
    assert [p["id"] for p in kept] == ["2", "4"]


def test_near_duplicate_index_decides_like_comparing_every_pair():
    """The trigram index is a speed-up only: same kept list as the all-pairs Jaccard rule."""
    rng = np.random.default_rng(0)
    words = "how do i make good tea".split()
    ps = [{"id": str(i), "prompt": " ".join(rng.choice(words, size=rng.integers(2, 7)))} for i in range(400)]
    ref, held = ps[:30], ps[30:40]

    def brute(prompts, held_out, reference, threshold=0.6):
        def jacc(a, b):
            return len(a & b) / max(1, len(a | b))
        norm = lambda p: " ".join(P._norm_words(p["prompt"]))  # noqa: E731
        hs = [P._shingles(p["prompt"]) for p in held_out]
        ks = [P._shingles(p["prompt"]) for p in reference]
        kn = {norm(p) for p in reference}
        out = []
        for p in prompts:
            sh = P._shingles(p["prompt"])
            if norm(p) in {norm(h) for h in held_out} or any(jacc(sh, h) >= threshold for h in hs):
                continue
            if norm(p) in kn or any(jacc(sh, k) >= threshold for k in ks):
                continue
            out.append(p)
            ks.append(sh)
            kn.add(norm(p))
        return out

    want = brute(ps[40:], held, ref)
    assert 20 < len(want) < 340  # the set exercises both outcomes
    assert P.drop_near_duplicates(ps[40:], held, reference=ref) == want


@pytest.mark.parametrize("raw,want", [
    (" How do I keep basil fresh?\nTopic: x", "How do I keep basil fresh?"),
    ('"What is a leap year?"', "What is a leap year?"),
    ("1. Question: Write a haiku about rain.", "Write a haiku about rain."),
    ("Sure! Here is a question: what?", None),
    ("<|im_start|>assistant hello there friend?", None),
    ("How does the", None),
    ("Why?", None),
])
def test_clean_generated_question(raw, want):
    assert P.clean_generated_question(raw) == want


def test_seed_topics(tmp_path):
    topics = P.read_seed_topics()
    assert 100 <= len(topics) <= 200 and len(set(topics)) == len(topics)
    assert P.read_seed_topics("default") == topics
    more = P.read_seed_topics("more")  # the second packaged list: new topics only
    assert len(more) >= 300 and len(set(more)) == len(more) and not set(more) & set(topics)
    f = tmp_path / "topics.txt"
    f.write_text("# a comment\n\nknots for sailing\n  tide pools \n")
    assert P.read_seed_topics(str(f)) == ["knots for sailing", "tide pools"]
    with pytest.raises(FileNotFoundError, match="no file .*nope.txt.*default, more"):
        P.read_seed_topics(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("# only a comment\n")
    with pytest.raises(ValueError, match="names no topic"):
        P.read_seed_topics(str(tmp_path / "empty.txt"))


def test_self_instruct_draws_from_the_chosen_topic_lists(tmp_path, monkeypatch):
    seen = []

    def fake_writer(engine, topics, n, **kw):  # stands in for the target writing questions
        seen.append(list(topics))
        return [{"id": f"si-{i}", "prompt": f"What is fact number {i} about {topics[i]}?", "source": "self-instruct"}
                for i in range(n)]

    monkeypatch.setattr(P, "self_instruct_prompts", fake_writer)
    more = P.read_seed_topics("more")
    f = tmp_path / "mine.txt"
    f.write_text("tide pools\n" + more[0] + "\n")
    counts = {}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    train, _ = SD.collect_prompts(None, ["self-instruct"], tmp_path / "a", self_instruct_n=3, counts=counts,
                                  seed_topics=["more", str(f)])
    assert seen == [more + ["tide pools"]]  # both lists, in order, a repeated topic once
    assert counts["self-instruct"]["seed_topics"] == {"lists": ["more", str(f)], "topics": len(more) + 1}
    assert [p["prompt"] for p in train] == [f"What is fact number {i} about {more[i]}?" for i in range(3)]
    SD.collect_prompts(None, ["self-instruct"], tmp_path / "b", self_instruct_n=2)
    assert seen[-1] == P.read_seed_topics()  # the default list when none is named


def _fake_stdlib(root):
    doc = "Return the {} of the numbers in seq, ignoring values that are None."
    (root / "stats.py").write_text(
        "import os\n\n"
        f"def mean(seq, skip=True):\n    \"\"\"{doc.format('mean')}\n\n"
        "    More words here.\n    \"\"\"\n    return 0\n\n"
        "def short(x):\n    \"\"\"Too short.\"\"\"\n\n"
        f"def _private(x):\n    \"\"\"{doc.format('private')}\"\"\"\n\n"
        f"def noargs():\n    \"\"\"{doc.format('nothing')}\"\"\"\n\n"
        "class Acc(object):\n"
        f"    def add(self, value):\n        \"\"\"{doc.format('sum')}\n\n"
        "        Second paragraph.\n        \"\"\"\n        pass\n\n"
        f"    def reset(self):\n        \"\"\"{doc.format('reset')}\"\"\"\n\n"
        f"    @property\n    def total(self, x):\n        \"\"\"{doc.format('total')}\"\"\"\n\n"
        f"    @staticmethod\n    def scale(x):\n        \"\"\"{doc.format('scale')}\"\"\"\n")
    for sub in ("test", "idlelib", "pkg"):
        (root / sub).mkdir()
        (root / sub / "__init__.py").write_text(f"def helper(a):\n    \"\"\"{doc.format(sub)}\"\"\"\n")
    (root / "broken.py").write_text("def f(:\n")


def test_stdlib_code_prompts_pick_documented_public_functions(tmp_path):
    import ast

    from eagle_jax.training import code_prompts as C

    _fake_stdlib(tmp_path)
    items = C.stdlib_functions(tmp_path)
    # no private, undocumented, argument-less or property ones; no tests, no GUI tool; broken files skipped
    assert [p["id"] for p in items] == ["stdlib-pkg.helper", "stdlib-stats.mean", "stdlib-stats.Acc.add",
                                        "stdlib-stats.Acc.scale"]
    mean = items[1]["prompt"]
    assert mean.startswith("Complete the following Python function.") and "return 0" not in mean
    code = mean.split("```python\n")[1].rsplit("\n```", 1)[0]
    fn = ast.parse(code).body[0]  # the signature and the docstring, re-indented, nothing else
    assert fn.name == "mean" and len(fn.body) == 1 and ast.get_docstring(fn).endswith("More words here.")
    add = items[2]["prompt"]
    assert "method of the Python class Acc" in add and "class Acc(object):" in add and "pass" not in add
    cls = ast.parse(add.split("```python\n")[1].rsplit("\n```", 1)[0]).body[0]
    assert [type(n).__name__ for n in cls.body] == ["Expr", "FunctionDef"]
    assert ast.get_docstring(cls.body[1]).splitlines()[-1] == "Second paragraph."
    assert "@staticmethod" not in items[3]["prompt"]
    pick = C.stdlib_code_prompts(2, seed=3, root=tmp_path)
    assert pick == C.stdlib_code_prompts(2, seed=3, root=tmp_path) and len(pick) == 2
    assert all(p in items for p in pick) and C.stdlib_code_prompts(None, root=tmp_path) == items
    rest = C.stdlib_code_prompts(5, root=tmp_path, exclude={"stdlib-stats.mean", "stdlib-pkg.helper"})
    assert [p["id"] for p in rest] == ["stdlib-stats.Acc.add", "stdlib-stats.Acc.scale"]


def test_stdlib_code_source_of_this_interpreter(tmp_path):
    from eagle_jax.training import code_prompts as C

    items = C.stdlib_functions()
    assert len(items) > 500 and len({p["id"] for p in items}) == len(items)
    counts = {}
    train, evals = SD.collect_prompts(None, ["stdlib-code"], tmp_path, stdlib_code_n=40, seed=1, counts=counts)
    assert counts["stdlib-code"]["available"] >= 38 and {p["source"] for p in train} == {"stdlib-code"}
    assert {p["id"] for p in train} <= {p["id"] for p in items}
    assert len(evals) == 80 and not {p["prompt"] for p in train} & {p["prompt"] for p in evals}
    # a second set leaves out the ids a stored set has (`--exclude-ids-from`), and still finds 40
    import gzip

    with gzip.open(tmp_path / "stored.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"id": p["id"], "conversations": [{"from": "human", "value": p["prompt"]},
                                                                  {"from": "gpt", "value": "def f(): pass"}]}) + "\n"
                     for p in train)
    gone = DF.stored_ids([str(tmp_path / "*.jsonl.gz")])
    assert gone == {p["id"] for p in train}
    counts = {}
    again, _ = SD.collect_prompts(None, ["stdlib-code"], tmp_path, stdlib_code_n=40, seed=1, counts=counts,
                                  exclude_ids=gone)
    assert not {p["id"] for p in again} & gone and counts["stdlib-code"]["available"] >= 38
    assert counts["stdlib-code"]["excluded"] == len(gone)
    with pytest.raises(FileNotFoundError, match="matches no file"):
        DF.stored_ids([str(tmp_path / "nothing-*.jsonl")])


def test_package_code_prompts_from_installed_packages(tmp_path):
    from eagle_jax.training import code_prompts as C

    pkg = tmp_path / "site" / "fakelib"
    pkg.mkdir(parents=True)
    _fake_stdlib(pkg)  # the same files as a package: ids name the package; tests and private modules left out
    (pkg / "__init__.py").write_text('def top(a, b):\n    """Return a joined with b, separated by one space each."""\n')
    (pkg / "_vendored.py").write_text(
        'def hidden(a):\n    """Return a joined with b, separated by one space each."""\n')
    (tmp_path / "site" / "single.py").write_text("x = 1\n")
    items = C.package_functions(["fakelib"], paths=[str(tmp_path / "site")])
    assert [p["id"] for p in items] == ["pkg-fakelib.top", "pkg-fakelib.idlelib.helper", "pkg-fakelib.pkg.helper",
                                        "pkg-fakelib.stats.mean", "pkg-fakelib.stats.Acc.add",
                                        "pkg-fakelib.stats.Acc.scale"]
    assert {p["source"] for p in items} == {"package-code"}
    as_stdlib = {p["name"]: p["prompt"] for p in C.stdlib_functions(pkg)}
    assert items[3]["prompt"] == as_stdlib["mean"]  # the same request as the stdlib source writes
    for bad in ("single", "no_such_package"):
        with pytest.raises(ValueError, match=f"{bad!r} is not an installed package"):
            C.package_functions([bad], paths=[str(tmp_path / "site")])
    # the real default packages, through collect_prompts: a seeded choice, disjoint from held-out prompts
    counts = {}
    train, evals = SD.collect_prompts(None, ["package-code"], tmp_path, package_code_n=30, seed=2, counts=counts)
    assert len(train) >= 28 and {p["source"] for p in train} == {"package-code"}
    assert counts["package-code"]["packages"] == list(C.DEFAULT_PACKAGES)
    assert {p["id"].split("-", 1)[1].split(".")[0] for p in train} <= set(C.DEFAULT_PACKAGES)
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in evals}
