"""Subprocess side of tests/test_trainer.py (not collected by pytest: no test_ prefix).

  python tests/trainer_worker.py sharded OUT.npz
      8 virtual CPU devices: one tiny EAGLE-3 head trained 3 steps on a (1,1,1) mesh of one device
      and on the (2,2,2) mesh of all eight; writes both runs' losses and params.
  python tests/trainer_worker.py kill CONFIG.json KILL_AT
      the toy job; SIGKILLs itself right after step KILL_AT (once pending checkpoints are on disk).
"""

from __future__ import annotations

import json
import os
import signal
import sys

MODE = sys.argv[1]
if MODE == "sharded":  # before jax is imported: the device count is fixed at backend start
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def eagle3_setup():
    """A tiny EAGLE-3 head (every dim divisible by 2) and a loss through the head's real code."""
    from eagle_jax.draft import DraftConfig, fuse_features, head_logits, head_step, init_head
    from eagle_jax.draft.heads import DraftHead
    from eagle_jax.models.config import ModelConfig
    from eagle_jax.training.sharding import take_embedding

    target = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)
    hcfg = DraftConfig.for_target("eagle3", target, draft_vocab_size=64)
    head = jax.jit(init_head, static_argnums=0)(hcfg, jax.random.key(1))  # one compile, not hundreds of ops
    k_emb, k_ids = jax.random.split(jax.random.key(2))
    aux = {"target": {"embed_tokens": {"embedding": 0.5 * jax.random.normal(k_emb, (101, 64))}}, "d2t": head.d2t}
    b, l = 8, 16
    ids = np.asarray(jax.random.randint(k_ids, (3, b, l), 0, 101), np.int32)
    batches = [{"input_ids": ids[i], "loss_mask": np.ones((b, l), np.float32), "lengths": np.full((b,), l, np.int32)}
               for i in range(3)]

    def loss_fn(params, aux, batch, rng):
        h = DraftHead(params, aux["d2t"], hcfg)
        ids_bl = batch["input_ids"]
        emb_bld = take_embedding(aux["target"]["embed_tokens"]["embedding"], ids_bl)
        feats_blf = jnp.concatenate([emb_bld, jnp.tanh(emb_bld), emb_bld ** 2], axis=-1)
        feats_blf = feats_blf + 0.01 * jax.random.normal(rng, feats_blf.shape)
        pos_bl = jnp.broadcast_to(jnp.arange(ids_bl.shape[1]), ids_bl.shape)
        out_bld, _ = head_step(h, aux["target"]["embed_tokens"]["embedding"], ids_bl, fuse_features(h, feats_blf),
                               pos_bl)
        logits = head_logits(h, None, None, out_bld)
        tgt = jnp.roll(ids_bl, -1, axis=1) % logits.shape[-1]
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[..., None], -1)[..., 0]
        return ce.mean(), {"acc_0": (logits.argmax(-1) == tgt).mean()}

    return head.params, aux, loss_fn, batches


def sharded(out_path: str) -> None:
    from eagle_jax.training.sharding import make_mesh
    from eagle_jax.training.trainer import TrainConfig, Trainer

    assert jax.device_count() == 8, jax.devices()
    params, aux, loss_fn, batches = eagle3_setup()
    # eps=1 keeps AdamW's update linear in the gradient (m / (sqrt(v) + 1)): with eps=1e-8 the update
    # of a near-zero gradient entry is g/|g|, which turns float reassociation noise in a sharded
    # reduction into visible parameter differences. Clipping (grad norm ≈ 1 > 0.5) and decay stay on.
    cfg = TrainConfig(learning_rate=0.1, eps=1.0, warmup_steps=0, total_steps=10, weight_decay=0.1, batch_size=8,
                      seq_len=16, save_every=0, progress=False, plot=False,
                      output_dir=os.path.join(os.path.dirname(out_path), "o"))
    result = {}
    for name, mesh in (("single", make_mesh(1, 1, 1, devices=jax.devices()[:1])), ("mesh", make_mesh(2, 2, 2))):
        t = Trainer(cfg, params, aux, loss_fn, mesh=mesh)
        metrics = [jax.device_get(t.train_step(b)) for b in batches]
        result[f"{name}/loss"] = np.array([m["loss"] for m in metrics])
        result[f"{name}/grad_norm"] = np.array([m["grad_norm"] for m in metrics])
        flat = jax.tree_util.tree_flatten_with_path(jax.device_get(t.params))[0]
        for path, x in flat:
            result[f"{name}/{jax.tree_util.keystr(path)}"] = np.asarray(x)
        if name == "mesh":  # record that arrays really were split
            shards = {jax.tree_util.keystr(p): x.sharding.shard_shape(x.shape) != x.shape
                      for p, x in jax.tree_util.tree_flatten_with_path(t.params)[0]}
            result["mesh/split_count"] = np.array(sum(shards.values()))
            result["mesh/total_count"] = np.array(len(shards))
    np.savez(out_path, **result)


def kill(config_path: str, kill_at: int) -> None:
    from eagle_jax.train import build_job, load_config
    from eagle_jax.training.trainer import TrainConfig, Trainer

    config = load_config(config_path)
    params, aux, loss_fn, train_iter, eval_fn = build_job(config)

    def hook(trainer, step, metrics):
        if step == kill_at:
            trainer.checkpoints.wait_until_finished()  # what a real crash may or may not allow
            print(json.dumps({"killed_at": step, "saved": trainer.checkpoints.all_steps()}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    Trainer(TrainConfig.from_dict(config["train"]), params, aux, loss_fn, train_iter, eval_fn, hooks=[hook]).run()


if __name__ == "__main__":
    if MODE == "sharded":
        sharded(sys.argv[2])
    elif MODE == "kill":
        kill(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {MODE!r}")
