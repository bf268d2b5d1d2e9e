"""Workload matrix row `amp`: fp16 autocast with a GradScaler (bf16 on the CPU, whose autocast
prefers it); the scaler's state is part of the digests."""

from _common import batch, finish, lm_loss, model_for, parser, setup, StepLog

import torch


def main() -> None:
    args = parser(__doc__).parse_args()
    device = setup(args)
    model = model_for(args).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    scaler = torch.amp.GradScaler(device)
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    log = StepLog(args)
    log.start(model)
    for step in range(1, args.steps + 1):
        x, y = batch(step, args.batch, args.seq, device)
        with torch.autocast(device, dtype=dtype):
            loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)  # skipped (no optimizer step) when the scaled gradients overflowed
        scaler.update()
        log.step(step, loss)
    finish(args, model, opt, scaler=scaler.state_dict())


if __name__ == "__main__":
    main()
