"""Self-distillation: the target regenerates the assistant replies of the training prompts.

EAGLE-3 trains its drafter on the target's own outputs, so the head learns the distribution it
will be asked to predict. This tool collects prompts (HumanEval train split, OpenAI-evals
questions, self-instruct questions the target writes from seed topics, HumanEval-style requests
for standard-library and installed packages' functions: training/code_prompts.py), generates replies with the
target by continuous batching (a finished row takes the next prompt while the others keep decoding:
`decode_refill`; one cache length for the run, fitted to 90% of the prompts; longer prompts, and
everything with `--no-continuous`, go in whole batches of `generate_tokens`, one cache-length bucket
per compile), and appends ShareGPT-layout lines to `<out>/generated.jsonl` as replies finish:

    {"id", "conversations": [{"from": "human", "value"}, {"from": "gpt", "value"}], "source",
     "split": "train"|"eval", "finish": "stop"|"length", "prompt_tokens", "new_tokens"}

A killed run continues where it stopped (ids already in generated.jsonl are skipped; a torn last
line is cut off). At the end `<out>/train.jsonl` and `<out>/eval.jsonl` are written (eval = the
held-out prompts of `eagle_jax/data/eval_*_prompts.jsonl` only) with `<out>/summary.json` (written
first with the prompt counts and `"complete": false`, so a run stopped by a time box keeps its
record; `--splits-only` adds the split files' counts to it).

    python -m eagle_jax.training.selfdistill --out /work/data/sd --max-new-tokens 256 --batch-size 8 \
        --sources humaneval,evals,self-instruct --self-instruct-n 300
    python -m eagle_jax.training.selfdistill --measure 4,8,16 --max-new-tokens 128   # tokens/s only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from . import code_prompts as C
from . import prompts as P
from .distill_files import _log, _repair_tail, append_jsonl, read_jsonl, stored_ids, update_summary, write_splits

SOURCES = ("humaneval", "evals", "self-instruct", "stdlib-code", "package-code")
DEFAULT_SOURCES = ("humaneval", "evals", "self-instruct")  # the code sources are asked for by name


# ---------------------------------------------------------------------------------- prompts
def collect_prompts(engine, sources: Sequence[str], out_dir: Path, *, self_instruct_n: int = 300,
                    evals_per_subset: int = 12, evals_skip: int = 0, limit: Optional[int] = None, seed: int = 0,
                    counts: Optional[dict] = None, stdlib_code_n: int = 600,
                    package_code_n: int = 600, code_packages: Sequence[str] = C.DEFAULT_PACKAGES,
                    exclude_ids: Sequence[str] = (), seed_topics: Sequence[str] = ("default",),
                    self_instruct_batch_size: int = 16) -> tuple[list[dict], list[dict]]:
    """(train prompts, eval prompts). Training prompts are deduplicated and filtered against every
    held-out prompt; self-instruct questions are cached in `<out>/self_instruct_prompts.jsonl`.
    `limit` caps the training prompts per source (the first `limit` after a seeded shuffle);
    prompts whose id is in `exclude_ids` (e.g. already in a stored data set) are left out, and
    stdlib-code chooses its `stdlib_code_n` among the others (package-code its `package_code_n`
    among the documented functions of `code_packages`). self-instruct draws its topics from the
    `seed_topics` lists (files or packaged names, `prompts.SEED_TOPIC_LISTS`), deduplicated, writing
    `self_instruct_batch_size` questions per batch."""
    unknown = set(sources) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown sources {sorted(unknown)}; choose from {', '.join(SOURCES)}")
    held = P.eval_prompts()
    counts = counts if counts is not None else {}
    rng = np.random.default_rng(seed)
    train: list[dict] = []

    exclude = set(exclude_ids)

    def add(name, items, pick=None):  # pick: a choice among the items no excluded id names
        st = {"excluded": sum(p["id"] in exclude for p in items)}
        items = [p for p in items if p["id"] not in exclude]
        items = pick(items) if pick is not None else items
        items = P.drop_near_duplicates(items, held, stats=st, reference=train)
        order = rng.permutation(len(items))
        if limit is not None:
            order = order[:limit]
        picked = [items[i] for i in sorted(order)]
        counts[name] = {"available": len(items), "used": len(picked), **st}
        train.extend(picked)

    if "humaneval" in sources:
        add("humaneval", P.humaneval_prompts("train"))
    if "evals" in sources:
        ev_stats = {}
        add("openai-evals", P.evals_prompts(per_subset=evals_per_subset, skip=evals_skip, stats=ev_stats))
        counts["openai-evals"]["subsets"] = len([k for k, v in ev_stats.items() if v])
    if "self-instruct" in sources:
        topics = list(dict.fromkeys(t for name in seed_topics for t in P.read_seed_topics(name)))
        cache = out_dir / "self_instruct_prompts.jsonl"
        have = read_jsonl(cache)
        want = self_instruct_n if limit is None else min(self_instruct_n, limit)
        si_stats: dict = {}
        if len(have) < want:
            _log(f"self-instruct: {len(have)} cached, writing {want - len(have)} more with the target")
            t0 = time.perf_counter()
            new = P.self_instruct_prompts(engine, topics, want - len(have), held_out=held,
                                          existing=train + have, seed=seed + len(have), stats=si_stats,
                                          batch_size=self_instruct_batch_size)
            append_jsonl(cache, new)
            si_stats["seconds"] = round(time.perf_counter() - t0, 1)
            have = have + new
        add("self-instruct", have[:want])
        counts["self-instruct"]["generation"] = si_stats
        counts["self-instruct"]["seed_topics"] = {"lists": [str(x) for x in seed_topics], "topics": len(topics)}
    code_sources = {"stdlib-code": (C.stdlib_functions, stdlib_code_n, {}),
                    "package-code": (lambda: C.package_functions(code_packages), package_code_n,
                                     {"packages": list(code_packages)})}
    for name, (read, n, info) in code_sources.items():
        if name in sources:  # a seeded choice of n among the candidates no excluded id names
            add(name, read(), pick=lambda items, n=n: C.choose(items, n, seed=seed))
            counts[name].update(info)
    evals = [dict(p, source=p["source"]) for p in held]
    counts["eval"] = {"eval-chat": sum(p["source"] == "eval-chat" for p in evals),
                      "eval-code": sum(p["source"] == "eval-code" for p in evals)}
    return train, evals


# ---------------------------------------------------------------------------------- generation
def plan_batches(lengths: Sequence[int], batch_size: int, seed: int = 0, window: int = 8) -> list[list[int]]:
    """Index batches: a seeded shuffle (sources mix over the run), then within windows of
    `window` batches prompts are sorted by length so a batch's rows are alike."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    out = []
    span = batch_size * window
    for w0 in range(0, len(order), span):
        win = sorted(order[w0:w0 + span].tolist(), key=lambda i: lengths[i])
        out.extend(win[b:b + batch_size] for b in range(0, len(win), batch_size))
    return out


class Distiller:
    """Batched greedy/sampled generation of replies with one engine's target."""

    def __init__(self, engine, max_new_tokens: int = 256, batch_size: int = 8, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, cache_bucket: int = 128,
                 continuous: bool = True, steps_per_call: int = 16):
        import jax.numpy as jnp

        self.engine = engine
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.seed = seed
        self.cache_bucket = cache_bucket
        self.continuous = continuous
        self.steps_per_call = steps_per_call
        self._sampling = (temperature, top_p, top_k)
        self._sp_rows: dict = {}  # row count -> SamplingParams for that many rows
        self.sp = self._sampling_rows(batch_size)
        self.eos = jnp.asarray(engine.eos_ids or [-1], jnp.int32)
        self.shapes: set = set()

    def generate(self, prompt_ids: list[list[int]], key_index: int = 0):
        """Replies for up to batch_size tokenized prompts: list of (token ids, finish)."""
        import jax
        import jax.numpy as jnp

        from ..decoding import generate_tokens, pack_prompts

        n = len(prompt_ids)
        rows = list(prompt_ids) + [prompt_ids[0]] * (self.batch_size - n)  # static batch
        need = max(len(r) for r in rows) + self.max_new_tokens
        cache_len = -(-need // self.cache_bucket) * self.cache_bucket
        self.shapes.add(cache_len)
        toks, lens = pack_prompts(rows, cache_len)
        out = jax.device_get(generate_tokens(
            self.engine.params, self.engine.cfg, jnp.asarray(toks), jnp.asarray(lens),
            jnp.int32(self.max_new_tokens), self.eos, self.sp, jax.random.PRNGKey(self.seed * 1000003 + key_index),
            prefill_chunk=self.engine.prefill_chunk))
        res = []
        eos = set(self.engine.eos_ids)
        for i in range(n):
            new = [int(t) for t in np.asarray(out.tokens[i, lens[i]:lens[i] + int(out.num_new[i])])]
            res.append((new, "stop" if new and new[-1] in eos else "length"))
        return res


    def stream_cache_len(self, prompt_lens: Sequence[int], quantile: float = 0.9) -> int:
        """The one cache length of a continuous run: the bucket that fits `quantile` of the prompts
        with max_new_tokens (longer prompts go to `generate` batches of their own length)."""
        need = int(np.quantile(np.asarray(prompt_lens), quantile)) + self.max_new_tokens
        return -(-need // self.cache_bucket) * self.cache_bucket

    def stream(self, prompt_ids: Sequence[list[int]], cache_len: int):
        """Continuous batching: yields (index, reply token ids, finish) as rows finish.

        The first batch_size prompts start together (`decode_start`); every `steps_per_call` decoding
        steps the finished rows are read out and get the next prompts, all in one `decode_refill`
        call (its rows padded to a power of two, at most batch_size, so it compiles a few times, not
        once per count), so no row idles until the batch's longest reply ends. Each prompt must fit
        `cache_len` with max_new_tokens. Greedy replies are those of `generate` (the same
        computation per row). `refill_calls` / `refilled_rows` count the refills.
        """
        import jax
        import jax.numpy as jnp

        from ..decoding import decode_advance

        e, b = self.engine, self.batch_size
        mnt = jnp.int32(self.max_new_tokens)
        key = jax.random.PRNGKey(self.seed * 1000003)
        pending = list(range(len(prompt_ids)))
        if not pending:
            return
        first, pending = pending[:b], pending[b:]
        self.shapes.add(cache_len)
        st, lens = self._start([prompt_ids[i] for i in first], cache_len, key)
        owner: list = first + [None] * (b - len(first))  # the prompt index each row is generating
        plen = [int(x) for x in lens]
        eos = set(e.eos_ids)
        self.refill_calls = self.refilled_rows = 0
        while any(o is not None for o in owner):
            st = decode_advance(e.params, e.cfg, st, mnt, self.eos, self.sp, key, jnp.int32(self.steps_per_call))
            done = np.asarray(st.done)
            finished = [r for r in range(b) if owner[r] is not None and done[r]]
            if not finished:
                continue
            tokens, num_new = jax.device_get((st.tokens, st.num_new))
            for r in finished:
                new = [int(t) for t in tokens[r, plen[r]:plen[r] + int(num_new[r])]]
                yield owner[r], new, "stop" if new and new[-1] in eos else "length"
                owner[r] = None
            take = min(len(finished), len(pending))
            if take:
                rows_r, new_prompts = finished[:take], [pending.pop(0) for _ in range(take)]
                self.refill_calls += 1
                self.refilled_rows += take
                n = min(1 << (take - 1).bit_length(), b)  # a few compiled sizes (refill_sizes)
                st, l1 = self._refill(st, rows_r, [prompt_ids[i] for i in new_prompts], n, cache_len,
                                      jax.random.fold_in(key, self.refill_calls))
                for r, i, length in zip(rows_r, new_prompts, l1):
                    owner[r], plen[r] = i, int(length)

    def refill_sizes(self) -> list[int]:
        """The row counts a refill is padded to: powers of two below batch_size, and batch_size."""
        b = self.batch_size
        return sorted({min(1 << k, b) for k in range(b.bit_length() + 1)})

    def compile_refills(self, prompt: list[int], cache_len: int) -> None:
        """Compile `decode_refill` for every refill size (padding rows only: nothing is written), so a
        timed `stream` compiles nothing."""
        import jax

        st, _ = self._start([prompt], cache_len, jax.random.PRNGKey(0))
        for n in self.refill_sizes():
            st, _ = self._refill(st, [], [prompt], n, cache_len, jax.random.PRNGKey(n))
        jax.block_until_ready(st)

    def _start(self, prompts: list[list[int]], cache_len: int, key):
        """`decode_start` of up to batch_size prompts (the batch padded with the first): (state, lengths)."""
        import jax.numpy as jnp

        from ..decoding import decode_start, pack_prompts

        e = self.engine
        toks, lens = pack_prompts(prompts + [prompts[0]] * (self.batch_size - len(prompts)), cache_len)
        st = decode_start(e.params, e.cfg, jnp.asarray(toks), jnp.asarray(lens), jnp.int32(self.max_new_tokens),
                          self.eos, self.sp, key, prefill_chunk=e.prefill_chunk)
        return st, lens

    def _refill(self, st, rows_r: list[int], prompts: list[list[int]], n: int, cache_len: int, key):
        """`decode_refill` of `prompts` into rows `rows_r`, both padded to n (padding rows go to row
        batch_size, which writes nothing): (state, the prompts' lengths)."""
        import jax.numpy as jnp

        from ..decoding import decode_refill, pack_prompts

        e, b = self.engine, self.batch_size
        toks, lens = pack_prompts(prompts + [prompts[0]] * (n - len(prompts)), cache_len)
        st = decode_refill(e.params, e.cfg, st, jnp.asarray(rows_r + [b] * (n - len(rows_r)), jnp.int32),
                           jnp.asarray(toks), jnp.asarray(lens), jnp.int32(self.max_new_tokens), self.eos,
                           self._sampling_rows(n), key, prefill_chunk=e.prefill_chunk)
        return st, lens

    def _sampling_rows(self, n: int):
        if n not in self._sp_rows:
            from ..sampling import SamplingParams

            self._sp_rows[n] = SamplingParams.create(n, *self._sampling)
        return self._sp_rows[n]


def distill(engine, prompts: Sequence[dict], out_path: Path, split: str, *, distiller: Distiller,
            max_prompt_tokens: int = 768, seed: int = 0, progress: bool = True, stats: Optional[dict] = None):
    """Generate replies for `prompts` not yet in out_path, appending ShareGPT lines as they finish."""
    _repair_tail(out_path)
    done = {r.get("id") for r in read_jsonl(out_path)}
    todo, too_long = [], []
    for p in prompts:
        if p["id"] in done:
            continue
        ids = engine.encode(p["prompt"])
        if len(ids) > max_prompt_tokens:
            too_long.append(p["id"])
            continue
        todo.append((p, ids))
    if too_long:
        _log(f"{split}: skipped {len(too_long)} prompt(s) longer than {max_prompt_tokens} tokens (e.g. {too_long[:3]})")
    _log(f"{split}: {len(prompts)} prompts, {len(prompts) - len(todo) - len(too_long)} already done, "
         f"{len(todo)} to generate")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc=f"distill {split}", file=sys.stderr, unit="reply", dynamic_ncols=True)
    tally = {"new_tokens": 0, "seconds": 0.0, "done": 0, "stop": 0}

    def emit(items, dt):
        rows = []
        for i, toks, finish in items:
            p, ids = todo[i]
            rows.append({"id": p["id"], "conversations": [{"from": "human", "value": p["prompt"]},
                                                           {"from": "gpt", "value": engine.decode(toks)}],
                         "source": p["source"], "split": split, "finish": finish,
                         "prompt_tokens": len(ids), "new_tokens": len(toks)})
            tally["new_tokens"] += len(toks)
            tally["stop"] += finish == "stop"
        append_jsonl(out_path, rows)
        tally["seconds"] += dt
        tally["done"] += len(items)
        if bar is not None:
            bar.update(len(items))
            bar.set_postfix(tok_s=f"{tally['new_tokens'] / max(tally['seconds'], 1e-9):.0f}",
                            shapes=len(distiller.shapes))

    rest = list(range(len(todo)))
    if distiller.continuous and len(todo) > distiller.batch_size:
        cache_len = distiller.stream_cache_len([len(ids) for _, ids in todo])
        fits = [i for i in rest if len(todo[i][1]) + distiller.max_new_tokens <= cache_len]
        order = [fits[j] for j in np.random.default_rng(seed).permutation(len(fits))]  # sources mixed
        fit_set = set(fits)
        rest = [i for i in rest if i not in fit_set]
        _log(f"{split}: continuous batching of {len(order)} prompts at cache length {cache_len}; "
             f"{len(rest)} longer ones in batches of their own")
        t0 = time.perf_counter()
        for j, toks, finish in distiller.stream([todo[i][1] for i in order], cache_len):
            emit([(order[j], toks, finish)], time.perf_counter() - t0)
            t0 = time.perf_counter()
    batches = plan_batches([len(todo[i][1]) for i in rest], distiller.batch_size, seed)
    for bi, batch in enumerate(batches):
        batch = [rest[k] for k in batch]
        t0 = time.perf_counter()
        results = distiller.generate([todo[i][1] for i in batch], key_index=bi)
        emit([(i, toks, finish) for i, (toks, finish) in zip(batch, results)], time.perf_counter() - t0)
    if bar is not None:
        bar.close()
    if stats is not None:
        t_gen = tally["seconds"]
        stats.update(generated=tally["done"], new_tokens=tally["new_tokens"], seconds=round(t_gen, 1),
                     tokens_per_s=round(tally["new_tokens"] / t_gen, 1) if t_gen else None,
                     stopped_at_eos=tally["stop"], skipped_too_long=len(too_long),
                     continuous=distiller.continuous)
    return stats


# ---------------------------------------------------------------------------------- measuring
def measure(engine, prompts: Sequence[dict], batch_sizes: Sequence[int], max_new_tokens: int,
            batches_each: int = 2, continuous: bool = True) -> dict:
    """Tokens/s of batched greedy generation per batch size (after a compile run): whole batches
    (each runs until its longest reply ends) and, with `continuous`, continuous batching over the
    same number of prompts."""
    ids = [engine.encode(p["prompt"]) for p in prompts]
    ids.sort(key=len)
    res = {}
    for b in batch_sizes:
        d = Distiller(engine, max_new_tokens=max_new_tokens, batch_size=b)
        d.generate(ids[:b])  # compile
        toks, t = 0, 0.0
        for k in range(batches_each):
            chunk = ids[(k + 1) * b:(k + 2) * b] or ids[:b]
            t0 = time.perf_counter()
            out = d.generate(chunk, key_index=k)
            t += time.perf_counter() - t0
            toks += sum(len(x) for x, _ in out)
        res[b] = {"tokens": toks, "seconds": round(t, 2), "tokens_per_s": round(toks / t, 1)}
        _log(f"batch {b}: {toks} tokens in {t:.1f}s = {toks / t:.1f} tokens/s")
        if continuous:  # the same kind of prompts through continuous batching (after a compile run)
            cache_len = d.stream_cache_len([len(x) for x in ids], quantile=1.0)
            for _ in d.stream(ids[:b + 1], cache_len):
                pass
            d.compile_refills(ids[0], cache_len)
            chunk = ids[b:b * (batches_each + 1)]
            t0 = time.perf_counter()
            toks = sum(len(x) for _, x, _ in d.stream(chunk, cache_len))
            t = time.perf_counter() - t0
            res[b]["continuous"] = {"prompts": len(chunk), "tokens": toks, "seconds": round(t, 2),
                                    "tokens_per_s": round(toks / t, 1)}
            _log(f"batch {b}, continuous: {toks} tokens in {t:.1f}s = {toks / t:.1f} tokens/s")
    return res


# ---------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle_jax.training.selfdistill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/work/data/sd", help="output directory")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sources", default=",".join(DEFAULT_SOURCES),
                    help=f"comma list of {', '.join(SOURCES)} (default: {', '.join(DEFAULT_SOURCES)})")
    ap.add_argument("--limit", type=int, default=None, help="at most N training prompts per source")
    ap.add_argument("--self-instruct-n", type=int, default=300)
    ap.add_argument("--stdlib-code-n", type=int, default=600,
                    help="stdlib-code: how many standard-library functions (a seeded choice by --seed)")
    ap.add_argument("--package-code-n", type=int, default=600,
                    help="package-code: how many functions of --code-packages (a seeded choice by --seed)")
    ap.add_argument("--code-packages", default=",".join(C.DEFAULT_PACKAGES),
                    help="package-code: comma list of installed packages whose documented functions become prompts")
    ap.add_argument("--exclude-ids-from", action="append", default=[], metavar="GLOB",
                    help="leave out prompts whose id is in these JSONL(.gz) files, e.g. 'train/data/*.jsonl.gz' "
                         "(repeatable)")
    ap.add_argument("--seed-topics", default="default",
                    help="self-instruct: comma list of topic lists, files (one topic a line) or the packaged "
                         "'default' (144 topics) and 'more' (392 others)")
    ap.add_argument("--self-instruct-batch-size", type=int, default=16,
                    help="self-instruct: questions written per batch (one compiled shape; larger on an accelerator)")
    ap.add_argument("--evals-per-subset", type=int, default=12)
    ap.add_argument("--evals-skip", type=int, default=0,
                    help="skip the first N of each eval's seeded order (the prompts an earlier dataset used)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=768)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-continuous", action="store_true",
                    help="whole batches (each runs until its longest reply ends) instead of continuous batching")
    ap.add_argument("--steps-per-call", type=int, default=16,
                    help="continuous batching: decoding steps between checks for finished rows")
    ap.add_argument("--no-eval", action="store_true", help="do not generate replies for the held-out prompts")
    ap.add_argument("--measure", default=None, help="comma list of batch sizes: print tokens/s and exit")
    ap.add_argument("--splits-only", action="store_true",
                    help="only rewrite train.jsonl / eval.jsonl from <out>/generated.jsonl (e.g. after a stopped run)")
    args = ap.parse_args(argv)
    if args.splits_only:
        counts = write_splits(Path(args.out))
        update_summary(Path(args.out), files=counts)
        print(json.dumps(counts))
        return 0

    from ..engine import Engine

    engine = Engine(args.model)
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    if args.measure:
        sizes = [int(x) for x in args.measure.split(",")]
        ps = P.humaneval_prompts("train")[:8] + P.load_prompt_file(P.BENCH_CHAT_FILE)[:8] * 8
        print(json.dumps({"max_new_tokens": args.max_new_tokens,
                          "batch_sizes": measure(engine, ps, sizes, args.max_new_tokens,
                                                 continuous=not args.no_continuous)}))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts: dict = {}
    train, evals = collect_prompts(engine, sources, out, self_instruct_n=args.self_instruct_n,
                                   evals_per_subset=args.evals_per_subset, evals_skip=args.evals_skip,
                                   limit=args.limit, seed=args.seed, counts=counts,
                                   stdlib_code_n=args.stdlib_code_n, package_code_n=args.package_code_n,
                                   code_packages=[s.strip() for s in args.code_packages.split(",") if s.strip()],
                                   exclude_ids=stored_ids(args.exclude_ids_from),
                                   seed_topics=[s.strip() for s in args.seed_topics.split(",") if s.strip()],
                                   self_instruct_batch_size=args.self_instruct_batch_size)
    _log("prompts: " + json.dumps(counts))
    update_summary(out, model=args.model, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                   continuous=not args.no_continuous, temperature=args.temperature, seed=args.seed,
                   prompts=counts, complete=False)
    d = Distiller(engine, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                  continuous=not args.no_continuous, steps_per_call=args.steps_per_call)
    gen = out / "generated.jsonl"
    runs = {}
    runs["train"] = distill(engine, train, gen, "train", distiller=d, max_prompt_tokens=args.max_prompt_tokens,
                            seed=args.seed, stats={})
    if not args.no_eval:
        runs["eval"] = distill(engine, evals, gen, "eval", distiller=d, max_prompt_tokens=args.max_prompt_tokens,
                               seed=args.seed, stats={})
    split_counts = write_splits(out)
    update_summary(out, runs=runs, files=split_counts, complete=True)
    _log(f"done: {json.dumps(split_counts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
