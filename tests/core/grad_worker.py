"""One mini-batch's gradient under each set of loss knobs, accumulated over micro-batches, summed over ranks.

test_loss_accumulation.py calls minibatch_gradient in its own process, and runs this file once per rank
of a 2-process gloo group (CPU, a file:// rendezvous, nothing on the network):

    python grad_worker.py RANK WORLD INIT_FILE MODEL_DIR BATCH_FILE OUT_FILE

Each rank takes its contiguous share of the batch's rows and does what the trainer does: the loss
denominator summed over ranks, the top-entropy threshold from every rank's token entropies, the
micro-batches' gradients accumulated, then summed over ranks. Rank 0 saves {knobs name: gradient}.
"""
import sys

import torch

from grpo import distributed
from grpo.loss import completion_logprobs, grpo_loss, loss_denominator, top_entropy_threshold

MAX_NEW_TOKENS = 24  # the rollout64 fixture's
TEMPERATURE = 1.5
CHUNK_ROWS = 50      # token rows per output-head chunk: the chunked (checkpointed) path, entropies included
GSPO = {"importance_level": "sequence", "clip_low": 0.02, "clip_high": 0.03}
KNOBS = {
    "token-mean": {},
    "seq-mean": {"loss_agg": "seq-mean"},
    "dr-grpo": {"loss_agg": "dr-grpo"},
    "gspo token-mean": GSPO,
    "gspo seq-mean": {**GSPO, "loss_agg": "seq-mean"},
    "gspo dr-grpo": {**GSPO, "loss_agg": "dr-grpo"},
    "dual clip": {"dual_clip": 1.5},
    "kl k1": {"kl_estimator": "k1"},
    "kl k2": {"kl_estimator": "k2"},
    "entropy bonus": {"entropy_coef": 0.05},
    "top entropy token-mean": {"top_entropy_quantile": 0.2},
    "top entropy seq-mean": {"top_entropy_quantile": 0.2, "loss_agg": "seq-mean"},
    "top entropy dr-grpo": {"top_entropy_quantile": 0.2, "loss_agg": "dr-grpo"},
    "all at once": {**GSPO, "loss_agg": "dr-grpo", "dual_clip": 1.2, "kl_estimator": "k2", "entropy_coef": 0.05,
                    "top_entropy_quantile": 0.3},
}


def entropies(model, batch, micro):
    """The policy's entropy at every completion position of the batch's rows, without gradients."""
    inputs, attention, cmask = batch["inputs"], batch["attention"], batch["cmask"]
    with torch.no_grad():
        return torch.cat([completion_logprobs(model, inputs[s:s + micro], attention[s:s + micro], cmask.shape[1],
                                              TEMPERATURE, CHUNK_ROWS, with_entropy=True)[1]
                          for s in range(0, inputs.shape[0], micro)])


def minibatch_gradient(model, batch, knobs, micro, *, threshold_per_micro_batch=False):
    """The flat gradient of this rank's rows of the mini-batch `batch`, micro rows per forward/backward.

    threshold_per_micro_batch: the mistake the tests guard against, a top-entropy threshold taken
    from each micro-batch's own tokens instead of the whole mini-batch's.
    """
    knobs = dict(knobs)
    quantile = knobs.pop("top_entropy_quantile", None)
    cmask = batch["cmask"]
    denominator = distributed.all_sum([loss_denominator(cmask, knobs.get("loss_agg", "token-mean"),
                                                        MAX_NEW_TOKENS)])[0]
    pg_mask = None
    if quantile is not None:
        entropy = entropies(model, batch, micro)
        values = torch.cat(distributed.gather_objects(entropy[cmask.bool()]))
        pg_mask = entropy >= top_entropy_threshold(values, quantile)
    model.zero_grad(set_to_none=True)
    for s in range(0, cmask.shape[0], micro):
        rows = slice(s, s + micro)
        logp, entropy = completion_logprobs(model, batch["inputs"][rows], batch["attention"][rows], cmask.shape[1],
                                            TEMPERATURE, CHUNK_ROWS, with_entropy=True)
        mask_rows = None
        if threshold_per_micro_batch:
            mask_rows = entropy.detach() >= top_entropy_threshold(entropy.detach()[cmask[rows].bool()], quantile)
        elif pg_mask is not None:
            mask_rows = pg_mask[rows]
        loss, _ = grpo_loss(logp, batch["old"][rows], batch["adv"][rows], cmask[rows], denominator,
                            ref_logp=batch["ref"][rows], kl_coef=0.05, entropy=entropy, pg_mask=mask_rows, **knobs)
        loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    distributed.sum_gradients(params)
    return torch.cat([p.grad.reshape(-1) for p in params])


def main(rank, world, init_file, model_dir, batch_file, out_file):
    from grpo.model import load_policy
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = load_policy(model_dir, "cpu")
    batch = torch.load(batch_file)
    share = batch["cmask"].shape[0] // world
    mine = {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}
    grads = {name: minibatch_gradient(model, mine, knobs, micro=8) for name, knobs in KNOBS.items()}
    if rank == 0:
        torch.save(grads, out_file)
    distributed.close()


if __name__ == "__main__":  # with the repository on PYTHONPATH (helpers.env)
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:7])
