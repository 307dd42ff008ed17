"""Self-distillation: the target regenerates the assistant replies of the training prompts.

EAGLE-3 trains its drafter on the target's own outputs, so the head learns the distribution it
will be asked to predict. This tool collects prompts (HumanEval train split, OpenAI-evals
questions, self-instruct questions the target writes from seed topics), generates replies with the
target in batches (jitted `generate_tokens`, prompts grouped by length, one cache-length bucket per
compile), and appends ShareGPT-layout lines to `<out>/generated.jsonl` as each batch finishes:

    {"id", "conversations": [{"from": "human", "value"}, {"from": "gpt", "value"}], "source",
     "split": "train"|"eval", "finish": "stop"|"length", "prompt_tokens", "new_tokens"}

A killed run continues where it stopped (ids already in generated.jsonl are skipped; a torn last
line is cut off). At the end `<out>/train.jsonl` and `<out>/eval.jsonl` are written (eval = the
held-out prompts of `eagle_jax/data/eval_*_prompts.jsonl` only) with `<out>/summary.json`.

    python -m eagle_jax.training.selfdistill --out /work/data/sd --max-new-tokens 256 --batch-size 8 \
        --sources humaneval,evals,self-instruct --self-instruct-n 300
    python -m eagle_jax.training.selfdistill --measure 4,8,16 --max-new-tokens 128   # tokens/s only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from . import prompts as P

SOURCES = ("humaneval", "evals", "self-instruct")


def _log(msg: str) -> None:
    print(f"[selfdistill] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- files
def _repair_tail(path: Path) -> None:
    """Cut a torn last line (a run killed mid-write) so appends start on a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    _log(f"{path}: cutting a torn last line ({len(data) - cut} bytes) left by an interrupted run")
    with open(path, "r+b") as f:
        f.truncate(cut)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                _log(f"{path}:{lineno}: skipped: bad JSON ({e.msg})")
    return out


def append_jsonl(path: Path, rows: Sequence[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------- prompts
def collect_prompts(engine, sources: Sequence[str], out_dir: Path, *, self_instruct_n: int = 300,
                    evals_per_subset: int = 12, limit: Optional[int] = None, seed: int = 0,
                    counts: Optional[dict] = None) -> tuple[list[dict], list[dict]]:
    """(train prompts, eval prompts). Training prompts are deduplicated and filtered against every
    held-out prompt; self-instruct questions are cached in `<out>/self_instruct_prompts.jsonl`.
    `limit` caps the training prompts per source (the first `limit` after a seeded shuffle)."""
    unknown = set(sources) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown sources {sorted(unknown)}; choose from {', '.join(SOURCES)}")
    held = P.eval_prompts()
    counts = counts if counts is not None else {}
    rng = np.random.default_rng(seed)
    train: list[dict] = []

    def add(name, items):
        st = {}
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
        add("openai-evals", P.evals_prompts(per_subset=evals_per_subset, stats=ev_stats))
        counts["openai-evals"]["subsets"] = len([k for k, v in ev_stats.items() if v])
    if "self-instruct" in sources:
        cache = out_dir / "self_instruct_prompts.jsonl"
        have = read_jsonl(cache)
        want = self_instruct_n if limit is None else min(self_instruct_n, limit)
        si_stats: dict = {}
        if len(have) < want:
            _log(f"self-instruct: {len(have)} cached, writing {want - len(have)} more with the target")
            t0 = time.perf_counter()
            new = P.self_instruct_prompts(engine, P.read_seed_topics(), want - len(have), held_out=held,
                                          existing=train + have, seed=seed + len(have), stats=si_stats)
            append_jsonl(cache, new)
            si_stats["seconds"] = round(time.perf_counter() - t0, 1)
            have = have + new
        add("self-instruct", have[:want])
        counts["self-instruct"]["generation"] = si_stats
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
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, cache_bucket: int = 128):
        import jax.numpy as jnp

        from ..sampling import SamplingParams

        self.engine = engine
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.seed = seed
        self.cache_bucket = cache_bucket
        self.sp = SamplingParams.create(batch_size, temperature, top_p, top_k)
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


def distill(engine, prompts: Sequence[dict], out_path: Path, split: str, *, distiller: Distiller,
            max_prompt_tokens: int = 768, seed: int = 0, progress: bool = True, stats: Optional[dict] = None):
    """Generate replies for `prompts` not yet in out_path, appending ShareGPT lines batch by batch."""
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
    batches = plan_batches([len(ids) for _, ids in todo], distiller.batch_size, seed)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc=f"distill {split}", file=sys.stderr, unit="reply", dynamic_ncols=True)
    new_tokens, t_gen, n_done, n_stop = 0, 0.0, 0, 0
    for bi, batch in enumerate(batches):
        t0 = time.perf_counter()
        results = distiller.generate([todo[i][1] for i in batch], key_index=bi)
        dt = time.perf_counter() - t0
        rows = []
        for i, (toks, finish) in zip(batch, results):
            p, ids = todo[i]
            text = engine.decode(toks)
            rows.append({"id": p["id"], "conversations": [{"from": "human", "value": p["prompt"]},
                                                           {"from": "gpt", "value": text}],
                         "source": p["source"], "split": split, "finish": finish,
                         "prompt_tokens": len(ids), "new_tokens": len(toks)})
            new_tokens += len(toks)
            n_stop += finish == "stop"
        append_jsonl(out_path, rows)
        t_gen += dt
        n_done += len(batch)
        if bar is not None:
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / max(t_gen, 1e-9):.0f}", shapes=len(distiller.shapes))
    if bar is not None:
        bar.close()
    if stats is not None:
        stats.update(generated=n_done, new_tokens=new_tokens, seconds=round(t_gen, 1),
                     tokens_per_s=round(new_tokens / t_gen, 1) if t_gen else None, stopped_at_eos=n_stop,
                     skipped_too_long=len(too_long))
    return stats


def write_splits(out_dir: Path) -> dict:
    """train.jsonl / eval.jsonl from generated.jsonl (by each line's split); counts per source."""
    rows = read_jsonl(out_dir / "generated.jsonl")
    seen, counts = set(), {}
    files = {s: open(out_dir / f"{s}.jsonl.tmp", "w", encoding="utf-8") for s in ("train", "eval")}
    try:
        for r in rows:
            if r["id"] in seen:
                continue
            seen.add(r["id"])
            s = r.get("split", "train")
            files[s].write(json.dumps({k: r[k] for k in ("id", "conversations", "source", "finish") if k in r},
                                      ensure_ascii=False) + "\n")
            c = counts.setdefault(s, {}).setdefault(r["source"], {"conversations": 0, "reply_tokens": 0, "stop": 0})
            c["conversations"] += 1
            c["reply_tokens"] += int(r.get("new_tokens", 0))
            c["stop"] += r.get("finish") == "stop"
    finally:
        for f in files.values():
            f.close()
    for s in files:
        os.replace(out_dir / f"{s}.jsonl.tmp", out_dir / f"{s}.jsonl")
    return counts


# ---------------------------------------------------------------------------------- measuring
def measure(engine, prompts: Sequence[dict], batch_sizes: Sequence[int], max_new_tokens: int,
            batches_each: int = 2) -> dict:
    """Tokens/s of batched greedy generation per batch size (after a compile run)."""
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
    return res


# ---------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle_jax.training.selfdistill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/work/data/sd", help="output directory")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sources", default=",".join(SOURCES), help=f"comma list of {', '.join(SOURCES)}")
    ap.add_argument("--limit", type=int, default=None, help="at most N training prompts per source")
    ap.add_argument("--self-instruct-n", type=int, default=300)
    ap.add_argument("--evals-per-subset", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=768)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-eval", action="store_true", help="do not generate replies for the held-out prompts")
    ap.add_argument("--measure", default=None, help="comma list of batch sizes: print tokens/s and exit")
    ap.add_argument("--splits-only", action="store_true",
                    help="only rewrite train.jsonl / eval.jsonl from <out>/generated.jsonl (e.g. after a stopped run)")
    args = ap.parse_args(argv)
    if args.splits_only:
        counts = write_splits(Path(args.out))
        print(json.dumps(counts))
        return 0

    from ..engine import Engine

    engine = Engine(args.model)
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    if args.measure:
        sizes = [int(x) for x in args.measure.split(",")]
        ps = P.humaneval_prompts("train")[:8] + P.load_prompt_file(P.BENCH_CHAT_FILE)[:8] * 8
        print(json.dumps({"max_new_tokens": args.max_new_tokens,
                          "batch_sizes": measure(engine, ps, sizes, args.max_new_tokens)}))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts: dict = {}
    train, evals = collect_prompts(engine, sources, out, self_instruct_n=args.self_instruct_n,
                                   evals_per_subset=args.evals_per_subset, limit=args.limit, seed=args.seed,
                                   counts=counts)
    _log("prompts: " + json.dumps(counts))
    d = Distiller(engine, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    gen = out / "generated.jsonl"
    runs = {}
    runs["train"] = distill(engine, train, gen, "train", distiller=d, max_prompt_tokens=args.max_prompt_tokens,
                            seed=args.seed, stats={})
    if not args.no_eval:
        runs["eval"] = distill(engine, evals, gen, "eval", distiller=d, max_prompt_tokens=args.max_prompt_tokens,
                               seed=args.seed, stats={})
    split_counts = write_splits(out)
    summary = {"model": args.model, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
               "temperature": args.temperature, "prompts": counts, "runs": runs, "files": split_counts}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _log(f"done: {json.dumps(split_counts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
