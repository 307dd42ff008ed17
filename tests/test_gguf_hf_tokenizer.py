"""A GGUF's tokenizer built without torch (eagle_jax.models.gguf_hf_tokenizer) is transformers' own
GGUF tokenizer, and converting and decoding a GGUF model need no torch: transformers 5.23 reads GGUF
metadata through a module that imports torch, which the runtime must not need (README's first
command runs where only `pip install -e .` went in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("gguf")
from gguf_util import REAL_ALIAS, TOKENS, tiny_config, write_tiny_gguf  # noqa: E402

from eagle_jax.models import registry  # noqa: E402
from eagle_jax.models.gguf_hf_tokenizer import build_tokenizer, gguf_metadata  # noqa: E402

TEXTS = ["the tether he said", "  hé\tthe\n\nthe  ", "<|im_start|>user\nhi<|im_end|>", "",
         "def f(x):\n    return x ** 2  # ✓ 数字 😀"]

# a SentencePiece ("llama") vocabulary as llama.cpp writes it: specials, the 256 byte pieces, and
# pieces with scores (their merges come from the scores)
SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁t", "he"]
SPM_TYPES = [2, 3, 3] + [6] * 256 + [1, 1]  # unknown, control, byte, normal


def _spm_tokenizer(w):
    w.add_tokenizer_model("llama")
    w.add_token_list(SPM_TOKENS)
    w.add_token_scores([0.0] * 259 + [-1.0, -2.0])
    w.add_token_types(SPM_TYPES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")


def _transformers_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)  # needs torch (a test dependency)


def _assert_same(mine, ref):
    assert type(mine) is type(ref)
    assert mine.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template", "add_bos_token",
                 "add_eos_token", "model_max_length"):
        assert getattr(mine, attr) == getattr(ref, attr), attr
    for text in TEXTS:
        assert mine(text).input_ids == ref(text).input_ids, text
    msgs = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "the"}]
    assert mine.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(msgs, tokenize=False)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tokenizer_is_transformers_own_gguf_tokenizer(tmp_path, kind):
    path = tmp_path / f"{kind}.gguf"
    if kind == "gpt2":  # byte-level BPE: SmolLM2, Llama 3, Qwen
        write_tiny_gguf(path, tiny_config("llama"))
    else:  # SentencePiece: Llama 2, Mistral
        assert len(SPM_TOKENS) == len(TOKENS)  # tiny_config's vocabulary size
        write_tiny_gguf(path, tiny_config("llama"), tokenizer=False, metadata=_spm_tokenizer)
    mine = build_tokenizer(path)
    _assert_same(mine, _transformers_tokenizer(path))
    assert mine.add_bos_token is (kind == "llama")  # llama.cpp's default for a sentencepiece vocabulary


def test_metadata_is_what_transformers_reads(tmp_path):
    from transformers.integrations.gguf.reader import read_gguf_metadata

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, tiny_config("llama"),
                    metadata=lambda w: (w.add_array("test.strings", ["a", "b"]), w.add_array("test.ints", [3, 4])))
    want, _ = read_gguf_metadata(str(path), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    got = gguf_metadata(path)
    assert got == want and got["test.strings"] == 2 and got["tokenizer.ggml.tokens"] == TOKENS


@pytest.mark.slow
def test_real_smollm2_tokenizer_is_transformers_own():
    registry.resolve_model(REAL_ALIAS)
    path = registry.alias_gguf(REAL_ALIAS)
    _assert_same(build_tokenizer(path), _transformers_tokenizer(path))


@pytest.mark.slow
def test_gguf_conversion_and_decoding_run_without_torch(tmp_path):
    """`python -m eagle_jax.serve` on a GGUF it has never seen (conversion, tokenizer, speculative
    decoding) in a process where torch cannot be imported; the tokens are plain decoding's. (XLA's
    matmuls: the tiny file's float32 tensors have no GGUF blocks, and the CPU kernel would be rebuilt
    in the new cache.)"""
    from eagle_jax.engine import Engine

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_config("llama"))
    code = ("import sys, runpy; sys.modules['torch'] = None  # import torch fails; find_spec says it is absent\n"
            "sys.argv = ['serve'] + sys.argv[1:]\n"
            "try:\n    runpy.run_module('eagle_jax.serve', run_name='__main__')\n"
            "finally:\n    import transformers.utils as u; print('torch available:', u.is_torch_available(), "
            "file=sys.stderr)")
    env = dict(os.environ, EAGLE_JAX_CACHE=str(tmp_path / "cache"), EAGLE_JAX_NO_CPU_KERNEL="1")
    out = subprocess.run([sys.executable, "-c", code, "--model", str(path), "--prompt", "the tether",
                          "--max-new-tokens", "6", "--json", "--method", "eagle2", "--drafter", "random",
                          "--matmul", "xla"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch available: False" in out.stderr  # transformers saw no torch
    assert "PyTorch was not found" not in out.stderr  # and did not say so: serving never needs it
    (line,) = out.stdout.splitlines()
    (converted,) = (tmp_path / "cache" / "converted").iterdir()
    plain = Engine(str(converted), matmul="xla", progress=False).generate("the tether", 6)
    assert json.loads(line)["tokens"] == plain.tokens and len(plain.tokens) == 6
