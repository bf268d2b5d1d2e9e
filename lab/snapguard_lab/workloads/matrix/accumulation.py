"""Workload matrix row `accumulation`: gradients accumulated over --micro micro-batches (4) per
optimizer step. Each micro-batch logs `micro <step> <k> <time>`: the matrix asks for the snapshot
in the middle of one, and the take point must hold only at the end of the optimizer step."""

from _common import batch, finish, lm_loss, model_for, parser, setup, StepLog

import time

import torch


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--micro", type=int, default=4)
    args = ap.parse_args()
    device = setup(args)
    model = model_for(args).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    log = StepLog(args)
    log.start(model)
    pace = args.min_step_s / args.micro
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for k in range(1, args.micro + 1):
            t0 = time.monotonic()
            x, y = batch(step * args.micro + k, args.batch, args.seq, device)
            loss = lm_loss(model(x), y) / args.micro
            loss.backward()
            total += loss.detach()
            if device == "cuda":
                torch.cuda.synchronize()
            time.sleep(max(0.0, pace - (time.monotonic() - t0)))
            log.note(f"micro {step} {k}")
        opt.step()
        log.step(step, total)
    finish(args, model, opt)


if __name__ == "__main__":
    main()
