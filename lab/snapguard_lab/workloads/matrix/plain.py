"""Workload matrix row `plain`: a plain PyTorch training loop (AdamW), nothing else."""

from _common import batch, finish, lm_loss, model_for, parser, setup, StepLog

import torch


def main() -> None:
    args = parser(__doc__).parse_args()
    device = setup(args)
    model = model_for(args).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    log = StepLog(args)
    log.start(model)
    for step in range(1, args.steps + 1):
        x, y = batch(step, args.batch, args.seq, device)
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log.step(step, loss)
    finish(args, model, opt)


if __name__ == "__main__":
    main()
