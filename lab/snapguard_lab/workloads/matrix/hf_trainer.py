"""Workload matrix row `hf-trainer`: a Hugging Face Trainer (transformers) training a GPT-2 built
from its config (nothing is downloaded) on generated token sequences. Deterministic through the
Trainer's own full_determinism; each optimizer step's loss (the tensor training_step returns,
not the rounded figure the Trainer logs) goes to the step log."""

import os
import tempfile

from _common import SEED, finish, parser, sample, setup, StepLog

import torch


def main() -> None:
    args = parser(__doc__).parse_args()
    device = setup(args)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    heads = 4 if args.width % 4 == 0 else 1
    config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.width, n_layer=args.layers, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"  # deterministic under use_deterministic_algorithms
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(config)
    data = []
    for i in range(args.steps * args.batch):
        x, _ = sample(i, args.seq)
        data.append({"input_ids": x, "labels": x.clone()})
    out = args.workdir or tempfile.mkdtemp(prefix="hf-trainer-")
    targs = TrainingArguments(
        output_dir=os.path.join(out, "hf-out"), max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=3e-4, weight_decay=0.1, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        logging_strategy="no", save_strategy="no", report_to="none", seed=SEED, data_seed=SEED,
        full_determinism=True, dataloader_num_workers=0, disable_tqdm=True, use_cpu=device == "cpu")
    log = StepLog(args)
    losses: dict[str, torch.Tensor] = {}

    class LoggedTrainer(Trainer):
        def training_step(self, *a, **kw):  # type: ignore[no-untyped-def]
            loss = super().training_step(*a, **kw)
            losses["last"] = loss
            return loss

    class StepLogger(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kw):  # type: ignore[no-untyped-def]
            log.start(model)

        def on_step_end(self, targs, state, control, **kw):  # type: ignore[no-untyped-def]
            log.step(state.global_step, losses["last"])

    trainer = LoggedTrainer(model=model, args=targs, train_dataset=data, callbacks=[StepLogger()])
    trainer.train()
    finish(args, model, trainer.optimizer)


if __name__ == "__main__":
    main()
