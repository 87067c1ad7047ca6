"""One rank of the FSDP Trainer test (``python -m tests.distributed.fsdp_trainer_worker OUT``).

A 2-rank Trainer with ``fsdp="full_shard auto_wrap"`` (size-based units, activation checkpointing)
trains the toy with gradient accumulation, clipping, periodic evaluation and
load_best_model_at_end; then evaluate(), predict() and
save_model() run on the sharded model. Rank 0 checks the saved full weights against a plain
(unsharded) copy of the model: same eval loss and same predictions. Prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from trainer_runtime.toy import ToyDataset, ToyModel
from trainer_runtime.trainer import Trainer
from trainer_runtime.training_args import TrainingArguments


def main() -> int:
    out = sys.argv[1]
    torch.set_num_threads(1)
    # Rank-dependent init: the Trainer must broadcast rank 0's weights before sharding.
    torch.manual_seed(int(os.environ["RANK"]))
    model = ToyModel()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(
        output_dir=os.path.join(out, "run"),
        max_steps=6,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        learning_rate=1e-2,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        per_device_eval_batch_size=8,
        logging_steps=1,
        use_cpu=True,
        report_to="none",
        fsdp="full_shard auto_wrap",
        fsdp_config={
            "min_num_params": 100,
            "state_dict_type": "SHARDED_STATE_DICT",
            "activation_checkpointing": True,
        },
    )
    eval_set = ToyDataset(40, seed=5)  # 40 / (2 ranks x 8) is not whole: padded on the last batch
    trainer = Trainer(
        model=model, args=args, train_dataset=ToyDataset(128, seed=3), eval_dataset=eval_set
    )
    rank = dist.get_rank()
    # sync_module_states: the sharded model starts from rank 0's weights on every rank.
    gathered = trainer._gathered_model_tensors() or {}
    synced = rank != 0 or all(torch.equal(gathered[k], initial[k]) for k in initial)
    output = trainer.train()
    metrics = trainer.evaluate()
    predictions = trainer.predict(eval_set)
    saved = trainer.save_model(os.path.join(out, "final"))
    grad_norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    result: dict = {
        "rank": rank,
        "global_step": output.global_step,
        "eval_loss": metrics["eval_loss"],
        "pred_shape": list(predictions.predictions.shape),
        "pred_sum": float(torch.as_tensor(predictions.predictions).double().sum()),
        "saved": saved,
        "best": trainer.state.best_model_checkpoint,
        "best_step": trainer.state.best_global_step,
        "best_metric": trainer.state.best_metric,
        "grad_norms": grad_norms,
        "synced_from_rank0": synced,
        "checkpointed": sum(
            type(m).__name__ == "CheckpointWrapper" for m in trainer.model.modules()
        ),
        "units": sorted(
            type(m).__name__ for m in trainer.model.modules() if type(m).__name__.startswith("FSDP")
        ),
    }
    if rank == 0:
        # The saved model as a plain module, evaluated over the whole eval set in one process.
        plain = ToyModel()
        plain.load_state_dict(load_file(os.path.join(out, "final", "model.safetensors")))
        plain.eval()
        with torch.no_grad():
            outs = plain(eval_set.x, eval_set.labels)
        result["plain_eval_loss"] = float(outs["loss"])
        result["plain_pred_sum"] = float(outs["logits"].double().sum())
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization: on gloo, torch's teardown of FSDP2's async collectives
    # occasionally aborts there ("terminate called without an active exception", about 1 run in
    # 60 here) after everything above has finished and been reported.
    os._exit(code)
