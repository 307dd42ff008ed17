"""Text ↔ token ids for an Engine: the target's tokenizer, loaded without importing transformers
where a snapshot of it is cached.

An Engine needs four things of its tokenizer: encode a text (with or without the special tokens its
post-processor adds), render a chat through the chat template, decode ids, and the EOS id.
transformers gives them, but importing it costs about 0.9 s of every start (stop 68, Zen 4 VM:
6.0 s of the README's one-shot command, 0.2 s of it decoding). For a `TokenizersBackend` (every
converted GGUF, and the Hub directories whose tokenizer_config names it) all four are thin layers
over the Rust tokenizer of the `tokenizers` package plus a jinja2 template. So the first load of a
directory goes through transformers as before (`load_tokenizer`), and `SnapshotCodec.capture`
writes what those layers use to `$EAGLE_JAX_CACHE/tokenizers/<key>.json`:

- the Rust tokenizer's whole state as transformers left it (`backend_tokenizer.to_str()`: model,
  normaliser, pre-tokeniser, the post-processor that transformers rebuilds from add_bos_token /
  add_eos_token, added tokens, decoder);
- the chat template and the special tokens that transformers passes to it;
- the EOS id.

Later loads read that file (`tokenizers` and jinja2 import in about 0.05 s) and do what transformers
5.23 does with the same state: encode with truncation, padding and `encode_special_tokens` off (as
`TokenizersBackend._encode_plus` sets them for a plain call), decode with `skip_special_tokens`,
and render the template in transformers' sandboxed jinja2 environment (trim_blocks, lstrip_blocks,
loop controls, `{% generation %}`, `tojson`, `raise_exception`, `strftime_now`, `dict`,
`namespace`) after its clean-up of the messages (keys with None dropped, reasoning fields aliased).
tests/test_text_codec.py checks every path against transformers, on the real SmolLM2 tokenizer too.

The key hashes the directory's tokenizer files and config.json with the versions of transformers,
tokenizers and jinja2, so an edited file or an upgrade captures a new snapshot (no snapshot where a
version cannot be read). A tokenizer that the snapshot
could not reproduce (another class, `split_special_tokens`, `clean_up_tokenization_spaces`, several
named chat templates) is used through transformers, as is a chat whose messages hold anything but
plain JSON values (transformers would turn such values into placeholders).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional, Sequence

from .atomic_file import write_atomic

FORMAT = 1
# Files that decide a directory's tokenizer (config.json: the model type `load_tokenizer` checks).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "config.json")
SNAPSHOT_CLASSES = ("TokenizersBackend",)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' _REASONING_FIELDS

# Model types whose directories `AutoTokenizer` loads as `TokenizersBackend` when their
# tokenizer_config.json names that class (tests/test_engine_load.py checks each against it; qwen2
# is not one: AutoTokenizer gives it Qwen2Tokenizer).
BACKEND_TOKENIZER_TYPES = ("llama", "mistral", "qwen3")


def load_tokenizer(path: Path):
    """The tokenizer `transformers.AutoTokenizer.from_pretrained(path)` gives, without its detour
    through the model configs where the directory settles the class: a tokenizer_config.json naming
    `TokenizersBackend` (what transformers writes, e.g. for a converted GGUF) with a tokenizer.json,
    no custom code, and a model type in `BACKEND_TOKENIZER_TYPES`. AutoTokenizer imports every
    model config on the way, and PyTorch where it is installed: 4-5 s of each start on the Zen 4 VM
    with torch (stop 64), about 0.6 s without; `TokenizersBackend` alone takes under 1 s. Any other
    directory goes through AutoTokenizer."""
    path = Path(path)
    try:
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        tok_cfg, model_type = {}, None
    if (isinstance(tok_cfg, dict) and tok_cfg.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in tok_cfg and model_type in BACKEND_TOKENIZER_TYPES
            and (path / "tokenizer.json").is_file()):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def snapshot_key(path: Path) -> Optional[str]:
    """The hash of a directory's tokenizer files (names and bytes) and of the installed transformers,
    tokenizers and jinja2 versions: the name of its snapshot. None where a version cannot be read
    (a package installed without its metadata): no snapshot then, since an upgrade would go unseen."""
    h = hashlib.sha256(f"format {FORMAT}".encode())
    for pkg in ("transformers", "tokenizers", "jinja2"):
        try:
            h.update(f"\0{pkg} {metadata.version(pkg)}".encode())
        except metadata.PackageNotFoundError:
            return None
    for name in TOKENIZER_FILES:
        f = Path(path) / name
        if f.is_file():
            h.update(f"\0{name}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:32]


def _plain(value) -> bool:
    """Whether a chat value is plain JSON data (what transformers' clean-up leaves unchanged)."""
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    return False


def _alias_reasoning(messages: list) -> list:
    """transformers' `_alias_reasoning_fields`: a message's reasoning under every name templates read."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    """The chat template compiled in the environment transformers 5.23 builds for it
    (`_cached_compile_jinja_template`; its assistant-token tracker renders a {% generation %} block
    unchanged when no tracker is active, as here)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:  # dict(...) without attribute access to the type
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore-prefixed attributes
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=TemplateDict(), namespace=TemplateNamespace,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env.from_string(source)


class SnapshotCodec:
    """encode / render_chat / decode / eos_token_id from a snapshot (module doc), no transformers."""

    def __init__(self, record: dict, fallback=None):
        from tokenizers import Tokenizer

        if record.get("format") != FORMAT:
            raise ValueError(f"tokenizer snapshot format {record.get('format')!r}, expected {FORMAT}")
        self._tok = Tokenizer.from_str(record["backend"])
        self._tok.no_truncation()
        self._tok.no_padding()
        self._tok.encode_special_tokens = False
        self.chat_template: Optional[str] = record["chat_template"]
        self.special_tokens: dict = dict(record["special_tokens"])
        self.eos_token_id: Optional[int] = record["eos_token_id"]
        self._fallback = fallback  # () -> the transformers tokenizer, for chats the snapshot does not render

    @staticmethod
    def capture(tok) -> Optional[dict]:
        """A transformers tokenizer's snapshot record, or None where a snapshot could not reproduce it."""
        template = tok.chat_template
        if (type(tok).__name__ not in SNAPSHOT_CLASSES or tok.split_special_tokens
                or tok.clean_up_tokenization_spaces or not (template is None or isinstance(template, str))):
            return None
        special = dict(tok.special_tokens_map)
        if not _plain(special):
            return None
        return {"format": FORMAT, "class": type(tok).__name__, "backend": tok.backend_tokenizer.to_str(),
                "chat_template": template, "special_tokens": special, "eos_token_id": tok.eos_token_id}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def render_chat(self, messages: Sequence[dict]) -> str:
        """`apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`."""
        messages = list(messages)
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if not all(type(m) is dict for m in messages) or not _plain(messages) or self.chat_template is None:
            return _HFCodec(self._fallback()).render_chat(messages)  # transformers' own errors and clean-up
        messages = _alias_reasoning([{k: v for k, v in m.items() if v is not None} for m in messages])
        return _compiled_template(self.chat_template).render(messages=messages, tools=None, documents=None,
                                                             add_generation_prompt=True, **self.special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


class _HFCodec:
    """The same four things from a transformers tokenizer."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_token_id = tok.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok(text, add_special_tokens=add_special_tokens).input_ids)

    def render_chat(self, messages: Sequence[dict]) -> str:
        return self.tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def load_codec(path: Path, cache_dir: Optional[Path] = None, loader: Optional[Callable[[], object]] = None):
    """(codec, transformers tokenizer or None) for a model directory: the cached snapshot where there
    is one (the tokenizer then None: not loaded), else the tokenizer, captured into a new snapshot
    where it can be. `cache_dir`: default `registry.default_cache_dir()`; `loader`: what gives the
    transformers tokenizer, here and for the chats a snapshot leaves to it (default: `load_tokenizer`
    of the directory, once)."""
    from .models.registry import default_cache_dir

    path = Path(path)
    loader = loader or functools.cache(functools.partial(load_tokenizer, path))
    key = snapshot_key(path)
    if key is None:
        tok = loader()
        return _HFCodec(tok), tok
    snap = Path(cache_dir or default_cache_dir()) / "tokenizers" / f"{key}.json"
    if snap.is_file():
        try:
            return SnapshotCodec(json.loads(snap.read_text()), loader), None
        except Exception as e:  # noqa: BLE001 - any unreadable snapshot is captured again below
            print(f"[eagle_jax] ignoring the unreadable tokenizer snapshot {snap} ({e}); capturing it again",
                  file=sys.stderr)
    tok = loader()
    record = SnapshotCodec.capture(tok)
    if record is None:
        return _HFCodec(tok), tok
    try:
        snap.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(snap, json.dumps(record))  # a reader never sees half a snapshot
    except OSError as e:  # a read-only cache only costs the next start its speed
        print(f"[eagle_jax] could not save a tokenizer snapshot to {snap} ({e})", file=sys.stderr)
    return SnapshotCodec(record, lambda: tok), tok
